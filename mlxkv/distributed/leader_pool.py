"""Rank 0's pool: every change the scheduler makes is a typed change (:mod:`mlxkv.distributed.changes`), applied
with :func:`~mlxkv.distributed.changes.apply_change` and recorded for the followers.

:class:`LeaderPool` and the :class:`LeaderSequence` handles it gives out have one explicit method per
:class:`~mlxkv.kv.CachePool` / :class:`~mlxkv.kv.Sequence` method: the mutating ones build their change and apply
it (:meth:`ChangeLog.apply`), the others read through (:data:`POOL_READS`, :data:`SEQUENCE_READS`). Nothing is
forwarded by name, so a method added to the pool is simply absent here until it is given a change type or declared
a read (tests/test_distributed_changes.py checks both lists against the pool's methods), and the paged backend
behind the pool is not reachable through it.

Every rank's block pool reads the leader's clock (:class:`ChangeLog`), so that retention expiry and LRU order are
the same on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from mlxkv.distributed.changes import (Change, Commit, EvictCached, Feed, FeedPlaceholder, Fork, NameToken, Open,
                                       Preempt, Release, ReleaseUnused, Reserve, ReserveLast, Resume, RewindTo,
                                       apply_change)

#: CachePool methods that change nothing the ranks must agree on: :class:`LeaderPool` reads them through (those
#: handing out sequences wrap them in :class:`LeaderSequence`). The KV tier's write-behind and flush change only
#: each rank's own tier, which every rank runs itself; rank 0's hooks add its heartbeat and its stop message.
POOL_READS = ("admission_cost", "block_map", "block_stats", "can_extend", "check_invariants", "check_overflow",
              "flush_tier", "free_capacity", "get", "has_decode_headroom", "kv_events", "max_sequence_tokens",
              "memory_usage_bytes", "persist_tier", "release_due_in", "tier_due_in", "tier_ready", "victim_for",
              "wait_tier_reads")
#: Sequence methods that change nothing (read through by :class:`LeaderSequence`).
SEQUENCE_READS = ("nbytes", "prefill_chunk")


class ChangeLog:
    """The changes rank 0 applied since the last :meth:`take`, and the clock every rank's block pool reads.

    The block pools of every rank read :attr:`now`, rank 0's time at its last message (set by rank 0 when it sends
    one, by a follower when it receives it), never their own clocks.
    """

    def __init__(self) -> None:
        self.pending: list[Change] = []
        self.now = 0.0
        self._paused = 0

    def apply(self, pool: Any, change: Change) -> Any:
        """Apply ``change`` to ``pool`` (rank 0's) and record it, as applied, for the followers (not while
        :meth:`paused`)."""
        result = apply_change(pool, change)
        if isinstance(change, Open):
            change = Open(change.prompt_length, change.prompt, change.cache_request, opened=result.id.value)
        elif isinstance(change, Fork):
            change = Fork(change.seq, change.n, children=tuple(c.id.value for c in result))
        self.record(change)
        return result

    def record(self, change: Change) -> None:
        """Record a change rank 0 made otherwise (a KV tier restore inside an open)."""
        if self._paused == 0:
            self.pending.append(change)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside: every rank runs the same thing itself (a batch probe on its own pool)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def paused_now(self) -> bool:
        return self._paused > 0

    def take(self) -> list[Change]:
        """The pending changes, in order (and none pending after)."""
        changes, self.pending = self.pending, []
        return changes

    def clock(self) -> float:
        """The block pools' clock (see the class docstring)."""
        return self.now


def use_plan_clock(pool: Any, log: ChangeLog) -> None:
    """Make ``pool``'s block pool (paged) read ``log``'s clock."""
    if pool.is_paged:
        pool.paged.manager.pool.clock = log.clock


