"""mlxkv's layer caches: layouts per attention type over one storage interface.

Layouts (each speaks mlx-lm's cache protocol exactly, plus ``attend`` and ``rewindable``):

- :class:`KVCache` — full attention; token ``p`` in row ``p``.
- :class:`RotatingKVCache` — sliding window of ``max_size`` tokens with ``keep`` sink tokens.
- :class:`ChunkedKVCache` — Llama 4 local chunks (global offset, visible chunk start).
- ``Quantized*`` twins of the three — rows stored as 4/8-bit ``mx.quantize`` planes.
- :class:`BatchKVCache` / :class:`BatchRotatingKVCache` — mlx-lm's batch caches, which ``KVCache.merge`` /
  ``RotatingKVCache.merge`` build for mlx-lm's batched generation; their ``extract`` gives mlxkv layouts back.

Storage (:mod:`mlxkv.kv.layouts.dense_storage`) owns the buffers; layouts only map positions to slots. The
attention hook (:mod:`mlxkv.kv.layouts.attention_hook`) makes the cache decide attention; :func:`make_caches`
picks each layer's layout from the model's own structure.

Rewind: how far back ``trim(n)`` is exact
------------------------------------------
``trim(n)`` restores exactly the state before the last ``n`` appended tokens, or raises
:class:`RewindError` — never silently wrong K/V. ``cache.rewindable()`` is the current limit.

- standard: any ``n`` (rows are never overwritten; ``n`` beyond the offset trims everything).
- rotating: any ``n <= max_rewind + 1`` always (default ``max_rewind`` 64); any ``n`` while the ring
  has not wrapped. The ring holds ``max_rewind`` rows beyond the window — the undo record of the
  rows the last writes overwrote — so a wrapped ring rewinds by moving its cursor back.
- chunked: any ``n <= max_rewind`` always; further while the target chunk is still stored. Fronts
  are dropped only up to the chunk start before ``offset - max_rewind``.
- recurrent state (ArraysCache placeholders) is the model's: not trimmable.

A cache rebuilt with ``from_state`` rewinds as far as the rows in its state allow.

In-place decode writes
----------------------
A single-token append writes its row into the resident buffer (rotating: its ring slot; chunked:
fronts are dropped once per ``step`` rows, never per token), which MLX does in place — it donates the
buffer — when the cache is the buffer's only owner *at the moment the write is scheduled*
(``mx.eval`` / ``mx.async_eval``). Storage keeps no views of its buffers; the views
``update_and_fetch`` returns are read by that step's attention. So:

- never hold fetched keys/values across steps;
- pipelined engines: build step n+1 while step n runs, but wait for step n before scheduling step n+1.
  Scheduling first (``async_eval(next); y.item()``, mlx-lm's generate order) lets step n's pending
  attention still hold the buffer, and MLX copies the whole K/V buffer on every write (measured on
  CPU with 2^18-row buffers and a tiny step: ~100 ms per step instead of ~1 ms, for mlx-lm's KVCache
  and ours alike). tests/test_cache_memory.py checks the documented order; scripts/bench_cache.py
  times both orders on a model.

The rotating window is returned in mlx-lm's ring order (bit-equal logits), a gathered copy of the
window once it has wrapped — ``max_size`` rows, never the whole ring.

``MLXKV_KV_INPLACE_WRITE=0`` returns to the slice-update path: single-token appends go through the
general multi-row update (rotating: the window re-gathered in temporal order, as mlx-lm's multi-token
path does; chunked: fronts dropped as soon as possible). For the standard layout both paths are the
same slice write.
"""

from mlxkv.kv.layouts.attention_hook import install_attention_hook
from mlxkv.kv.layouts.base import DEFAULT_MAX_REWIND, LayerCache, RewindError
from mlxkv.kv.layouts.chunked import ChunkedKVCache
from mlxkv.kv.layouts.dense_storage import DenseStorage
from mlxkv.kv.layouts.mlx_lm_batch import BatchKVCache, BatchRotatingKVCache
from mlxkv.kv.layouts.model_layouts import (
    can_drop_tokens,
    check_kv_group_size,
    describe_layout,
    each_layer_cache,
    kv_head_dims,
    layer_kind,
    make_caches,
    mlx_lm_caches,
)
from mlxkv.kv.layouts.persist import load_prompt_cache, save_prompt_cache
from mlxkv.kv.layouts.quantized import (
    QuantizedChunkedKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
)
from mlxkv.kv.layouts.rotating import RotatingKVCache
from mlxkv.kv.layouts.standard import KVCache

__all__ = [
    "DEFAULT_MAX_REWIND",
    "BatchKVCache",
    "BatchRotatingKVCache",
    "ChunkedKVCache",
    "DenseStorage",
    "KVCache",
    "LayerCache",
    "QuantizedChunkedKVCache",
    "QuantizedKVCache",
    "QuantizedRotatingKVCache",
    "RewindError",
    "RotatingKVCache",
    "can_drop_tokens",
    "check_kv_group_size",
    "describe_layout",
    "each_layer_cache",
    "install_attention_hook",
    "kv_head_dims",
    "layer_kind",
    "load_prompt_cache",
    "make_caches",
    "mlx_lm_caches",
    "save_prompt_cache",
]
