"""The KV cache, behind one facade: the engine imports this package and nothing below it.

- :class:`CachePool` (store.py): the store of one model's sequences, dense or paged — open (with its
  prefix hit), extend, fork, preempt, resume, release, and whether more tokens fit;
- :class:`Sequence` (sequence.py): one sequence's handle, with its single id, its layer caches for the model
  and the per-step protocol (``feed`` before a step, ``commit`` after it);
- ``layouts/``: the layer caches per attention type (standard, rotating, chunked, quantized, latent), in
  mlx-lm's cache protocol plus ``attend``; ``paged/``: the same layouts over pages of one block pool;
  ``batching/``: B sequences' caches as one batched cache for a decode forward; ``blocks/``: the block
  manager (pure Python: no MLX import); ``tier/``: the secondary tier (host memory, disk).

Names are resolved on first use so that importing the pure-Python block manager (``mlxkv.kv.blocks``) does not
import MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CachePool": "mlxkv.kv.store",
    "CacheRequest": "mlxkv.kv.blocks.cache_request",
    "PoolFullError": "mlxkv.kv.store",
    "Sequence": "mlxkv.kv.sequence",
    "SequenceId": "mlxkv.kv.sequence",
    "BatchUnsupported": "mlxkv.kv.batching",
    "check_attended": "mlxkv.kv.batching",
    "make_batch_views": "mlxkv.kv.batching",
    "cache_arrays": "mlxkv.kv.batching.prefill_views",
    "make_prefill_views": "mlxkv.kv.batching.prefill_views",
    "KvCacheConfig": "mlxkv.config",
    "RetentionConfig": "mlxkv.kv.blocks.retention",
    "RewindError": "mlxkv.kv.layouts",
    "make_caches": "mlxkv.kv.layouts",
    "save_prompt_cache": "mlxkv.kv.layouts",
    "load_prompt_cache": "mlxkv.kv.layouts",
    "layer_kind": "mlxkv.kv.layouts",
    "can_drop_tokens": "mlxkv.kv.layouts",
    "each_layer_cache": "mlxkv.kv.layouts",
    "paged_blocks_for": "mlxkv.kv.admission",
    "event_to_json": "mlxkv.kv.blocks.events",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxkv.kv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
