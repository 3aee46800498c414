""":class:`Sequence`, the handle of one sequence of a :class:`mlxkv.kv.store.CachePool`, and its
:class:`SequenceId`.

The handle carries one id for the sequence's whole life, its layer caches for the model, and the per-step
protocol: ``feed`` the tokens a step appends before it, ``commit`` after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlxkv.kv.blocks.cache_request import CacheRequest


@dataclass(frozen=True, order=True)
class SequenceId:
    """Identity of one sequence in a pool; ids only ever increase and are never reused."""

    value: int

    def __str__(self) -> str:
        return f"seq-{self.value}"


@dataclass
class Sequence:
    """One sequence's handle: its id, its layer caches and the per-step protocol.

    ``paged`` is the block-manager bridge of a paged sequence (:class:`mlxkv.kv.paged.PagedSequence`; None when
    dense, or while preempted): internal to the KV package.
    """

    id: SequenceId
    caches: list  # one per model layer; the layout follows the layer's attention
    prompt_length: int  # tokens in the prompt (set by the engine at prefill)
    created_at: float = field(default_factory=time.monotonic)
    paged: Any = None
    cache_request: CacheRequest = CacheRequest()  # what it was opened with (the pool's overflow default applied):
    #                                                a resume opens with the same, a fork's children copy it
    preempted: bool = False

    @property
    def overflow(self) -> Any:
        """Its :class:`mlxkv.config.KvOverflowConfig` (None: the plain caches)."""
        return self.cache_request.overflow

    @property
    def num_cached(self) -> int:
        """Prompt tokens served by the prefix cache (paged backend); prefill starts there."""
        return self.paged.num_cached if self.paged is not None else 0

    @property
    def num_committed(self) -> int:
        """Positions written and verified (paged; dense: the first cache's offset)."""
        return self.paged.num_committed if self.paged is not None else self.offset

    def prefill_chunk(self, start: int, n: int) -> int:
        """How many of the ``n`` prompt tokens from ``start`` the next prefill forward may take: fewer where a
        recurrent-state snapshot is due inside them (paged models with recurrent layers; else ``n``)."""
        stop = self.paged.next_stop(start) if self.paged is not None else None
        return n if stop is None else max(1, min(n, stop - start))

    def feed(self, token_ids: list[int]) -> None:
        """Announce the tokens the next model step appends (paged: allocates their slots; dense: no-op)."""
        if self.paged is not None:
            self.paged.feed(token_ids)

    def feed_placeholder(self) -> int | None:
        """Announce one token whose id an overlapped step is still computing; returns its position (paged),
        to name with :meth:`name_token` before the step after it commits. Dense: nothing to announce (None)."""
        return self.paged.feed_placeholder() if self.paged is not None else None

    def name_token(self, position: int | None, token_id: int) -> None:
        """The id of the token :meth:`feed_placeholder` announced at ``position``."""
        if self.paged is not None and position is not None:
            self.paged.name_token(position, token_id)

    def reserve(self, start: int, end: int) -> None:
        """Take the slots of prompt positions ``[start, end)`` before the step that writes them (paged: so that
        another sequence's room check sees them taken; dense: no-op)."""
        if self.paged is not None:
            self.paged.reserve(start, end)

    def reserve_last(self) -> None:
        """Take the slot of the last opened token, which the next decode step writes (its id is known: no
        feed). Paged only; dense: no-op."""
        if self.paged is not None:
            n = self.paged.num_tokens
            self.paged.reserve(n, n + 1)

    def commit(self) -> None:
        """After a model step: its tokens are verified (paged: full blocks become cached; dense: no-op)."""
        if self.paged is not None:
            self.paged.commit()

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
