"""The changes a step makes to the KV pool, as plain data, and :func:`apply_change`, the one way ranks apply them.

Rank 0's scheduler changes its pool through :class:`~mlxkv.distributed.leader_pool.LeaderPool`, whose every
mutating method builds one of these changes and applies it with :func:`apply_change`; the applied change is
recorded and sent with the next forward (:mod:`mlxkv.distributed.steps`), and every follower applies the same list,
in order, with the same function. Block ids, slot mappings and prefix hits thus stay the same on every rank.

Sequences are named by their id's value (``seq``); a change that creates sequences carries the ids rank 0's pool
gave them, which a follower checks against its own (a mismatch is a divergence: the launch stops).

Each change names the pool or sequence method it performs (``method``): :data:`POOL_CHANGES` and
:data:`SEQUENCE_CHANGES` are checked against the public methods of :class:`~mlxkv.kv.CachePool` and
:class:`~mlxkv.kv.Sequence` (tests/test_distributed_changes.py), so a new mutating method cannot reach rank 0's
pool without a change type of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mlxkv.kv import CacheRequest, SequenceId


class Diverged(RuntimeError):
    """A follower's pool answered a change otherwise than rank 0's: the ranks no longer hold the same blocks."""


# ---- pool changes --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Open:
    """A sequence opened over ``prompt`` (its prefix hit taken) with ``cache_request``; ``opened``: the id rank 0's
    pool gave it (0 before rank 0 applied it)."""

    method: ClassVar[str] = "open"
    prompt_length: int
    prompt: list[int] | None
    cache_request: CacheRequest | None
    opened: int = 0


@dataclass(frozen=True, slots=True)
class Resume:
    """Preempted sequence ``seq`` given caches again over ``tokens`` (its prompt and generated tokens)."""

    method: ClassVar[str] = "resume"
    seq: int
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Fork:
    """``n`` children of ``seq`` sharing its blocks; ``children``: their ids on rank 0."""

    method: ClassVar[str] = "fork"
    seq: int
    n: int
    children: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Preempt:
    """``seq``'s caches freed (its verified blocks stay cached); it keeps its id and resumes later."""

    method: ClassVar[str] = "preempt"
    seq: int


@dataclass(frozen=True, slots=True)
class Release:
    """``seq`` dropped (its verified blocks stay cached)."""

    method: ClassVar[str] = "release"
    seq: int


@dataclass(frozen=True, slots=True)
class EvictCached:
    """Cached blocks no sequence holds evicted (only those of ``salt``'s prompts when given)."""

    method: ClassVar[str] = "evict_cached"
    salt: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseUnused:
    """A growing pool gives back the chunks of blocks nothing holds."""

    method: ClassVar[str] = "release_unused"


@dataclass(frozen=True, slots=True)
class TierRestore:
    """Blocks rank 0 restored from its KV tier into the prefix hit of the :class:`Open` that follows (each rank
    restores its own shard of them, :meth:`mlxkv.distributed.tier.RankTier.replay`). Rank 0 makes this change
    inside that open, agreed with every rank first; it is recorded there, not applied through
    :func:`apply_change`."""

    method: ClassVar[str | None] = None
    tokens: list[int]
    hash_context: tuple  # (salt, extra, spans) of the prompt's HashContext
    first: int  # the primary hit, in blocks, before the restore
    usable: int  # blocks of the prompt that may be hit
    restored: list[tuple[int, int, int]]  # (block index, group, retention priority) per restored block
    grew: int  # blocks the hit grew by


# ---- sequence changes (slots of the steps to come) -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Feed:
    """The tokens the next forward appends to ``seq`` (their slots allocated)."""

    method: ClassVar[str] = "feed"
    seq: int
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class FeedPlaceholder:
    """One token whose id an overlapped decode step is still computing, appended to ``seq``."""

    method: ClassVar[str] = "feed_placeholder"
    seq: int


@dataclass(frozen=True, slots=True)
class NameToken:
    """The id of the token a :class:`FeedPlaceholder` announced at ``position``."""

    method: ClassVar[str] = "name_token"
    seq: int
    position: int | None
    token: int


