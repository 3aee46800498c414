"""Absorbed multi-head latent attention (DeepSeek V2/V3) behind ``MLXKV_MLA_ABSORBED``.

mlx-lm 0.32.2 caches differently per generation: ``deepseek_v2`` caches expanded per-head K/V
(``n_heads × (qk_nope + qk_rope)`` key and ``n_heads × v_head_dim`` value values per token);
``deepseek_v3`` already caches the latent and rope key (in a plain ``KVCache``: keys = latent,
values = rope key), absorbs for single-token decode, but re-expands K/V over the *whole* cache for any
multi-token call (chunked-prefill continuation, speculative verification).

With the flag on, :func:`apply_mla` swaps in :class:`MLAAttention` for both: the cache holds
``kv_lora_rank + qk_rope_head_dim`` values per token per layer (:class:`LatentCache`), and each call picks
absorbed or materialised attention by cost. ``MLXKV_MLA_SPLIT_KV`` additionally splits long latent ranges
into chunks merged by log-sum-exp.

    layers = apply_mla(model)            # no-op unless MLXKV_MLA_ABSORBED=1
    caches = make_mla_caches(model)      # or CachePool(model, cache_factory=make_mla_caches)
"""

from mlxkv.kv.layouts.latent_cache import LatentCache
from mlxkv.mla.apply import apply_mla, make_mla_caches, mla_layer_indices, set_mla_mode
from mlxkv.mla.attention import MLAAttention, prefer_absorbed
from mlxkv.mla.latent import latent_attention

__all__ = ["LatentCache", "MLAAttention", "apply_mla", "latent_attention", "make_mla_caches",
           "mla_layer_indices", "prefer_absorbed", "set_mla_mode"]
