"""Rank 0 of ``mlxkv serve --distributed``: HTTP, the scheduler and the block manager, sending each forward's plan.

:class:`Leader` plugs into :func:`mlxkv.server.runner.build`: it shards the loaded model, puts the pool behind a
:class:`~mlxkv.distributed.leader_pool.LeaderPool` (every change typed, applied and recorded) and builds a
:class:`LeaderEngine`, whose runner sends the changes since its last forward and the description of the plan it
executes (:mod:`mlxkv.distributed.steps`) before running it (:class:`LeaderRunner`). Every scheduling decision
(admission, deadlines, preemption, prefix hits, forks) is made here only; followers apply the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.distributed.changes import sequence_state
from mlxkv.distributed.channel import PlanChannel
from mlxkv.distributed.group import agree_grow_blocks, agree_num_blocks, shard_model
from mlxkv.distributed.leader_pool import ChangeLog, LeaderPool
from mlxkv.distributed.steps import Idle, ProbeRun, Step, StepMessage, Stop, describe
from mlxkv.distributed.tier import rank_tier, rank_tier_config
from mlxkv.distributed.watchdog import Watchdog
from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.plan import StepOutput, StepPlan
from mlxkv.engine.runner import ModelRunner

#: Seconds between the leader's no-op messages while idle (the followers' watchdogs see it alive), and at least
#: between two gatherings of every rank's memory figures for the stats.
HEARTBEAT_S = 1.0


class Plans:
    """The change log and the channel together: :meth:`send` ships the changes since the last send, then the step
    every rank runs."""

    def __init__(self, channel: PlanChannel, changes: ChangeLog, pool: Any = None, mode: str = "tensor"):
        self.channel = channel
        self.mode = mode
        self.changes = changes
        self.pool = pool  # the inner pool: its free blocks and sequences let followers check they applied alike
        self.last_sent = time.monotonic()
        self.last_gathered = 0.0
        self.ranks: list[dict] = []  # every rank's memory figures, as of the last gathering
        self.stopped = False

    def send(self, step: Step) -> None:
        if self.stopped:
            return
        if not self.channel.sent:
            self.channel.watchdog.start()
        pool = self.pool
        now = time.monotonic()
        gather = not isinstance(step, Stop) and now - self.last_gathered >= HEARTBEAT_S
        self.channel.send(StepMessage(self.changes.take(), free=0 if pool is None else pool.free_capacity(),
                                      sequences=() if pool is None else sequence_state(pool), now=now,
                                      gather=gather, step=step))
        self.changes.now = self.last_sent = now  # what follows reads this time, on the followers too
        if gather:  # every rank answers right after this message, before its step
            self.ranks, self.last_gathered = self.channel.gather_memory(), now

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(Idle())

    def stop(self, flush_timeout: float = 0.0) -> None:
        """The followers stop, after flushing their KV tier (if any) within ``flush_timeout`` seconds."""
        self.send(Stop(flush_timeout))
        self.stopped = True
        self.channel.watchdog.stop()


class LeaderRunner(ModelRunner):
    """The model runner of rank 0: each plan's forward is described to the followers before it runs."""

    def __init__(self, plans: Plans, model: Any, *, always_logits: bool = False, **kwargs: Any):
        super().__init__(model, **kwargs)
        self.plans = plans
        # pipeline: a rank's cache writes do not need the hidden state it sends on, only the logits do, so every
        # rank evaluates every forward's logits (the last rank's output reaches all through them)
        self.always_logits = always_logits

    def execute(self, plan: StepPlan) -> StepOutput:
        try:
            step = describe(plan, batched=self.batched, always_logits=self.always_logits)
        except ValueError as exc:  # nothing ran: the requests of the plan fail, the followers see nothing
            return StepOutput(error=exc)
        if step is not None:
            self.plans.send(step)
        return super().execute(plan)

    def prefill(self, seq: Any, tokens: Sequence[int], want_logits: bool, media: Sequence[Any] = (),
                start: int = 0) -> mx.array | None:
        last = super().prefill(seq, tokens, want_logits or self.always_logits, media, start)
        return last if want_logits else None

    def forward(self, seqs: Sequence[Any], inputs: mx.array, prompt_tails: Sequence[list[int]] = ()) -> mx.array:
        shared = self.plans.channel.share(inputs, tuple(inputs.shape))  # (B, 1): the followers' inputs too
        return super().forward(seqs, shared, prompt_tails)  # (B, vocab)


