"""Chunked layout (Llama 4 local attention): a query sees only earlier keys of its own chunk.

Token positions are global (``offset``); ``start_position`` is the first position of the chunk the
next token falls in, and ``update_and_fetch`` returns rows ``[start_position, offset + L)`` — what
llama4's own chunk mask expects. Storage keeps rows from ``_base``, a chunk start at or before
``offset - max_rewind``, so a rewind never lands in a chunk whose front was dropped.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.kv.layouts.base import DEFAULT_MAX_REWIND, LayerCache
from mlxkv.kv.layouts.dense_storage import _round_up
from mlxkv.kv.layouts.masks import visible


class ChunkedKVCache(LayerCache):
    """Llama 4 chunked-attention cache (mlx-lm ``ChunkedKVCache`` protocol) with exact rewind.

    Rewind: ``trim(n)`` is exact for any ``n <= max_rewind`` at any time, and for any ``n`` whose target
    chunk is still stored (``rewindable()``); beyond that it raises
    :class:`~mlxkv.kv.layouts.base.RewindError`.

    Memory: rows from the chunk start before ``offset - max_rewind`` on — at most ``chunk_size +
    max_rewind`` rows plus up to two ``step`` s of slack (fronts are dropped once per ``step`` rows,
    so decoding never copies the chunk per token).

    Args:
        chunk_size: attention chunk (llama4's ``attention_chunk_size``).
        max_rewind: tokens always rewindable.
        step: growth granularity in rows.
    """

    def __init__(self, chunk_size: int, max_rewind: int = DEFAULT_MAX_REWIND, step: int = 256):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if max_rewind < 0:
            raise ValueError(f"max_rewind must be >= 0, got {max_rewind}")
        self.chunk_size = chunk_size
        self.max_rewind = max_rewind
        self._base = 0  # token position held by storage row 0
        super().__init__(step)

    def _chunk_start(self, p: int) -> int:
        return p // self.chunk_size * self.chunk_size

    @property
    def start_position(self) -> int:
        """First position of the chunk the next token belongs to (the first row ``update_and_fetch``
        returns)."""
        return self._chunk_start(self.offset)

    def maybe_trim_front(self) -> None:
        """llama4 calls this before each forward. Nothing to do: rows are dropped when room is made
        for a write, never per token."""

    def _make_room(self, L: int) -> None:
        used = self.offset - self._base
        cap = self._store.capacity
        if self._inplace and used + L <= cap:
            return
        drop = self._chunk_start(max(0, self.offset - self.max_rewind)) - self._base
        if drop <= 0:
            return  # nothing droppable: the write grows the buffer by steps
        kept = used - drop
        slack = self.step if self._inplace else 0  # room for `step` more writes before the next move
        self._store.drop_front(drop, used, max(cap, _round_up(kept + L + slack, self.step)))
        self._base += drop

    def update_and_fetch(self, keys, values):
        """Append ``(B, n_kv, L, D)`` rows; return rows ``[start_position, offset + L)`` (views)."""
        start = self.start_position
        L = keys.shape[2]
        k, v = self._store.encode(keys), self._store.encode(values)
        if not self._store.empty():
            self._make_room(L)
        self._store.write(self.offset - self._base, k, v)
        self.offset += L
        return self._store.read(start - self._base, self.offset - self._base)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Chunk mask for ``N`` new queries over rows ``[start_position, offset + N)`` (llama4 builds its
        own; this serves any model that asks the cache), shaped as mlx-lm's KVCache's: ``None`` (one query,
        whatever ``return_array`` says) or ``"causal"`` when every query sees all earlier rows, else a
        boolean ``(N, K)`` array."""
        start = self.start_position
        same_start = self._chunk_start(self.offset + N - 1) == start
        if (N == 1 or not return_array) and window_size is None and same_start:
            return None if N == 1 else "causal"
        q = mx.arange(self.offset, self.offset + N)
        k = mx.arange(start, self.offset + N)
        same_chunk = (q[:, None] // self.chunk_size) == (k[None] // self.chunk_size)  # (N, K)
        return visible(q, k, window_size) & same_chunk

    def size(self) -> int:
        return self.offset - self.start_position

    def rewindable(self) -> int:
        first_whole = -(-self._base // self.chunk_size) * self.chunk_size  # first chunk start >= base
        return max(0, self.offset - first_whole) if self._base > 0 else self.offset

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens, restoring exactly the earlier state; returns the number removed.

        Raises:
            RewindError: when the target chunk's front has been dropped.
        """
        n = self._check_rewind(n)
        self.offset -= n
        return n

    # -- state: mlx-lm's (keys, values, offset, chunk_size, start_position); rows from start_position --
    def _arrays_state(self) -> tuple:
        if self._store.empty() or self.offset == self._base:
            return (None, None)
        return self._store.read(0, self.offset - self._base)

    def _scalars(self) -> tuple:
        return (self.offset, self.chunk_size, self._base)

    def _restore(self, arrays: tuple, scalars: tuple) -> None:
        offset, chunk_size, start = (int(s) for s in scalars)
        assert chunk_size == self.chunk_size, "state is for another chunk size"
        self.offset, self._base = offset, start
        keys, values = arrays
        if keys is None:
            self._store.clear()
            return
        rows = offset - start
        self._store.load(tuple(p[..., :rows, :] for p in self._planes(keys)),
                         tuple(p[..., :rows, :] for p in self._planes(values)))

    @classmethod
    def _blank(cls, scalars: tuple) -> ChunkedKVCache:
        return cls(int(scalars[1]))
