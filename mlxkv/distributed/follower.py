"""Ranks 1..N-1 of ``mlxkv serve --distributed``: no HTTP and no scheduler, only rank 0's messages, applied.

A follower loads the same model, keeps its shard (:func:`~mlxkv.distributed.group.shard_model`) and builds its
shard of the paged pool, then loops: receive a :class:`~mlxkv.distributed.steps.StepMessage`, apply its pool
changes in order with :func:`~mlxkv.distributed.changes.apply_change` (the function rank 0 applied them with),
check that its pool holds as many free blocks and the same sequences as rank 0's, and run the step the message
describes — the same forward rank 0 runs at the same time, through the same collectives. It never samples: rank 0
does, and sends the next step's inputs inside the graph.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import mlx.core as mx

from mlxkv.distributed.changes import Change, Diverged, apply_change, sequence_state
from mlxkv.distributed.channel import PlanChannel
from mlxkv.distributed.leader_pool import ChangeLog, use_plan_clock
from mlxkv.distributed.steps import DecodeRun, Idle, PrefillRun, ProbeRun, Step, StepMessage, Stop, TierHave
from mlxkv.distributed.tier import rank_tier, report_flush
from mlxkv.distributed.watchdog import Watchdog, fatal
from mlxkv.engine.batch_probe import probe_batched_decode, probe_batched_prefill
from mlxkv.engine.runner import ModelRunner
from mlxkv.kv import BatchUnsupported, CachePool, SequenceId

log = logging.getLogger("mlxkv.distributed")


class UnknownStep(TypeError):
    """Rank 0 sent a step this rank does not know."""


class Replayer:
    """Applies rank 0's messages to this rank's ``pool`` and runs their steps on ``model``."""

    def __init__(self, model: Any, pool: CachePool, channel: PlanChannel):
        self.model = model
        self.pool = pool
        self.channel = channel
        self.clock = ChangeLog()  # only its clock: rank 0's time, as of its last message
        use_plan_clock(pool, self.clock)
        self.runner = ModelRunner(model, batched=True, batched_prefill=True, totals=_runner_totals())
        self.forwards = 0
        self.tier = rank_tier(pool)  # this rank's KV tier: restores come from rank 0's changes
        if self.tier is not None:
            channel.tier_figures = self.tier.figures
        self.flush_timeout = 0.0  # the stop message's: how long this rank's KV tier may take to flush

    def finish(self) -> None:
        """After :meth:`run`: flush this rank's KV tier (its write-behind) within rank 0's flush timeout, as rank 0
        flushes its own."""
        report_flush(self.channel.rank, self.pool.flush_tier(self.flush_timeout))

    def run(self) -> None:
        """Until rank 0 says stop."""
        while self.receive(self.channel.receive()):
            pass

    def receive(self, message: StepMessage) -> bool:
        """Apply one message and run its step; False when it says stop.

        Raises:
            Diverged: this rank's pool does not hold what rank 0's does after the same changes (the follower then
                ends the launch, :func:`serve_follower`).
        """
        for change in message.changes:
            self.apply(change)
        free = self.pool.free_capacity()
        if free != message.free:
            raise Diverged(f"this rank's pool holds {free} free blocks, rank 0's {message.free}: the ranks diverged")
        mine, theirs = set(sequence_state(self.pool)), set(message.sequences)
        if mine != theirs:  # (id, positions with a slot, committed) of each open sequence
            raise Diverged(f"this rank's sequences hold (id, slots, committed) {sorted(mine - theirs)[:3]}, rank 0's "
                           f"{sorted(theirs - mine)[:3]}: the ranks diverged")
        self.clock.now = message.now
        if message.gather:
            self.channel.gather_memory()
        if isinstance(message.step, Stop):
            self.flush_timeout = message.step.flush_timeout
            return False
        try:
            self.run_step(message.step)
        except UnknownStep:
            raise  # not a failed forward: the ranks no longer run the same program
        except BatchUnsupported:
            pass  # rank 0 met the same and falls back (its next messages say how)
        except Exception as exc:  # noqa: BLE001 - rank 0's same forward failed alike: its requests fail
            log.warning("rank %d: %s failed: %s: %s", self.channel.rank, type(message.step).__name__,
                        type(exc).__name__, exc)
        self.pool.persist_tier()  # this rank's write-behind sweep, when due (rank 0 runs its own)
        return True

    def apply(self, change: Change) -> None:
        """One of rank 0's pool changes (a different outcome is a divergence: the rank stops)."""
        apply_change(self.pool, change)

    def _seq(self, value: int) -> Any:
        return self.pool.get(SequenceId(value))

    def run_step(self, step: Step) -> None:
        """The forward (or probe, or agreement) rank 0 runs now."""
        match step:
            case DecodeRun(seqs, shape, batched, tails):
                self.runner.batched = batched
                inputs = self.channel.share(None, shape)  # (B, 1): rank 0's tokens
                mx.eval(self.runner.forward([self._seq(v) for v in seqs], inputs, tails))  # (B, vocab)
                self.forwards += 1
            case PrefillRun(chunks, together=True):
                self.runner.prefill_together([self._seq(c.seq) for c in chunks], [c.tokens for c in chunks])
            case PrefillRun(chunks):
                # the same outputs as rank 0's: without logits the last layer's collectives are never evaluated
                for c in chunks:
                    self.runner.prefill(self._seq(c.seq), c.tokens, want_logits=c.want_logits)
            case ProbeRun("decode"):
                probe_batched_decode(self.model, self.pool)
            case ProbeRun("prefill"):
                probe_batched_prefill(self.model, self.pool)
            case TierHave(keys):
                if self.tier is None:
                    self.channel.agree([False] * len(keys))
                else:
                    self.tier.have(self.channel, keys)
            case Idle():
                pass
            case _:
                raise UnknownStep(f"unknown step {step!r} from rank 0")


