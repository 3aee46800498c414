"""Contexts beyond a per-sequence KV budget (dense backend): the ``--kv-overflow`` policies.

- ``preempt``: no per-sequence cap (the plain cache; a full paged pool preempts whole sequences).
- ``window``: the first ``sinks`` tokens and the most recent ones (StreamingLLM):
  :class:`~mlxkv.kv.layouts.rotating.RotatingKVCache`.
- ``h2o``: sinks, a recent window and the heavy hitters, the rows with the most accumulated attention mass
  (:class:`OverflowKVCache`); evicted rows are gone.
- ``offload``: as h2o, but evicted rows move to host memory (:class:`OffloadTier`) and come back when a cheap
  8-bit key proxy says the current queries attend them.

Only full-attention layers get the policy; sliding-window and chunked layers are bounded already.
"""

from __future__ import annotations

from typing import Any

from mlxkv.kv.layouts.base import DEFAULT_MAX_REWIND, LayerCache
from mlxkv.kv.layouts.rotating import RotatingKVCache
from mlxkv.kv.overflow.cache import OverflowKVCache
from mlxkv.kv.overflow.offload import OffloadTier


def overflow_layer_cache(config: Any, kv_bits: int | None = None, kv_group_size: int = 64,
                         max_rewind: int = DEFAULT_MAX_REWIND) -> LayerCache | None:
    """The layer cache a full-attention layer gets under ``config`` (a :class:`mlxkv.config.KvOverflowConfig`);
    ``None`` for ``preempt`` (the plain cache)."""
    if config is None or not config.enabled:
        return None
    if config.policy == "window":
        if kv_bits is not None:
            return RotatingKVCache.quantized_twin(config.budget, keep=config.sinks, max_rewind=max_rewind,
                                                  bits=kv_bits, group_size=kv_group_size)
        return RotatingKVCache(config.budget, keep=config.sinks, max_rewind=max_rewind)
    return OverflowKVCache(config.policy, config.budget, sinks=config.sinks, recent=config.recent_tokens,
                           restore_threshold=config.restore_threshold)


__all__ = ["OffloadTier", "OverflowKVCache", "overflow_layer_cache"]