class LeaderEngine(BatchEngine):
    """A :class:`~mlxkv.engine.batch.BatchEngine` on rank 0: its runner announces forwards and its start-up batch
    probes run on every rank (each rank probes its own pool; rank 0's probe changes are not sent)."""

    def __init__(self, *args: Any, plans: Plans, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.plans = plans
        sched = self._scheduler
        sched.runner = LeaderRunner(plans, self.model, always_logits=plans.mode == "pipeline",
                                    batched=sched.runner.batched,
                                    batched_prefill=sched.runner.batched_prefill, totals=sched.totals)

    def _decide_batching(self) -> tuple[bool, str]:
        if self.config.batched_decode is False or self.config.max_sequences < 2:
            return super()._decide_batching()  # no probe: nothing runs
        self.plans.send(ProbeRun("decode"))
        with self.plans.changes.paused():
            return super()._decide_batching()

    def _decide_prefill_batching(self, batched_decode: bool) -> tuple[bool, str]:
        if not self.config.batched_prefill or not batched_decode:
            return super()._decide_prefill_batching(batched_decode)
        self.plans.send(ProbeRun("prefill"))
        with self.plans.changes.paused():
            return super()._decide_prefill_batching(batched_decode)


class Leader:
    """The hook :func:`mlxkv.server.runner.build` calls on rank 0 (shard, wrap the pool, make the engine).

    Args:
        group: the ``mx.distributed`` group (this is rank 0); mode: ``"tensor"`` or ``"pipeline"``; timeout_s: the
            watchdog's.
    """

    def __init__(self, group: Any, mode: str, timeout_s: float):
        assert group.rank() == 0, "the leader is rank 0"
        self.group = group
        self.mode = mode
        self.watchdog = Watchdog(0, timeout_s)  # started by the first plan: loading the model may take long
        self.plans = Plans(PlanChannel(group, self.watchdog), ChangeLog(), mode=mode)

    def shard(self, loaded: Any) -> None:
        """Shard the loaded model over the group (before its pool is built)."""
        shard_model(loaded.model, self.group, self.mode)

    def pool(self, model: Any, kv: Any, *, max_sequences: int, context_tokens: int | None) -> LeaderPool:
        """Rank 0's pool (:func:`build_rank_pool`), its changes recorded for the followers."""
        pool = build_rank_pool(model, kv, max_sequences=max_sequences, context_tokens=context_tokens,
                               group=self.group, mode=self.mode)
        self.plans.pool = pool
        tier = rank_tier(pool, self.plans)  # tier restores agreed with every rank (mlxkv.distributed.tier)
        if tier is not None:
            self.plans.channel.tier_figures = tier.figures
        stats = {"mode": self.mode, "world_size": self.group.size(), "rank": 0,
                 "bytes_per_block_per_rank": pool.paged.bytes_per_block if pool.is_paged else None}
        if tier is not None:  # how often rank 0 asked the ranks, and the blocks it held that another did not
            stats["tier"] = lambda: {"agreements": tier.agreements, "refused_blocks": tier.refused_blocks}
        return LeaderPool(pool, self.plans.changes, on_idle=self.plans.heartbeat, on_stop=self.plans.stop,
                          heartbeat_s=HEARTBEAT_S, extra_stats=lambda: _distributed_stats(stats, self.plans.ranks))

    def engine(self, *args: Any, **kwargs: Any) -> LeaderEngine:
        return LeaderEngine(*args, plans=self.plans, **kwargs)


def _distributed_stats(stats: dict, ranks: list[dict]) -> dict:
    """The ``distributed`` section of the stats (callables in ``stats`` read now)."""
    return {**{k: v() if callable(v) else v for k, v in stats.items()}, "ranks": ranks}


def agree_pool(pool: Any, rebuild: Any, group: Any, *, same_size: bool = True) -> Any:
    """``pool``, or ``rebuild(n)`` with the smallest block count of all ranks when it holds more (paged)."""
    if not pool.is_paged:
        return pool
    n = agree_num_blocks(pool.paged.num_blocks, pool.paged.bytes_per_block, group, same_size=same_size)
    if n != pool.paged.num_blocks:
        pool.flush_tier(0.0)  # an empty pool: its tier's writer thread stops (the rebuilt pool has its own)
        pool = rebuild(n)
    # a growing pool hands out ids by its chunks: every rank grows by the same (pipeline ranks' blocks differ in size)
    pool.paged.set_grow_blocks(agree_grow_blocks(pool.paged.grow_blocks, group))
    return pool


def build_rank_pool(model: Any, kv: Any, *, max_sequences: int, context_tokens: int | None, group: Any,
                    mode: str = "tensor") -> Any:
    """This rank's pool (its shard of the KV heads, or its layers under ``mode="pipeline"``; with a KV tier, its
    own tier of its shard, :func:`~mlxkv.distributed.tier.rank_tier_config`), sized as
    :func:`mlxkv.engine.build.build_pool` sizes it from this machine's memory and budget, then agreed with the other
    ranks (:func:`agree_pool`)."""
    from mlxkv.engine.build import build_pool
    from mlxkv.kv import CachePool

    if kv.overflow.enabled:  # h2o's mass differs between shards: the ranks would keep different pages
        raise ValueError(f"--kv-overflow {kv.overflow.policy} is not supported with --distributed yet")
    kv = rank_tier_config(kv, mode, group.rank(), group.size())  # its own tier folder, fingerprinted as its shard
    pool = build_pool(model, kv, max_sequences=max_sequences, context_tokens=context_tokens)
    return agree_pool(pool, lambda n: CachePool(model, max_sequences=max_sequences, backend="paged", kv_config=kv,
                                                num_blocks=n), group, same_size=mode != "pipeline")
