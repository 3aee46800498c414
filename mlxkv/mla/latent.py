"""Attention over a latent cache (the absorbed MLA core), whole or split into chunks with an LSE merge.

Queries arrive already absorbed into latent space (``q_nope · W_uk``). Every head reads the same latent
rows, so heads are folded into the query-row axis: one GEMM of ``(H·L, R) × (R, S)`` per chunk instead
of ``H`` matrix-vector products that would each re-read the cache.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask


def causal_mask(mask, n_queries: int, n_keys: int):
    """An mlx-lm mask argument as an array (``"causal"`` → boolean ``(L, S)``); ``None`` and arrays pass through."""
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}; valid: None, 'causal' or an array")
        return create_causal_mask(n_queries, n_keys - n_queries)
    return mask


def _scores(q_lat, q_pe, latent, k_pe, mask, start: int, stop: int, H: int, L: int):
    """Masked float32 scores ``(B, H, L, stop-start)`` for keys ``[start, stop)``; queries come pre-scaled."""
    B = q_lat.shape[0]
    lat = latent[..., start:stop, :]  # (B, 1, c, R)
    pe = k_pe[..., start:stop, :]  # (B, 1, c, dr)
    s = q_lat @ lat.swapaxes(-1, -2) + q_pe @ pe.swapaxes(-1, -2)  # (B, 1, H·L, c)
    s = s.reshape(B, H, L, stop - start).astype(mx.float32)  # (B, H, L, c)
    floor = mx.array(mx.finfo(mx.float32).min, mx.float32)
    if mask is None:
        return s
    m = mask[..., start:stop]
    if m.dtype == mx.bool_:
        return mx.where(m, s, floor)
    # additive mask: clamp so a fully masked chunk stays finite (its LSE weight is then exactly 0)
    return mx.maximum(s + m.astype(mx.float32), floor)


def latent_attention(q_lat: mx.array, q_pe: mx.array, latent: mx.array, k_pe: mx.array, scale: float,
                     mask=None, chunk: int | None = None) -> mx.array:
    """softmax(scale · (q_lat·latentᵀ + q_pe·k_peᵀ) + mask) · latent, per head.

    Args:
        q_lat: absorbed queries ``(B, H, L, R)``.
        q_pe: rotated rope queries ``(B, H, L, dr)``.
        latent: cached latents ``(B, 1, S, R)``.
        k_pe: cached rotated rope keys ``(B, 1, S, dr)``.
        scale: softmax scale.
        mask: ``None``, ``"causal"``, or a boolean / additive array broadcastable to ``(B, H, L, S)``.
        chunk: split the S keys into chunks of this many and merge partial results by log-sum-exp
            (split-KV); ``None`` or ``chunk >= S`` computes in one pass.

    Returns:
        The attention output in latent space, ``(B, H, L, R)``, in ``q_lat``'s dtype.
    """
    B, H, L, R = q_lat.shape
    S = latent.shape[2]
    dtype = q_lat.dtype
    assert latent.shape[-1] == R and k_pe.shape[2] == S, f"latent {latent.shape} / k_pe {k_pe.shape} mismatch"
    if chunk is not None and chunk < 1:
        raise ValueError(f"split chunk must be >= 1 token, got {chunk}")
    mask = causal_mask(mask, L, S)
    ql = (q_lat * scale).reshape(B, 1, H * L, R)  # (B, 1, H·L, R): heads folded into rows
    qp = (q_pe * scale).reshape(B, 1, H * L, q_pe.shape[-1])  # (B, 1, H·L, dr)

    if chunk is None or chunk >= S:
        p = mx.softmax(_scores(ql, qp, latent, k_pe, mask, 0, S, H, L), axis=-1)  # (B, H, L, S)
        out = p.astype(dtype).reshape(B, 1, H * L, S) @ latent  # (B, 1, H·L, R)
        return out.reshape(B, H, L, R)

    outs, lses = [], []
    for start in range(0, S, chunk):
        stop = min(start + chunk, S)
        s = _scores(ql, qp, latent, k_pe, mask, start, stop, H, L)  # (B, H, L, c)
        m = s.max(axis=-1, keepdims=True)  # (B, H, L, 1)
        p = mx.exp(s - m)  # (B, H, L, c)
        total = p.sum(axis=-1, keepdims=True)  # (B, H, L, 1)
        o = p.astype(dtype).reshape(B, 1, H * L, stop - start) @ latent[..., start:stop, :]  # (B, 1, H·L, R)
        outs.append(o.reshape(B, H, L, R).astype(mx.float32) / total)  # this chunk's normalised output
        lses.append(m + mx.log(total))  # (B, H, L, 1): this chunk's log-sum-exp
    weights = mx.softmax(mx.stack(lses), axis=0)  # (n_chunks, B, H, L, 1) = exp(lse_c - lse)
    return (weights * mx.stack(outs)).sum(axis=0).astype(dtype)  # (B, H, L, R)
