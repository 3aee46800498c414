"""Batch caches for mlx-lm's batched generation, built from mlxkv layouts and giving mlxkv layouts back.

mlx-lm batches requests by ``merge``-ing one cache per sequence into a batch cache (``KVCache.merge`` ->
``BatchKVCache``, ``RotatingKVCache.merge`` -> ``BatchRotatingKVCache``; ``CacheList.merge`` merges member
by member), runs the batch through its ``prepare`` / ``update_and_fetch`` / ``filter`` / ``extend`` /
``finalize`` and finally ``extract(i)``-s each sequence's cache again. The classes here are mlx-lm's batch
caches (same names, state and behaviour, so files and ``isinstance`` checks keep working) whose ``extract``
returns the mlxkv layout, rebuilt through ``from_state``, instead of mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from mlxkv.kv.layouts.rotating import RotatingKVCache
from mlxkv.kv.layouts.standard import KVCache


class BatchKVCache(mlx_cache.BatchKVCache):
    """mlx-lm's ``BatchKVCache`` (left-padded rows of B full-attention sequences); ``extract`` gives a
    :class:`~mlxkv.kv.layouts.KVCache`."""

    def extract(self, idx: int) -> KVCache:
        """Sequence ``idx`` on its own: its rows without the left padding, as an mlxkv ``KVCache``."""
        mx.eval(self.left_padding)
        pad = self.left_padding.tolist()[idx]
        # contiguous: a copy, so the single cache does not keep the whole batch buffer alive
        keys = mx.contiguous(self.keys[idx: idx + 1, :, pad: self._idx])  # (1, n_kv, L, D)
        values = mx.contiguous(self.values[idx: idx + 1, :, pad: self._idx])
        return KVCache.from_state((keys, values, keys.shape[2]))


class BatchRotatingKVCache(mlx_cache.BatchRotatingKVCache):
    """mlx-lm's ``BatchRotatingKVCache`` (B sliding windows of ``max_size`` rows, no sink tokens);
    ``extract`` gives a :class:`~mlxkv.kv.layouts.RotatingKVCache`."""

    def extract(self, idx: int) -> RotatingKVCache:
        """Sequence ``idx`` on its own: its window in temporal order, as an mlxkv ``RotatingKVCache``."""
        mx.eval(self.left_padding, self.offset)
        pad = max(0, self.left_padding.tolist()[idx])
        offset = self.offset.tolist()[idx]
        keys, values, end = self.keys[idx: idx + 1], self.values[idx: idx + 1], self._idx
        if self.rotated:  # the ring's oldest row is at the write index
            keys, values, end = mx.roll(keys, -self._idx, axis=2), mx.roll(values, -self._idx, axis=2), self.max_size
        keys = mx.contiguous(keys[:, :, pad:end])  # (1, n_kv, L, D), temporal order
        values = mx.contiguous(values[:, :, pad:end])
        rows = keys.shape[2]
        return RotatingKVCache.from_state((keys, values, offset, 0, self.max_size, rows))


KVCache.batch_class = BatchKVCache
RotatingKVCache.batch_class = BatchRotatingKVCache