@dataclass(frozen=True, slots=True)
class Reserve:
    """The slots of prompt positions ``[start, end)`` of ``seq`` taken before the forward that writes them."""

    method: ClassVar[str] = "reserve"
    seq: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ReserveLast:
    """The slot of ``seq``'s last opened token taken (the next decode step writes it)."""

    method: ClassVar[str] = "reserve_last"
    seq: int


@dataclass(frozen=True, slots=True)
class Commit:
    """``seq``'s written positions verified (full blocks become cached)."""

    method: ClassVar[str] = "commit"
    seq: int


@dataclass(frozen=True, slots=True)
class RewindTo:
    """``seq``'s layers brought back to ``length`` tokens after a failed forward."""

    method: ClassVar[str] = "rewind_to"
    seq: int
    length: int


#: The changes of the pool itself, by the CachePool method each performs.
POOL_CHANGES: dict[str, type] = {c.method: c for c in (Open, Resume, Fork, Preempt, Release, EvictCached,
                                                         ReleaseUnused)}
#: The changes of one sequence's slots, by the Sequence method each performs.
SEQUENCE_CHANGES: dict[str, type] = {c.method: c for c in (Feed, FeedPlaceholder, NameToken, Reserve, ReserveLast,
                                                             Commit, RewindTo)}

Change = (Open | Resume | Fork | Preempt | Release | EvictCached | ReleaseUnused | TierRestore | Feed | FeedPlaceholder
          | NameToken | Reserve | ReserveLast | Commit | RewindTo)


def apply_change(pool: Any, change: Change) -> Any:
    """Apply ``change`` to ``pool`` (a :class:`~mlxkv.kv.CachePool`); returns what the pool or sequence method
    returned (the opened sequence, the forked children, a placeholder's position ...).

    Raises:
        Diverged: a follower's pool gave a created sequence another id than rank 0's.
        TypeError: ``change`` is not a pool change.
    """
    match change:
        case Feed(seq, tokens):
            return _seq(pool, seq).feed(tokens)
        case FeedPlaceholder(seq):
            return _seq(pool, seq).feed_placeholder()
        case NameToken(seq, position, token):
            return _seq(pool, seq).name_token(position, token)
        case Reserve(seq, start, end):
            return _seq(pool, seq).reserve(start, end)
        case ReserveLast(seq):
            return _seq(pool, seq).reserve_last()
        case Commit(seq):
            return _seq(pool, seq).commit()
        case RewindTo(seq, length):
            return _seq(pool, seq).rewind_to(length)
        case Open(prompt_length, prompt, cache_request, opened):
            seq = pool.open(prompt_length, prompt=prompt, cache_request=cache_request)
            _same(seq.id.value, opened or seq.id.value, "opened sequence id")
            return seq
        case Resume(seq, tokens):
            return pool.resume(SequenceId(seq), tokens)
        case Fork(seq, n, children):
            forked = pool.fork(SequenceId(seq), n)
            _same(tuple(c.id.value for c in forked), children or tuple(c.id.value for c in forked),
                  "forked sequence ids")
            return forked
        case Preempt(seq):
            return pool.preempt(SequenceId(seq))
        case Release(seq):
            return pool.release(SequenceId(seq))
        case EvictCached(salt):
            return pool.evict_cached(salt)
        case ReleaseUnused():
            return pool.release_unused()
        case TierRestore():
            bridge = pool.paged.tier if pool.is_paged else None
            if bridge is None or bridge.ranks is None:
                raise RuntimeError("rank 0 restored KV tier blocks but this rank has no tier: run every rank with "
                                   "the same options")
            return bridge.ranks.replay(change)
    raise TypeError(f"not a KV pool change: {change!r}")


def sequence_state(pool: Any) -> tuple[tuple[int, int, int], ...]:
    """What every rank's pool must agree on after the same changes, beside its free block count: each open paged
    sequence's id, positions with a slot and positions committed (cheap: no block table is read). A change made
    to one rank's pool outside :func:`apply_change` shows here at the next message."""
    return tuple((s.id.value, s.paged.num_tokens, s.paged.num_committed) for s in pool if s.paged is not None)


def _seq(pool: Any, value: int) -> Any:
    return pool.get(SequenceId(value))


def _same(got: Any, expected: Any, what: str) -> None:
    if got != expected:
        raise Diverged(f"{what} {got} differs from rank 0's {expected}: the ranks diverged")
