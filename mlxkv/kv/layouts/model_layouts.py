"""Which layout each layer gets: derived from the model's own cache structure.

The model says what its layers need (``model.make_cache()`` where it has one, else mlx-lm's
``make_prompt_cache``: one full-attention cache per layer); each mlx-lm cache maps to ours:

=========================================  =================================================
mlx-lm                                      mlxkv
=========================================  =================================================
``KVCache`` / ``ConcatenateKVCache``        ``KVCache`` (``RotatingKVCache(max_kv_size, keep=4)``
                                            when ``max_kv_size`` is set)
``QuantizedKVCache``                        ``QuantizedKVCache``
``RotatingKVCache(max_size, keep)``         ``RotatingKVCache(min(max_size, max_kv_size), keep)``
``ChunkedKVCache(chunk)``                   ``ChunkedKVCache(chunk)`` (already bounded)
``CacheList(a, b, ...)``                    ``CacheList`` of the mapped members
``ArraysCache`` / other recurrent state     kept as is (model-owned state; a placeholder to us)
=========================================  =================================================

``max_kv_size`` applies to every architecture (mlx-lm ignores it for models with ``make_cache``).
``kv_bits`` quantizes every attention layout; MLA models (their attention consumes the cached
latents directly) refuse it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from mlx_lm.models import cache as mlx_cache

from mlxkv.kv.layouts.base import DEFAULT_MAX_REWIND, LayerCache
from mlxkv.kv.layouts.chunked import ChunkedKVCache
from mlxkv.kv.layouts.latent_cache import latent_caches, latent_layers
from mlxkv.kv.layouts.rotating import RotatingKVCache
from mlxkv.kv.layouts.standard import KVCache
from mlxkv.rules import KV_BITS, KV_GROUP_SIZES, MAX_KV_KEEP


def _is_mla(model: Any) -> bool:
    return any(hasattr(m, "kv_lora_rank") for _, m in model.named_modules())


def _model_caches(model: Any) -> list:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return mlx_cache.make_prompt_cache(model)


def make_caches(model: Any, max_kv_size: int | None = None, kv_bits: int | None = None,
                kv_group_size: int = 64, max_rewind: int = DEFAULT_MAX_REWIND, overflow: Any = None) -> list:
    """mlxkv layer caches for ``model``, one per layer, in the layout its attention needs.

    Args:
        model: an mlx-lm model.
        max_kv_size: cap on tokens kept per attention layer; full-attention layers become rotating
            caches keeping ``MAX_KV_KEEP`` sink tokens, sliding layers shrink to it if larger.
        kv_bits: 4 or 8 to store K/V quantized (``None``: the activations' dtype).
        kv_group_size: quantization group along head_dim (32, 64 or 128).
        max_rewind: tokens rotating and chunked layers can always rewind exactly.
        overflow: a :class:`mlxkv.config.KvOverflowConfig`: full-attention layers get its policy's layout
            (:func:`mlxkv.kv.overflow.overflow_layer_cache`); ``None`` or preempt: the plain layout.

    Returns:
        A list like ``model.make_cache()``'s, with mlxkv caches in place of mlx-lm's attention caches.

    Raises:
        ValueError: bad ``max_kv_size`` / ``kv_bits`` / ``kv_group_size``, or ``kv_bits`` on an MLA model.
    """
    from mlxkv.kv.overflow import overflow_layer_cache

    if latent_layers(model):  # absorbed MLA (MLXKV_MLA_ABSORBED=1): the layers cache latents
        if max_kv_size is not None or kv_bits is not None or (overflow is not None and overflow.enabled):
            raise ValueError("absorbed MLA (MLXKV_MLA_ABSORBED=1) supports neither max_kv_size, kv_bits nor "
                             "--kv-overflow")
        return latent_caches(model)
    if overflow is not None and overflow.policy in ("h2o", "offload") and _is_mla(model):
        raise ValueError(f"--kv-overflow {overflow.policy} ranks cached keys, and this multi-head latent attention "
                         "model caches latents: use --kv-overflow window")
    if max_kv_size is not None and max_kv_size <= MAX_KV_KEEP:
        raise ValueError(f"max_kv_size must be > {MAX_KV_KEEP} (the sink tokens kept), got {max_kv_size}")
    if kv_bits is not None:
        if kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS} (or None), got {kv_bits}")
        if kv_group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {kv_group_size}")
        if _is_mla(model):
            raise ValueError("kv_bits is not supported for multi-head latent attention models "
                             "(their attention reads the cached latents directly); use kv_bits=None")

    def build(layout: type, *args, **kwargs) -> LayerCache:
        if kv_bits is None:
            return layout(*args, **kwargs)
        return layout.quantized_twin(*args, bits=kv_bits, group_size=kv_group_size, **kwargs)

    def convert(c: Any) -> Any:
        if isinstance(c, LayerCache):
            return c
        if isinstance(c, mlx_cache.CacheList):
            return mlx_cache.CacheList(*(convert(m) for m in c.caches))
        if isinstance(c, (mlx_cache.KVCache, mlx_cache.ConcatenateKVCache, mlx_cache.QuantizedKVCache)):
            bounded = overflow_layer_cache(overflow, kv_bits, kv_group_size, max_rewind) if overflow else None
            if bounded is not None:
                return bounded
            if max_kv_size is not None:
                return build(RotatingKVCache, max_kv_size, keep=MAX_KV_KEEP, max_rewind=max_rewind)
            if isinstance(c, mlx_cache.QuantizedKVCache) and kv_bits is None:
                return KVCache.quantized_twin(bits=c.bits, group_size=c.group_size)
            return build(KVCache)
        if isinstance(c, mlx_cache.RotatingKVCache):
            size = c.max_size if max_kv_size is None else min(c.max_size, max_kv_size)
            return build(RotatingKVCache, size, keep=min(c.keep, size - 1), max_rewind=max_rewind)
        if isinstance(c, mlx_cache.ChunkedKVCache):
            return build(ChunkedKVCache, c.chunk_size, max_rewind=max_rewind)
        return c  # model-owned recurrent state (ArraysCache, ...): the model reads and writes it

    return [convert(c) for c in _model_caches(model)]


def layer_kind(cache: Any) -> str:
    """A short name for one layer cache: ``standard``, ``rotating(8)``, ``rotating(1024, keep 4)``,
    ``chunked(16)``, ``recurrent(ArraysCache)``, ``[a + b]`` for a CacheList; `` q4``/`` q8`` if quantized."""
    q = f" q{cache.bits}" if isinstance(cache, LayerCache) and getattr(cache, "bits", None) else ""
    if isinstance(cache, RotatingKVCache):
        keep = f", keep {cache.keep}" if cache.keep else ""
        return f"rotating({cache.max_size}{keep}){q}"
    if isinstance(cache, ChunkedKVCache):
        return f"chunked({cache.chunk_size}){q}"
    if isinstance(cache, KVCache):
        return f"standard{q}"
    if isinstance(cache, mlx_cache.CacheList):
        return "[" + " + ".join(layer_kind(c) for c in cache.caches) + "]"
    return f"recurrent({type(cache).__name__})"


def describe_layout(model: Any, max_kv_size: int | None = None, kv_bits: int | None = None,
                    kv_group_size: int = 64) -> str:
    """One line for a README table: each layer kind with its count, in order of first layer,
    e.g. ``"chunked(16) x3, standard x1"``."""
    caches = make_caches(model, max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size)
    counts = Counter(layer_kind(c) for c in caches)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.items())


def kv_head_dims(model: Any) -> set[int]:
    """The head sizes of the keys and values ``model``'s attention layers cache (from their projections).

    Found on modules that name their kv-head count (``n_kv_heads`` or ``num_key_value_heads``) and have
    ``k_proj`` / ``v_proj`` projections, as mlx-lm's attention classes do; a quantized projection's weight
    keeps one row per output feature. Empty when no layer looks like that (MLA, fused projections).
    """
    dims = set()
    for module in model.modules():
        kv_heads = getattr(module, "n_kv_heads", None) or getattr(module, "num_key_value_heads", None)
        if not isinstance(kv_heads, int) or kv_heads < 1:
            continue
        for name in ("k_proj", "v_proj"):
            weight = getattr(getattr(module, name, None), "weight", None)
            if weight is not None and weight.shape[0] % kv_heads == 0:
                dims.add(weight.shape[0] // kv_heads)
    return dims


def check_kv_group_size(model: Any, kv_group_size: int) -> None:
    """Refuse a quantized KV cache whose group size does not divide every cached head size of ``model``.

    MLX quantizes each cached row in groups along head_dim; checked here so that the error comes when the pool
    is built, before any prompt is processed.

    Raises:
        ValueError: one line naming the head_dim and the group sizes that fit, or saying that none does.
    """
    head_dims = kv_head_dims(model)
    misfits = sorted(d for d in head_dims if d % kv_group_size)
    if not misfits:
        return
    fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in head_dims)]
    hint = (f"use --kv-group-size {' or '.join(map(str, fits))}" if fits else
            f"no valid group size ({', '.join(map(str, KV_GROUP_SIZES))}) divides it, so this model cannot use a "
            "quantized KV cache: run it without --kv-bits")
    raise ValueError(f"--kv-bits: the model's head_dim {misfits[0]} is not divisible by the KV quantization "
                     f"group size {kv_group_size}; {hint}")


def each_layer_cache(caches: Iterable[Any]) -> Iterator[Any]:
    """Every layer cache, the members of mlx-lm ``CacheList`` s included."""
    for c in caches:
        if isinstance(c, mlx_cache.CacheList):
            yield from each_layer_cache(c.caches)
        else:
            yield c


def _can_drop(cache: Any, n: int) -> bool:
    if isinstance(cache, ChunkedKVCache):
        return False  # kept out by design (its trim would drop them exactly)
    if isinstance(cache, RotatingKVCache):
        return cache.max_rewind + 1 >= n
    return isinstance(cache, (KVCache, mlx_cache.KVCache))


def can_drop_tokens(caches: list, n: int) -> bool:
    """Whether every layer can ``trim`` the ``n`` tokens it was just given exactly (padded prefill): standard
    layouts, rotating ones rewinding that far, mlx-lm's ``KVCache``; never chunked or recurrent layers."""
    return all(_can_drop(c, n) for c in each_layer_cache(caches))


def mlx_lm_caches(model: Any, *, max_kv_size: int | None = None, kv_bits: int | None = None,
                  kv_group_size: int = 64) -> list:
    """mlx-lm's own caches for ``model`` (the reference the tests and benchmarks compare against).

    mlx-lm quantizes only plain ``KVCache`` layers; others stay unquantized, as in mlx-lm.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    if kv_bits is not None:
        caches = [c.to_quantized(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
                  for c in caches]
    return caches
