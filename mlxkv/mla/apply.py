"""Wiring: swap MLA attention modules in behind the flags, and build the matching latent caches."""

from __future__ import annotations

from typing import Any

from mlxkv import env
from mlxkv.kv.layouts.latent_cache import LatentCache, latent_caches, latent_layers
from mlxkv.mla.attention import MODES, SPLIT_CHUNK, MLAAttention


def _mla_classes() -> tuple[type, ...]:
    """mlx-lm attention classes with DeepSeek's MLA layout that :class:`MLAAttention` reproduces exactly."""
    from mlx_lm.models.deepseek_v2 import DeepseekV2Attention
    from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

    return DeepseekV2Attention, DeepseekV3Attention


def _layers(model: Any) -> list:
    layers = getattr(model, "layers", None)
    return list(layers) if layers is not None else []


def apply_mla(model: Any, *, split_chunk: int = SPLIT_CHUNK) -> list[int]:
    """Swap absorbed MLA attention into every DeepSeek V2/V3 attention layer, if the flags ask for it.

    With ``MLXKV_MLA_ABSORBED`` off (the default) the model is left exactly as mlx-lm built it. With it
    on, each ``self_attn`` that is mlx-lm's ``DeepseekV2Attention`` / ``DeepseekV3Attention`` becomes an
    :class:`MLAAttention` reusing the same weight modules (no copies; parameter names unchanged).
    Layers already swapped are left alone, so calling twice is harmless. Call it after loading weights
    and before building caches; swapped layers need :class:`LatentCache` (see :func:`make_mla_caches`).

    Args:
        model: an mlx-lm model (``model.layers[i].self_attn``).
        split_chunk: keys per chunk when ``MLXKV_MLA_SPLIT_KV`` is on.

    Returns:
        Indices of the layers that now run absorbed MLA (empty when the flag is off or no layer is MLA).

    Raises:
        ValueError: ``MLXKV_MLA_SPLIT_KV`` set without ``MLXKV_MLA_ABSORBED``, or a malformed flag value.
    """
    split = env.flags().mla_split_kv  # the split flag alone is a user error even on other models
    if not env.flags().mla_absorbed:
        return []
    classes = _mla_classes()
    swapped = []
    for i, layer in enumerate(_layers(model)):
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, MLAAttention):
            attn.split_kv, attn.split_chunk = split, split_chunk
        elif type(attn) in classes:
            layer.self_attn = MLAAttention(attn, split_kv=split, split_chunk=split_chunk)
        else:
            continue
        swapped.append(i)
    return swapped


def mla_layer_indices(model: Any) -> list[int]:
    """Indices of layers whose attention is :class:`MLAAttention` (they need a :class:`LatentCache`)."""
    return latent_layers(model)


def make_mla_caches(model: Any, step: int = 256) -> list[LatentCache]:
    """One empty :class:`LatentCache` per layer of a model whose attention layers were all swapped.

    Usable as ``CachePool(model, cache_factory=make_mla_caches)``.

    Raises:
        ValueError: some layer is not absorbed MLA (flag off, not a DeepSeek model, or
            :func:`apply_mla` not called) — it would misread a latent cache.
    """
    return latent_caches(model, step)


def set_mla_mode(model: Any, mode: str) -> None:
    """Force every :class:`MLAAttention` of ``model`` to ``"absorbed"`` or ``"materialised"``, or back to ``"auto"``.

    Raises:
        ValueError: ``mode`` is not one of ``auto``, ``absorbed``, ``materialised``.
    """
    if mode not in MODES:
        raise ValueError(f"MLA mode must be one of {', '.join(MODES)}, got {mode!r}")
    for i in mla_layer_indices(model):
        model.layers[i].self_attn.mode = mode