def _runner_totals() -> dict[str, int]:
    """Counters the runner adds to (a follower reports none of them)."""
    return {"batched_steps": 0, "unbatched_steps": 0, "batched_prefills": 0}


def serve_follower(run: Any, group: Any, mode: str, timeout_s: float) -> int:
    """Rank ``group.rank() > 0`` of ``mlxkv serve``: load, shard, build the pool, replay until rank 0 stops.
    Returns the exit status."""
    from mlxkv.distributed.group import shard_model
    from mlxkv.distributed.leader import build_rank_pool
    from mlxkv.engine.batch import context_length_of
    from mlxkv.models import load

    rank = group.rank()
    # A terminal's Ctrl-C (or mlx.launch's SIGTERM) reaches every rank: rank 0 drains its requests and then sends
    # stop; a follower leaving first would fail rank 0's last steps. A lost rank 0 is caught by the watchdog.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watchdog = Watchdog(rank, timeout_s)
    try:
        loaded = load(run.model, progress=False, dequantize=run.dequantize, chat_template=run.chat_template,
                      tool_parser=run.tool_parser)
        shard_model(loaded.model, group, mode)
        pool = build_rank_pool(loaded.model, run.kv, max_sequences=run.engine.max_sequences,
                               context_tokens=context_length_of(loaded.config), group=group,
                               mode=mode)
        replayer = Replayer(loaded.model, pool, PlanChannel(group, watchdog))
    except Exception as exc:  # noqa: BLE001 - one line, like rank 0's errors (mlx.launch then stops rank 0)
        sys.stderr.write(f"error: rank {rank}: {exc}\n")
        return 1
    blocks = f", {pool.paged.num_blocks} KV blocks of {pool.paged.bytes_per_block} bytes" if pool.is_paged else ""
    if replayer.tier is not None and replayer.tier.bridge.tier.disk is not None:
        blocks += f", KV tier: {replayer.tier.figures()[1]} block(s) on disk"
    sys.stderr.write(f"mlxkv serve: rank {rank} of {group.size()} ready (pid {os.getpid()}{blocks})\n")
    sys.stderr.flush()
    watchdog.start()
    try:
        replayer.run()
    except Exception as exc:  # noqa: BLE001 - a replay that fails has diverged from rank 0: stop all
        fatal(rank, f"{type(exc).__name__}: {exc}")
    watchdog.stop()
    replayer.finish()  # no collective left: the watchdog must not cut a long flush short
    mx.synchronize()
    return 0