class LeaderSequence:
    """A sequence of rank 0's pool: its slot changes go through the change log; its state reads through."""

    __slots__ = ("_log", "_pool", "_seq")

    def __init__(self, seq: Any, pool: Any, log: ChangeLog):
        self._seq = seq
        self._pool = pool
        self._log = log

    def __repr__(self) -> str:
        return f"LeaderSequence({self._seq.id})"

    # ---- changes -------------------------------------------------------------------------------------------
    def _apply(self, change: Change) -> Any:
        return self._log.apply(self._pool, change)

    def feed(self, token_ids: list[int]) -> None:
        self._apply(Feed(self.id.value, list(token_ids)))

    def feed_placeholder(self) -> int | None:
        return self._apply(FeedPlaceholder(self.id.value))

    def name_token(self, position: int | None, token_id: int) -> None:
        self._apply(NameToken(self.id.value, position, int(token_id)))

    def reserve(self, start: int, end: int) -> None:
        self._apply(Reserve(self.id.value, start, end))

    def reserve_last(self) -> None:
        self._apply(ReserveLast(self.id.value))

    def commit(self) -> None:
        self._apply(Commit(self.id.value))

    def rewind_to(self, length: int) -> bool:
        return self._apply(RewindTo(self.id.value, length))

    # ---- reads ---------------------------------------------------------------------------------------------
    @property
    def id(self) -> Any:
        return self._seq.id

    @property
    def caches(self) -> list:
        return self._seq.caches

    @property
    def prompt_length(self) -> int:
        return self._seq.prompt_length

    @property
    def created_at(self) -> float:
        return self._seq.created_at

    @property
    def cache_request(self) -> Any:
        return self._seq.cache_request

    @property
    def preempted(self) -> bool:
        return self._seq.preempted

    @property
    def overflow(self) -> Any:
        return self._seq.overflow

    @property
    def num_cached(self) -> int:
        return self._seq.num_cached

    @property
    def num_committed(self) -> int:
        return self._seq.num_committed

    @property
    def offset(self) -> int:
        return self._seq.offset

    def prefill_chunk(self, start: int, n: int) -> int:
        return self._seq.prefill_chunk(start, n)

    def nbytes(self) -> int:
        return self._seq.nbytes()


