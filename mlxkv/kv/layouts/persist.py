"""Saving and loading caches in mlx-lm's prompt-cache file format.

``save_prompt_cache`` is mlx-lm's own: our layouts carry mlx-lm's class names and state tuples, so the
files are ordinary mlx-lm prompt caches (mlx-lm's ``load_prompt_cache`` reads the unquantized standard,
rotating and chunked ones, quantized standard ones and the batch caches into its own classes).
``load_prompt_cache`` here reads the same format into mlxkv layouts (mlx-lm classes for anything else,
e.g. recurrent state); a loaded cache continues exactly as the saved one (same rows, same order).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import save_prompt_cache  # noqa: F401  (re-exported: the format is mlx-lm's)

from mlxkv.kv.layouts.chunked import ChunkedKVCache
from mlxkv.kv.layouts.mlx_lm_batch import BatchKVCache, BatchRotatingKVCache
from mlxkv.kv.layouts.quantized import (
    QuantizedChunkedKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
)
from mlxkv.kv.layouts.rotating import RotatingKVCache
from mlxkv.kv.layouts.standard import KVCache

_OURS = {cls.__name__: cls for cls in (KVCache, RotatingKVCache, ChunkedKVCache, QuantizedKVCache,
                                       QuantizedRotatingKVCache, QuantizedChunkedKVCache, BatchKVCache,
                                       BatchRotatingKVCache)}


def _from_state(class_name: str, state: Any) -> Any:
    if class_name in _OURS:
        return _OURS[class_name].from_state(state)
    if class_name == "CacheList":
        return mlx_cache.CacheList(*(_from_state(name, s) for s, name in state))
    return getattr(mlx_cache, class_name).from_state(state)


def _scalar(value: mx.array, kind: str) -> Any:
    if kind == "scalar":
        return value.item()
    if kind == "string":
        return "".join(chr(c) for c in value.tolist())
    if kind == "none":
        return None
    raise ValueError(f"unknown scalar kind {kind!r} in prompt cache file")


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """Load a file written by ``save_prompt_cache`` (ours or mlx-lm's) into mlxkv layouts.

    Returns:
        The cache list, and the user metadata dict too when ``return_metadata``.
    """
    arrays, meta = mx.load(file_name, return_metadata=True)
    metadata, classes, scalars = tree_unflatten(list(meta.items()))
    for key, kind in scalars[1:]:
        arrays[key] = _scalar(arrays[key], kind)
    states = tree_unflatten(list(arrays.items()))
    caches = [_from_state(name, state) for name, state in zip(classes, states)]
    return (caches, metadata) if return_metadata else caches
