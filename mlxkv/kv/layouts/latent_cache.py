"""LatentCache: one MLA layer's cache of compressed latents and rope keys.

Per token it holds the normalised KV latent (``kv_lora_rank`` values) and the rotated rope key
(``qk_rope_head_dim`` values), shared by every head, instead of per-head K/V. It speaks mlx-lm's cache
protocol, so mlx-lm's own ``DeepseekV3Attention`` (which already caches latents) runs on it unchanged,
and :class:`mlxkv.mla.attention.MLAAttention` reads it directly.

A layer's attention asks for latent caches by declaring ``caches_latents = True`` (``MLAAttention`` does):
:func:`latent_layers` finds those layers and :func:`latent_caches` builds their caches, so the layouts never
import the attention modules that read them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask


class LatentCache:
    """Growable buffers ``latent (B, 1, capacity, kv_lora_rank)`` and ``k_pe (B, 1, capacity, rope_dim)``.

    Rows ``[0, offset)`` are live. Buffers grow by ``step`` rows; a write of new rows goes into the
    buffer in place (MLX donates it when the cache is its only owner, see DESIGN.md).

    Args:
        step: rows added per growth (the unit in which :attr:`nbytes` grows).
    """

    def __init__(self, step: int = 256):
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        self.step = step
        self.latent: mx.array | None = None  # (B, 1, capacity, kv_lora_rank)
        self.k_pe: mx.array | None = None  # (B, 1, capacity, qk_rope_head_dim)
        self.offset = 0

    # -- writing and reading -------------------------------------------------------------------
    def update_and_fetch(self, latent: mx.array, k_pe: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``latent (B, 1, L, R)`` and ``k_pe (B, 1, L, dr)``; return all live rows of both.

        Returns:
            ``(latent (B, 1, offset, R), k_pe (B, 1, offset, dr))`` after the append.
        """
        assert latent.ndim == 4 and latent.shape[1] == 1, f"latent must be (B, 1, L, R), got {latent.shape}"
        assert k_pe.shape[:3] == latent.shape[:3], f"k_pe {k_pe.shape} does not match latent {latent.shape}"
        prev, n = self.offset, latent.shape[2]
        if self.latent is None or prev + n > self.latent.shape[2]:
            self._grow(latent, k_pe, prev + n)
        self.offset = prev + n
        self.latent[..., prev : self.offset, :] = latent
        self.k_pe[..., prev : self.offset, :] = k_pe
        return self._live()

    def _grow(self, latent: mx.array, k_pe: mx.array, needed: int) -> None:
        B, _, _, R = latent.shape
        dr = k_pe.shape[-1]
        capacity = -(-needed // self.step) * self.step
        new_latent = mx.zeros((B, 1, capacity, R), latent.dtype)  # (B, 1, capacity, R)
        new_pe = mx.zeros((B, 1, capacity, dr), k_pe.dtype)  # (B, 1, capacity, dr)
        if self.latent is not None and self.offset > 0:
            new_latent[..., : self.offset, :] = self.latent[..., : self.offset, :]
            new_pe[..., : self.offset, :] = self.k_pe[..., : self.offset, :]
        self.latent, self.k_pe = new_latent, new_pe

    def _live(self) -> tuple[mx.array, mx.array]:
        if self.offset == self.latent.shape[2]:
            return self.latent, self.k_pe
        return self.latent[..., : self.offset, :], self.k_pe[..., : self.offset, :]

    # -- mlx-lm protocol -----------------------------------------------------------------------
    def size(self) -> int:
        """Live tokens (same as :attr:`offset`)."""
        return self.offset

    def empty(self) -> bool:
        """True before the first write."""
        return self.latent is None

    @property
    def capacity(self) -> int:
        """Token rows allocated (>= offset)."""
        return 0 if self.latent is None else self.latent.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the two buffers: ``capacity × (kv_lora_rank + rope_dim) × itemsize × B``."""
        if self.latent is None:
            return 0
        return self.latent.nbytes + self.k_pe.nbytes

    def is_trimmable(self) -> bool:
        """Always: rows past the offset are simply overwritten by the next write."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (fewer if fewer are cached); return how many were dropped."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The causal mask for ``N`` new queries after ``offset`` cached tokens (mlx-lm's convention)."""
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    @property
    def state(self) -> tuple:
        """``(latent, k_pe, offset)``: the live rows only, plus the offset (mlx-lm 0.32's KVCache shape)."""
        if self.latent is None:
            return None, None, 0
        latent, k_pe = self._live()
        return latent, k_pe, self.offset

    @state.setter
    def state(self, value: tuple) -> None:
        latent, k_pe, *rest = value
        self.latent, self.k_pe = latent, k_pe
        self.offset = int(rest[0]) if rest else (0 if latent is None else latent.shape[2])
        assert latent is None or self.offset <= latent.shape[2], "offset past the stored rows"

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(offset, step)`` as strings (older mlx-lm protocol: metadata kept apart from arrays)."""
        return str(self.offset), str(self.step)

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        self.offset, self.step = int(value[0]), int(value[1])

    @classmethod
    def from_state(cls, state: tuple, meta_state: tuple[str, ...] | None = None) -> LatentCache:
        """Rebuild a cache from :attr:`state` (and optionally :attr:`meta_state`)."""
        cache = cls()
        cache.state = state
        if meta_state is not None:
            cache.meta_state = meta_state
        return cache


def _layers(model: Any) -> list:
    layers = getattr(model, "layers", None)
    return list(layers) if layers is not None else []


def latent_layers(model: Any) -> list[int]:
    """Indices of the layers whose attention caches latents (its ``self_attn`` declares ``caches_latents``)."""
    return [i for i, layer in enumerate(_layers(model))
            if getattr(getattr(layer, "self_attn", None), "caches_latents", False)]


def latent_caches(model: Any, step: int = 256) -> list[LatentCache]:
    """One empty :class:`LatentCache` per layer of a model whose attention layers all cache latents.

    Raises:
        ValueError: some layer is not absorbed MLA (flag off, not a DeepSeek model, or
            :func:`mlxkv.mla.apply_mla` not called) — it would misread a latent cache.
    """
    layers = _layers(model)
    absorbed = set(latent_layers(model))
    missing = [i for i in range(len(layers)) if i not in absorbed]
    if not layers or missing:
        raise ValueError(
            f"make_mla_caches needs every layer to run absorbed MLA; layers {missing or '(none found)'} do not. "
            "Set MLXKV_MLA_ABSORBED=1 and call apply_mla(model) on a DeepSeek V2/V3 model first"
        )
    return [LatentCache(step=step) for _ in layers]
