"""The leader's pool: a :class:`~mlxkv.kv.CachePool` whose every change is recorded for the followers.

The scheduler, the engine and the batch probes talk to :class:`LeaderPool` exactly as to a pool; each call that
changes the pool (open, resume, fork, preempt, release, evict) and each call on a sequence handle that changes its
slots (feed, reserve, commit, rewind ...) is appended to the :class:`Journal`, in order. Before each forward the
leader sends the journal; a follower replays it on its own pool (:mod:`mlxkv.distributed.follower`), whose block
manager then makes the same allocations: the same block ids, slots and prefix hits on every rank. Every rank's
block pool reads the leader's clock (:class:`Journal`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: Sequence-handle methods that change the pool's state (replayed by followers, in order).
SEQUENCE_OPS = ("feed", "feed_placeholder", "name_token", "reserve", "reserve_last", "commit", "rewind_to")
#: Sequence-handle methods that change nothing (called through unrecorded). A method in neither tuple is refused
#: when the leader calls it: a change the followers never see would desynchronise the ranks without a sound.
SEQUENCE_READS = ("nbytes", "prefill_chunk")
#: CachePool methods :class:`LeaderPool` passes through unrecorded (they change nothing); the pool's changes are
#: its own methods, journaled. Any other pool method is refused, as for sequences.
POOL_READS = ("admission_cost", "block_map", "check_invariants", "free_capacity", "has_decode_headroom", "kv_events",
              "max_sequence_tokens", "memory_usage_bytes", "release_due_in", "tier_ready", "wait_tier_reads")


class UnjournaledCall(AttributeError):
    """The leader called a pool or sequence method that is neither journaled nor declared read-only."""


def _classified(owner: str, name: str, value: Any, allowed: tuple[str, ...]) -> Any:
    """``value``, unless it is a public method outside ``allowed`` (see :data:`SEQUENCE_READS`)."""
    if callable(value) and not name.startswith("_") and name not in allowed:
        raise UnjournaledCall(f"{owner}.{name} is neither journaled nor declared read-only in "
                              f"mlxkv.distributed.journal: the followers would not see what it does")
    return value


class Journal:
    """Operations (``(name, *args)`` tuples) since the last :meth:`take`, and the clock the block pools read.

    The block pools of every rank read :attr:`now`, the leader's time at its last plan (set by the leader when it
    sends one, by a follower when it receives it), never their own clocks: retention expiry and LRU order are the
    same on every rank, and a follower's batch probe reads the same times as the leader's.
    """

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.now = 0.0
        self._paused = 0

    def add(self, *op: Any) -> None:
        if self._paused == 0:
            self.ops.append(op)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside (the followers run the same code themselves, e.g. a batch probe)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def paused_now(self) -> bool:
        """Whether recording is paused (a batch probe runs on every rank alone)."""
        return self._paused > 0

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def clock(self) -> float:
        """The block pools' clock (see the class docstring)."""
        return self.now


def use_plan_clock(pool: Any, journal: Journal) -> None:
    """Make ``pool``'s block pool (paged) read ``journal``'s clock."""
    if pool.is_paged:
        pool.paged.manager.pool.clock = journal.clock


class LeaderSequence:
    """A pool sequence whose slot-changing calls are journaled; everything else reads through to it."""

    __slots__ = ("_journal", "_seq")

    def __init__(self, seq: Any, journal: Journal):
        object.__setattr__(self, "_seq", seq)
        object.__setattr__(self, "_journal", journal)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._seq, name)
        if name in SEQUENCE_OPS:
            def call(*args: Any) -> Any:
                self._journal.add("seq", name, self._seq.id.value, args)
                return value(*args)
            return call
        return _classified("Sequence", name, value, SEQUENCE_READS)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._seq, name, value)

    def __repr__(self) -> str:
        return f"LeaderSequence({self._seq.id})"


class LeaderPool:
    """A :class:`~mlxkv.kv.CachePool` with every change journaled (module docstring).

    Args:
        pool: the leader's own pool (its shard of the KV heads).
        journal: where operations go; sent by the leader before each forward.
        on_idle: called from :meth:`persist_tier` (between engine steps) to keep the followers' watchdogs fed.
        on_stop: called from :meth:`flush_tier` (the engine thread's last act) with its timeout: the followers
            flush their own KV tier (if any) within it and stop.
        heartbeat_s: the engine's idle wait (:meth:`tier_due_in`), so that ``on_idle`` runs while idle.
        extra_stats: returns what :meth:`block_stats` adds (the distributed figures).
    """

    def __init__(self, pool: Any, journal: Journal, *, on_idle: Callable[[], None],
                 on_stop: Callable[[float], None], heartbeat_s: float, extra_stats: Callable[[], dict]):
        self._pool = pool
        self._journal = journal
        self._on_idle = on_idle
        self._on_stop = on_stop
        self._heartbeat_s = heartbeat_s
        self._extra_stats = extra_stats
        self._handles: dict[int, LeaderSequence] = {}
        use_plan_clock(pool, journal)

    def __getattr__(self, name: str) -> Any:
        return _classified("CachePool", name, getattr(self._pool, name), POOL_READS)

    def check_overflow(self, overflow: Any) -> None:
        """A request's ``kv_overflow`` policy is refused: each rank would rank and drop its own pages."""
        raise ValueError(f"kv_overflow {overflow.policy} is not supported with --distributed yet")

    def _handle(self, seq: Any) -> LeaderSequence:
        handle = self._handles.get(seq.id.value)
        if handle is None:
            handle = self._handles[seq.id.value] = LeaderSequence(seq, self._journal)
        return handle

    @staticmethod
    def _raw(seq: Any) -> Any:
        return seq._seq if isinstance(seq, LeaderSequence) else seq

    # ---- journaled changes ---------------------------------------------------------------------------------
    def open(self, prompt_length: int = 0, **kwargs: Any) -> LeaderSequence:
        seq = self._pool.open(prompt_length, **kwargs)
        self._journal.add("open", seq.id.value, prompt_length, kwargs)
        return self._handle(seq)

    def release(self, seq_id: Any) -> None:
        self._pool.release(seq_id)
        self._journal.add("release", seq_id.value)
        self._handles.pop(seq_id.value, None)

    def preempt(self, seq_id: Any) -> None:
        self._pool.preempt(seq_id)
        self._journal.add("preempt", seq_id.value)

    def resume(self, seq_id: Any, tokens: list[int]) -> LeaderSequence:
        seq = self._pool.resume(seq_id, tokens)
        self._journal.add("resume", seq_id.value, list(tokens))
        return self._handle(seq)

    def fork(self, seq_id: Any, n: int) -> list[LeaderSequence]:
        children = self._pool.fork(seq_id, n)
        self._journal.add("fork", seq_id.value, n, [c.id.value for c in children])
        return [self._handle(c) for c in children]

    def evict_cached(self, salt: str | None = None) -> int:
        n = self._pool.evict_cached(salt)
        self._journal.add("evict_cached", salt)
        return n

    def release_unused(self) -> int:
        n = self._pool.release_unused()
        self._journal.add("release_unused")
        return n

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

    def block_stats(self) -> dict:
        return {**self._pool.block_stats(), "distributed": self._extra_stats()}
