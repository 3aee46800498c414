""":class:`Sequence`, the handle of one sequence of a :class:`mlxkv.kv.store.CachePool`, and its
:class:`SequenceId`.

The handle carries one id for the sequence's whole life, its layer caches for the model, and the per-step
protocol: ``feed`` the tokens a step appends before it, ``commit`` after it, which it passes to the slots its
storage gave it (:class:`Slots`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxkv.kv.blocks.cache_request import CacheRequest


@dataclass(frozen=True, order=True)
class SequenceId:
    """Identity of one sequence in a pool; ids only ever increase and are never reused."""

    value: int

    def __str__(self) -> str:
        return f"seq-{self.value}"


class Slots(Protocol):
    """A sequence's per-step protocol with its storage (:mod:`mlxkv.kv.storage`): the
    :class:`mlxkv.kv.paged.PagedSequence` of a paged sequence, else :class:`DenseSlots`."""

    num_cached: int  # prompt tokens served by the prefix cache
    num_tokens: int  # tokens announced so far (fed or opened)

    @property
    def num_committed(self) -> int: ...

    def next_stop(self, start: int) -> int | None: ...

    def feed(self, token_ids: list[int]) -> None: ...

    def feed_placeholder(self) -> int | None: ...

    def name_token(self, position: int | None, token_id: int) -> None: ...

    def reserve(self, start: int, end: int) -> None: ...

    def commit(self) -> None: ...


class DenseSlots:
    """The slots of a sequence that holds no blocks (dense caches, or a preempted paged sequence): nothing to
    allocate or verify; what is committed is what its caches hold."""

    num_cached = 0
    num_tokens = 0

    def __init__(self, seq: Sequence):
        self._seq = seq

    @property
    def num_committed(self) -> int:
        return self._seq.offset

    def next_stop(self, start: int) -> None:
        return None

    def feed(self, token_ids: list[int]) -> None:
        pass

    def feed_placeholder(self) -> None:
        return None

    def name_token(self, position: int | None, token_id: int) -> None:
        pass

    def reserve(self, start: int, end: int) -> None:
        pass

    def commit(self) -> None:
        pass


@dataclass
class Sequence:
    """One sequence's handle: its id, its layer caches and the per-step protocol.

    ``slots`` is what the storage gives it for that protocol (:class:`Slots`: the paged sequence, or
    :class:`DenseSlots` when it holds no blocks); ``paged`` is the block-manager bridge of a paged sequence
    (:class:`mlxkv.kv.paged.PagedSequence`; None when dense, or while preempted). Both are internal to the KV
    package.
    """

    id: SequenceId
    caches: list  # one per model layer; the layout follows the layer's attention
    prompt_length: int  # tokens in the prompt (set by the engine at prefill)
    created_at: float = field(default_factory=time.monotonic)
    paged: Any = None
    cache_request: CacheRequest = CacheRequest()  # what it was opened with (the pool's overflow default applied):
    #                                                a resume opens with the same, a fork's children copy it
    preempted: bool = False
    slots: Slots = field(default=None, repr=False, compare=False)  # type: ignore[assignment]  # set by the storage

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = DenseSlots(self)

    @property
    def overflow(self) -> Any:
        """Its :class:`mlxkv.config.KvOverflowConfig` (None: the plain caches)."""
        return self.cache_request.overflow

    @property
    def num_cached(self) -> int:
        """Prompt tokens served by the prefix cache (paged backend); prefill starts there."""
        return self.slots.num_cached

    @property
    def num_committed(self) -> int:
        """Positions written and verified (paged; dense: the first cache's offset)."""
        return self.slots.num_committed

    def prefill_chunk(self, start: int, n: int) -> int:
        """How many of the ``n`` prompt tokens from ``start`` the next prefill forward may take: fewer where a
        recurrent-state snapshot is due inside them (paged models with recurrent layers; else ``n``)."""
        stop = self.slots.next_stop(start)
        return n if stop is None else max(1, min(n, stop - start))

    def feed(self, token_ids: list[int]) -> None:
        """Announce the tokens the next model step appends (paged: allocates their slots; dense: no-op)."""
        self.slots.feed(token_ids)

    def feed_placeholder(self) -> int | None:
        """Announce one token whose id an overlapped step is still computing; returns its position (paged),
        to name with :meth:`name_token` before the step after it commits. Dense: nothing to announce (None)."""
        return self.slots.feed_placeholder()

    def name_token(self, position: int | None, token_id: int) -> None:
        """The id of the token :meth:`feed_placeholder` announced at ``position`` (None: nothing was announced)."""
        if position is not None:
            self.slots.name_token(position, token_id)

    def reserve(self, start: int, end: int) -> None:
        """Take the slots of prompt positions ``[start, end)`` before the step that writes them (paged: so that
        another sequence's room check sees them taken; dense: no-op)."""
        self.slots.reserve(start, end)

    def reserve_last(self) -> None:
        """Take the slot of the last opened token, which the next decode step writes (its id is known: no
        feed). Paged only; dense: no-op."""
        n = self.slots.num_tokens
        self.slots.reserve(n, n + 1)

    def commit(self) -> None:
        """After a model step: its tokens are verified (paged: full blocks become cached; dense: no-op)."""
        self.slots.commit()

    def rewind_to(self, length: int) -> bool:
        """Bring every layer back to ``length`` tokens after a failed forward (paged: the write position only,
        the slots stay for the retry; dense: an exact trim). False if some layer cannot be brought back."""
        try:
            for cache in self.caches:
                if getattr(cache, "offset", 0) > length:
                    if hasattr(cache, "rewind_to"):
                        cache.rewind_to(length)
                    else:
                        cache.trim(cache.offset - length)
            return all(getattr(c, "offset", length) == length for c in self.caches)
        except Exception:  # noqa: BLE001 - a layer without exact trim: the sequence is spoiled
            return False

    @property
    def offset(self) -> int:
        """Tokens processed so far (prompt + generated), read from the first attention cache."""
        for cache in self.caches:
            offset = getattr(cache, "offset", None)
            if isinstance(offset, int):
                return offset
        return 0

    def nbytes(self) -> int:
        """Bytes held by this sequence's cache buffers (K/V and any recurrent state)."""
        return sum(_cache_nbytes(c) for c in self.caches)


def _cache_nbytes(cache: Any) -> int:
    try:
        return int(cache.nbytes)
    except (NotImplementedError, AttributeError):
        return 0
