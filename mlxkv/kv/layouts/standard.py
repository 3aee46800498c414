"""Standard (full-attention) layout: token ``p`` lives in row ``p``; every cached token is visible."""

from __future__ import annotations

from typing import Any

from mlxkv.kv.layouts.base import LayerCache
from mlxkv.kv.layouts.masks import standard_mask


class KVCache(LayerCache):
    """Full-attention cache (mlx-lm ``KVCache`` protocol), rows grown ``step`` at a time.

    Rewind: ``trim(n)`` is always exact (rows are never overwritten, only the offset moves back);
    ``n`` larger than the cached tokens trims everything, like mlx-lm.

    Args:
        step: growth granularity in rows.
    """

    #: mlx-lm's batch cache this layout merges into (set by :mod:`mlxkv.kv.layouts.mlx_lm_batch`).
    batch_class: type

    def __init__(self, step: int = 256):
        super().__init__(step)

    def update_and_fetch(self, keys, values):
        """Append ``keys``/``values`` ``(B, n_kv, L, D)``; return every cached row (views) ``(B, n_kv, offset, D)``."""
        k, v = self._store.encode(keys), self._store.encode(values)
        self._store.write(self.offset, k, v)  # a decode row lands in place in the resident buffer
        self.offset += keys.shape[2]
        return self._store.read(0, self.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for ``N`` new queries: ``"causal"`` / ``None`` / an array exactly as mlx-lm's KVCache."""
        return standard_mask(N, self.offset, return_array, window_size)

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list) -> Any:
        """mlx-lm's batching entry point: the caches (one per sequence) as one left-padded
        :class:`~mlxkv.kv.layouts.mlx_lm_batch.BatchKVCache`; its ``extract(i)`` gives sequence ``i`` back as a ``KVCache``."""
        return cls.batch_class.merge(caches)

    def rewindable(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (exact for any ``n``); returns the number removed."""
        n = self._check_rewind(n)
        self.offset -= n
        return n

    # -- state: (keys, values, offset) like mlx-lm, rows beyond the offset left out ---------------
    def _arrays_state(self) -> tuple:
        if self._store.empty():
            return (None, None)
        return self._store.read(0, self.offset)

    def _scalars(self) -> tuple:
        return (self.offset,)

    def _restore(self, arrays: tuple, scalars: tuple) -> None:
        (self.offset,) = (int(s) for s in scalars[:1])
        keys, values = arrays
        if keys is None:
            self._store.clear()
            return
        k = tuple(p[..., : self.offset, :] for p in self._planes(keys))
        v = tuple(p[..., : self.offset, :] for p in self._planes(values))
        self._store.load(k, v)

    @classmethod
    def _blank(cls, scalars: tuple) -> KVCache:
        return cls()
