"""Ranks 1..N-1 of ``mlxkv serve --distributed``: no HTTP and no scheduler, only the leader's plans, replayed.

A follower loads the same model, keeps its shard (:func:`~mlxkv.distributed.group.shard_model`) and builds its
shard of the paged pool, then loops: receive a message, replay its pool operations in order (the leader's
journal, :mod:`mlxkv.distributed.journal`), check that its pool holds as many free blocks as the leader's, and run
the forward the message announces — the same forward the leader runs at the same time, through the same
collectives. It never samples: the leader does, and sends the next step's inputs inside the graph.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import mlx.core as mx

from mlxkv.distributed.channel import PlanChannel
from mlxkv.distributed.journal import Journal, use_plan_clock
from mlxkv.distributed.tier import rank_tier, report_flush
from mlxkv.distributed.watchdog import Watchdog, fatal
from mlxkv.engine.batch_probe import probe_batched_decode, probe_batched_prefill
from mlxkv.engine.runner import ModelRunner
from mlxkv.kv import BatchUnsupported, CachePool, SequenceId

log = logging.getLogger("mlxkv.distributed")


class Replayer:
    """Applies the leader's messages to this rank's ``pool`` and runs its forwards on ``model``."""

    def __init__(self, model: Any, pool: CachePool, channel: PlanChannel):
        self.model = model
        self.pool = pool
        self.channel = channel
        self.journal = Journal()
        use_plan_clock(pool, self.journal)
        self.runner = ModelRunner(model, batched=True, batched_prefill=True, totals=_runner_totals())
        self.forwards = 0
        self.tier = rank_tier(pool)  # this rank's KV tier: restores come from rank 0's journal
        if self.tier is not None:
            channel.tier_figures = self.tier.figures
        self.flush_timeout = 0.0  # the stop message's: how long this rank's KV tier may take to flush

    def finish(self) -> None:
        """After :meth:`run`: flush this rank's KV tier (its write-behind) within rank 0's flush timeout, as rank 0
        flushes its own."""
        report_flush(self.channel.rank, self.pool.flush_tier(self.flush_timeout))

    def run(self) -> None:
        """Until the leader says stop."""
        while True:
            message = self.channel.receive()
            for op in message["ops"]:
                self.apply(op)
            free = self.pool.free_capacity()
            if free != message["free"]:
                fatal(self.channel.rank, f"this rank's pool diverged from rank 0's ({free} free blocks, rank 0 has "
                                         f"{message['free']})")
            self.journal.now = message["now"]
            if message.get("gather"):
                self.channel.gather_memory()
            then = message["then"]
            if then[0] == "stop":
                self.flush_timeout = then[1] if len(then) > 1 else 0.0
                return
            try:
                self.execute(then)
            except BatchUnsupported:
                pass  # the leader met the same and falls back (its next messages say how)
            except Exception as exc:  # noqa: BLE001 - the leader's same forward failed alike: its requests fail
                log.warning("rank %d: %s failed: %s: %s", self.channel.rank, then[0], type(exc).__name__, exc)
            self.pool.persist_tier()  # this rank's write-behind sweep, when due (rank 0 runs its own)

    def _seq(self, value: int) -> Any:
        return self.pool.get(SequenceId(value))

    def apply(self, op: tuple) -> None:
        """One journaled pool operation (a mismatch is a divergence: the rank stops)."""
        kind = op[0]
        if kind == "open":
            _, value, prompt_length, kwargs = op
            seq = self.pool.open(prompt_length, **kwargs)
            _same(seq.id.value, value, "opened sequence id")
        elif kind == "release":
            self.pool.release(SequenceId(op[1]))
        elif kind == "preempt":
            self.pool.preempt(SequenceId(op[1]))
        elif kind == "resume":
            self.pool.resume(SequenceId(op[1]), op[2])
        elif kind == "fork":
            _, value, n, children = op
            _same([c.id.value for c in self.pool.fork(SequenceId(value), n)], children, "forked sequence ids")
        elif kind == "evict_cached":
            self.pool.evict_cached(op[1])
        elif kind == "release_unused":
            self.pool.release_unused()
        elif kind == "seq":
            _, method, value, args = op
            getattr(self._seq(value), method)(*args)
        elif kind == "tier_restore":
            if self.tier is None:
                raise RuntimeError("rank 0 restored KV tier blocks but this rank has no tier: run every rank with "
                                   "the same options")
            self.tier.replay(*op[1:])
        else:
            raise AssertionError(f"unknown pool operation {kind!r} from rank 0")

    def execute(self, op: tuple) -> None:
        """The forward (or probe) rank 0 runs now."""
        kind = op[0]
        if kind == "forward":
            _, values, shape, batched = op
            self.runner.batched = batched
            seqs = [self._seq(v) for v in values]
            logits = self.runner.forward(seqs, self.channel.share(None, shape))  # (B, vocab)
            mx.eval(logits)
            self.forwards += 1
        elif kind == "prefill":
            # the same outputs as rank 0's: without logits the last layer's collectives are never evaluated
            self.runner.prefill(self._seq(op[1]), op[2], want_logits=op[3])
        elif kind == "prefill_together":
            self.runner.prefill_together([self._seq(v) for v in op[1]], op[2])
        elif kind == "probe_decode":
            probe_batched_decode(self.model, self.pool)
        elif kind == "probe_prefill":
            probe_batched_prefill(self.model, self.pool)
        elif kind == "tier_have":
            if self.tier is None:
                self.channel.agree([False] * len(op[1]))
            else:
                self.tier.have(self.channel, op[1])
        elif kind != "noop":
            raise AssertionError(f"unknown step {kind!r} from rank 0")


def _runner_totals() -> dict[str, int]:
    """Counters the runner adds to (a follower reports none of them)."""
    return {"batched_steps": 0, "unbatched_steps": 0, "batched_prefills": 0}


def _same(got: Any, expected: Any, what: str) -> None:
    if got != expected:
        raise RuntimeError(f"{what} {got} differs from rank 0's {expected}: the ranks diverged")


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
