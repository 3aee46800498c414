"""MLAAttention: DeepSeek multi-head latent attention that caches latents and absorbs the up-projection.

The layer's kv up-projection ``W_kv_b`` maps the latent ``c`` (rank R) to each head's key part
``k_nope = W_uk c`` and value ``v = W_uv c``. Scores ``q_nope · k_nope = (W_ukᵀ q_nope) · c``, so the
key part is absorbed into the query (attention runs in latent space against the cached ``c``), and
``Σ p v = W_uv (Σ p c)``, so the value part moves after the weighted sum. Decode then reads only the
latent cache. A cold prefill is cheaper materialised (expand K/V from the latents for that call only);
:func:`prefer_absorbed` decides per call from the FLOP counts of both.

The module reuses the original attention module's submodules (same objects, same parameter names), so
swapping it in copies no weight and keeps ``model.parameters()`` and weight loading unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxkv.mla.latent import latent_attention

#: Keys per chunk when split-KV is on (``MLXKV_MLA_SPLIT_KV``).
SPLIT_CHUNK = 1024
MODES = ("auto", "absorbed", "materialised")
# Submodules taken over from mlx-lm's DeepseekV2Attention / DeepseekV3Attention (whichever exist).
_SUBMODULES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
               "kv_b_proj", "embed_q", "unembed_out", "o_proj", "rope")


def prefer_absorbed(n_queries: int, n_keys: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                    qk_rope_head_dim: int, v_head_dim: int) -> bool:
    """True when absorbed attention needs fewer multiply-adds than materialising K/V for this call.

    Per head (the head count cancels), with L queries, S keys, R = kv_lora_rank:
    absorbed = L·dn·R (absorb q) + L·S·(2R + dr) (scores, weighted latent sum) + L·R·dv (unembed);
    materialised = S·R·(dn + dv) (expand K/V) + L·S·(dn + dr + dv) (attention).
    Decode (L=1) after more than one key always absorbs; a cold prefill (S = L) never does; a
    multi-token step after a long cache absorbs while L is below about R·(dn+dv) / (2R − dn − dv) queries
    (≈170 for DeepSeek-V3's R=512, dn=dv=128).
    """
    R, dn, dr, dv = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    L, S = n_queries, n_keys
    absorbed = L * dn * R + L * S * (2 * R + dr) + L * R * dv
    materialised = S * R * (dn + dv) + L * S * (dn + dr + dv)
    return absorbed < materialised


class MLAAttention(nn.Module):
    """Drop-in replacement for mlx-lm's DeepSeek V2/V3 attention, caching latents (see module doc).

    Args:
        attn: the mlx-lm attention module to take over (its submodules are reused, not copied).
        split_kv: split long latent ranges into ``split_chunk``-key chunks merged by log-sum-exp.
        split_chunk: keys per chunk when ``split_kv``.

    Attributes:
        mode: ``"auto"`` (choose per call by cost), ``"absorbed"`` or ``"materialised"`` (forced; for
            tests and benchmarks).

    A cache with a ``latent_attend(q_lat, q_pe, latent, k_pe, scale, mask, chunk)`` method (latent pages,
    :mod:`mlxkv.kv.paged.latent_pages`) runs the absorbed attention itself; one with ``absorbed_only`` set (the
    batched decode view of latent pages) always gets the absorbed path, whatever :attr:`mode` says.
    """

    #: Its layer's cache holds latents (:func:`mlxkv.kv.layouts.latent_cache.latent_layers` reads this).
    caches_latents = True

    def __init__(self, attn: nn.Module, *, split_kv: bool = False, split_chunk: int = SPLIT_CHUNK):
        super().__init__()
        if split_chunk < 1:
            raise ValueError(f"split_chunk must be >= 1, got {split_chunk}")
        for name in _SUBMODULES:
            module = getattr(attn, name, None)
            if module is not None:
                setattr(self, name, module)
        assert ("kv_b_proj" in self) != ("embed_q" in self), "expected kv_b_proj (V2) or embed_q/unembed_out (V3)"
        self.num_heads = attn.num_heads
        self.q_lora_rank = attn.q_lora_rank
        self.kv_lora_rank = attn.kv_lora_rank
        self.qk_nope_head_dim = attn.qk_nope_head_dim
        self.qk_rope_head_dim = attn.qk_rope_head_dim
        self.v_head_dim = attn.v_head_dim
        self.scale = attn.scale  # includes any YaRN mscale correction the original computed
        self.split_kv = split_kv
        self.split_chunk = split_chunk
        self.mode = "auto"
        self.source = type(attn).__name__
        self.absorbed_calls = 0  # per-path call counts (observability; tests check the cost choice)
        self.materialised_calls = 0

    # -- the per-head halves of W_kv_b --------------------------------------------------------
    def _kv_b_halves(self):
        """V2 layout: kv_b_proj rows are per head [dn key rows; dv value rows] → views, no copy."""
        H, dn, dv = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        p = self.kv_b_proj

        def split(a):
            return a[:, :dn], a[:, dn:]

        w_uk, w_uv = split(p.weight.reshape(H, dn + dv, -1))  # (H, dn, R*), (H, dv, R*)
        if "scales" not in p:
            return w_uk, w_uv, None
        scales = split(p.scales.reshape(H, dn + dv, -1))
        biases = split(p.biases.reshape(H, dn + dv, -1)) if p.get("biases") is not None else (None, None)
        quant = dict(group_size=p.group_size, bits=p.bits, mode=getattr(p, "mode", "affine"))
        return (w_uk, scales[0], biases[0]), (w_uv, scales[1], biases[1]), quant

    def _absorb_q(self, q_nope: mx.array) -> mx.array:
        """``(B, H, L, dn)`` → ``(B, H, L, R)``: q_nope · W_uk per head."""
        if "embed_q" in self:
            return self.embed_q(q_nope)
        w_uk, _, quant = self._kv_b_halves()
        if quant is None:
            return q_nope @ w_uk  # (B, H, L, dn) @ (H, dn, R)
        w, s, b = w_uk
        return mx.quantized_matmul(q_nope, w, s, b, transpose=False, **quant)

    def _unembed(self, o_lat: mx.array) -> mx.array:
        """``(B, H, L, R)`` → ``(B, H, L, dv)``: apply W_uv after the weighted latent sum."""
        if "unembed_out" in self:
            return self.unembed_out(o_lat)
        _, w_uv, quant = self._kv_b_halves()
        if quant is None:
            return o_lat @ w_uv.swapaxes(-1, -2)  # (B, H, L, R) @ (H, R, dv)
        w, s, b = w_uv
        return mx.quantized_matmul(o_lat, w, s, b, transpose=True, **quant)

    def _expand(self, latent: mx.array) -> tuple[mx.array, mx.array]:
        """Materialise ``latent (B, 1, S, R)`` → ``k_nope (B, H, S, dn)``, ``values (B, H, S, dv)``."""
        if "embed_q" in self:
            return self.embed_q(latent, transpose=False), self.unembed_out(latent)
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0])  # (B, S, H·(dn+dv))
        kv = kv.reshape(B, S, self.num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, S, dn+dv)
        k_nope, values = mx.split(kv, [self.qk_nope_head_dim], axis=-1)
        return k_nope, values

    # -- forward ------------------------------------------------------------------------------
    def use_absorbed(self, n_queries: int, n_keys: int) -> bool:
        """The path this module takes for a call with these sizes (honours a forced :attr:`mode`)."""
        if self.mode != "auto":
            return self.mode == "absorbed"
        return prefer_absorbed(n_queries, n_keys, kv_lora_rank=self.kv_lora_rank,
                               qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                               v_head_dim=self.v_head_dim)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        H, dn, dr, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # (B, L, H·(dn+dr))
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, L, H·(dn+dr))
        q = q.reshape(B, L, H, dn + dr).transpose(0, 2, 1, 3)  # (B, H, L, dn+dr)
        q_nope, q_pe = mx.split(q, [dn], axis=-1)  # (B, H, L, dn), (B, H, L, dr)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [R], axis=-1)  # (B, L, R), (B, L, dr)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), 1)  # (B, 1, L, R)
        k_pe = k_pe.reshape(B, L, 1, dr).transpose(0, 2, 1, 3)  # (B, 1, L, dr)

        offset = cache.offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)  # (B, 1, S, R), (B, 1, S, dr)
        S = latent.shape[2]

        if getattr(cache, "absorbed_only", False) or self.use_absorbed(L, S):
            self.absorbed_calls += 1
            chunk = self.split_chunk if self.split_kv else None
            # paged latent caches attend over their pages themselves (batched decode: one call for B sequences)
            attend = getattr(cache, "latent_attend", latent_attention)
            o_lat = attend(self._absorb_q(q_nope), q_pe, latent, k_pe, self.scale, mask, chunk)
            out = self._unembed(o_lat)  # (B, H, L, dv)
        else:
            self.materialised_calls += 1
            k_nope, values = self._expand(latent)  # (B, H, S, dn), (B, H, S, dv)
            keys = mx.concatenate([k_nope, mx.broadcast_to(k_pe, (B, H, S, dr))], axis=-1)  # (B, H, S, dn+dr)
            queries = mx.concatenate([q_nope, q_pe], axis=-1)  # (B, H, L, dn+dr)
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, H * self.v_head_dim)  # (B, L, H·dv)
        return self.o_proj(out)