class LeaderPool:
    """Rank 0's :class:`~mlxkv.kv.CachePool`, every change applied and recorded through ``log`` (module docstring).

    Args:
        pool: the leader's own pool (its shard of the KV heads, or its layers).
        log: where applied changes go; sent by the leader with each forward.
        on_idle: called from :meth:`persist_tier` (between engine steps) to keep the followers' watchdogs fed.
        on_stop: called from :meth:`flush_tier` (the engine thread's last act) with its timeout: the followers
            flush their own KV tier (if any) within it and stop.
        heartbeat_s: the engine's idle wait (:meth:`tier_due_in`), so that ``on_idle`` runs while idle.
        extra_stats: returns what :meth:`block_stats` adds (the distributed figures).
    """

    def __init__(self, pool: Any, log: ChangeLog, *, on_idle: Callable[[], None],
                 on_stop: Callable[[float], None], heartbeat_s: float, extra_stats: Callable[[], dict]):
        self._pool = pool
        self._log = log
        self._on_idle = on_idle
        self._on_stop = on_stop
        self._heartbeat_s = heartbeat_s
        self._extra_stats = extra_stats
        self._handles: dict[int, LeaderSequence] = {}
        use_plan_clock(pool, log)

    def _handle(self, seq: Any) -> LeaderSequence:
        handle = self._handles.get(seq.id.value)
        if handle is None:
            handle = self._handles[seq.id.value] = LeaderSequence(seq, self._pool, self._log)
        return handle

    @staticmethod
    def _raw(seq: Any) -> Any:
        return seq._seq if isinstance(seq, LeaderSequence) else seq

    def _apply(self, change: Change) -> Any:
        return self._log.apply(self._pool, change)

    # ---- changes -------------------------------------------------------------------------------------------
    def open(self, prompt_length: int = 0, *, prompt: list[int] | None = None,
             cache_request: Any = None) -> LeaderSequence:
        prompt = None if prompt is None else list(prompt)
        return self._handle(self._apply(Open(prompt_length, prompt, cache_request)))

    def resume(self, seq_id: Any, tokens: list[int]) -> LeaderSequence:
        return self._handle(self._apply(Resume(seq_id.value, list(tokens))))

    def fork(self, seq_id: Any, n: int) -> list[LeaderSequence]:
        return [self._handle(c) for c in self._apply(Fork(seq_id.value, n))]

    def preempt(self, seq_id: Any) -> None:
        self._apply(Preempt(seq_id.value))

    def release(self, seq_id: Any) -> None:
        self._apply(Release(seq_id.value))
        self._handles.pop(seq_id.value, None)

    def evict_cached(self, salt: str | None = None) -> int:
        return self._apply(EvictCached(salt))

    def release_unused(self) -> int:
        return self._apply(ReleaseUnused())

    # ---- reads that hand out sequences ---------------------------------------------------------------------
    def get(self, seq_id: Any) -> LeaderSequence:
        return self._handle(self._pool.get(seq_id))

    def victim_for(self, seq: Any) -> LeaderSequence | None:
        victim = self._pool.victim_for(self._raw(seq))
        return None if victim is None else self._handle(victim)

    def can_extend(self, seq: Any, num_tokens: int) -> bool:
        return self._pool.can_extend(self._raw(seq), num_tokens)

    def __iter__(self) -> Iterator[LeaderSequence]:
        return iter([self._handle(s) for s in self._pool])

    def __len__(self) -> int:
        return len(self._pool)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._pool

    # ---- reads ---------------------------------------------------------------------------------------------
    @property
    def is_paged(self) -> bool:
        return self._pool.is_paged

    @property
    def backend(self) -> str:
        return self._pool.backend

    @property
    def max_sequences(self) -> int:
        return self._pool.max_sequences

    @property
    def overflow(self) -> Any:
        return self._pool.overflow

    @property
    def prefix_caching(self) -> bool:
        return self._pool.prefix_caching

    @property
    def state_snapshots(self) -> bool:
        return self._pool.state_snapshots

    def admission_cost(self, num_tokens: int) -> int:
        return self._pool.admission_cost(num_tokens)

    def free_capacity(self) -> int:
        return self._pool.free_capacity()

    def has_decode_headroom(self, num_sequences: int) -> bool:
        return self._pool.has_decode_headroom(num_sequences)

    def max_sequence_tokens(self) -> int | None:
        return self._pool.max_sequence_tokens()

    def memory_usage_bytes(self) -> int:
        return self._pool.memory_usage_bytes()

    def release_due_in(self) -> float | None:
        return self._pool.release_due_in()

    def kv_events(self, since: int = 0) -> dict | None:
        return self._pool.kv_events(since)

    def block_map(self) -> dict | None:
        return self._pool.block_map()

    def check_invariants(self) -> None:
        self._pool.check_invariants()

    def tier_ready(self, prompt: list[int], cache_request: Any = None) -> bool:
        return self._pool.tier_ready(prompt, cache_request)

    def wait_tier_reads(self, timeout: float) -> None:
        self._pool.wait_tier_reads(timeout)

    def check_overflow(self, overflow: Any) -> None:
        """A request's ``kv_overflow`` policy is refused: each rank would rank and drop its own pages."""
        raise ValueError(f"kv_overflow {overflow.policy} is not supported with --distributed yet")

    def block_stats(self) -> dict:
        return {**self._pool.block_stats(), "distributed": self._extra_stats()}

    # ---- the engine's idle hooks: heartbeats, and rank 0's own KV tier (each follower sweeps its own) ------
    def tier_due_in(self) -> float:
        due = self._pool.tier_due_in()
        return self._heartbeat_s if due is None else min(due, self._heartbeat_s)

    def persist_tier(self) -> int:
        self._on_idle()
        return self._pool.persist_tier()

    def flush_tier(self, timeout: float) -> dict | None:
        self._on_stop(timeout)
        return self._pool.flush_tier(timeout)
