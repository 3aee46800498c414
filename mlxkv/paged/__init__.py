"""Paged K/V storage: mlxkv's layer layouts over pages of one shared block pool.

- :class:`PagedStorage` (storage.py): per-layer page arrays ``[kv_heads, num_blocks, block_size, D]``,
  allocated at the first write; writes through ``kv_write``.
- :class:`PagedSequence` (sequence.py): one sequence against the block manager — slots, block tables,
  copy instructions, ``feed`` (decode tokens) / ``commit`` / ``trim_to`` / ``release``.
- :class:`PagedLayerCache` (layer_cache.py): mlx-lm's cache protocol for full, sliding and chunked layers;
  decode attention through ``paged_attention`` on the pages, dense SDPA otherwise.
- :class:`PagedBackend` (pool_backend.py): groups from the model's layouts, manager, storage; what
  ``CachePool(model, backend="paged", kv_config=...)`` uses.
- :class:`PagedBatchView` (batch_view.py): B sequences' layer in one decode forward, one ``paged_attention``
  call; :func:`mlxkv.engine.batch_view.make_batch_views` returns these for paged sequences.

Engine protocol: ``CachePool.open(prompt=..., salt=...)`` (prefix hit: prefill from ``seq.num_cached``),
prompt chunks allocate their slots themselves, ``seq.feed([token])`` before each decode step,
``seq.commit()`` after every model step, ``CachePool.release`` frees the blocks (they stay cached).
"""

from mlxkv.paged.batch_view import PagedBatchView, make_paged_batch_views
from mlxkv.paged.layer_cache import PagedLayerCache
from mlxkv.paged.pool_backend import PagedBackend, probe_block_bytes
from mlxkv.paged.sequence import PagedPoolExhausted, PagedSequence
from mlxkv.paged.storage import PagedStorage

__all__ = ["PagedBackend", "PagedBatchView", "PagedLayerCache", "PagedPoolExhausted", "PagedSequence",
           "PagedStorage", "make_paged_batch_views", "probe_block_bytes"]
