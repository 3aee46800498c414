"""Paged K/V storage: mlxkv's layer layouts over pages of one shared block pool.

- :class:`PagedStorage` (page_arrays.py): per-layer page arrays ``[kv_heads, num_blocks, block_size, D]``,
  allocated at the first write; writes through ``kv_write``. :class:`QuantizedPagedStorage` (quantized_pages.py):
  the same pages as ``mx.quantize`` planes (``kv_bits`` 4 or 8), read with ``mx.quantized_matmul``.
- :class:`PagedSequence` (paged_sequence.py): one sequence against the block manager — slots, block tables,
  copy instructions, ``feed`` (decode tokens) / ``commit`` / ``trim_to`` / ``release``; its step's metadata
  (step_context.py: tables and slots built and checked on the host before the forward).
- :class:`PagedLayerCache` (layer_cache.py): mlx-lm's cache protocol for full, sliding and chunked layers: writes
  and fetches; its attention is its storage kind's backend (sequence_attention.py: ``paged_attention`` on the
  pages, page runs in place, dense SDPA).
- :class:`~mlxkv.kv.paged.latent_pages.LatentPagedCache` (latent_pages.py): absorbed MLA's latent + rope-key rows in
  the K/V pages of its layers, read by ``latent_attend``.
- :class:`~mlxkv.kv.paged.page_overflow.PageOverflow` (page_overflow.py): ``--kv-overflow window|h2o|offload`` on
  pages: whole pages of one sequence dropped past its budget, the kept pages attended; offload's host store and key
  proxy in page_offload.py (:class:`~mlxkv.kv.paged.page_offload.PageHostStore`).
- :class:`PagedBackend` (backend.py): groups from the model's layouts, manager, storage; what
  ``CachePool(model, backend="paged", kv_config=...)`` uses.

Batched decode over paged sequences (one ``paged_attention`` call per layer) is in
:mod:`mlxkv.kv.batching.paged_views` and :mod:`mlxkv.kv.batching.attention_backends`.

Engine protocol: ``CachePool.open(prompt=..., salt=...)`` (prefix hit: prefill from ``seq.num_cached``),
``seq.reserve(start, end)`` before a prompt chunk (else the chunk's first layer allocates its slots),
``seq.feed([token])`` before each decode step,
``seq.commit()`` after every model step, ``CachePool.release`` frees the blocks (they stay cached).
"""

from mlxkv.kv.paged.backend import PagedBackend, probe_block_bytes
from mlxkv.kv.paged.layer_cache import PagedLayerCache
from mlxkv.kv.paged.page_arrays import PagedStorage
from mlxkv.kv.paged.paged_sequence import PagedPoolExhausted, PagedSequence
from mlxkv.kv.paged.quantized_pages import QuantizedPagedStorage

__all__ = ["PagedBackend", "PagedLayerCache", "PagedPoolExhausted", "PagedSequence",
           "PagedStorage", "QuantizedPagedStorage", "probe_block_bytes"]
