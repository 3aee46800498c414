"""Attention mass per cached position from paged decode attention: the reference twin of ``paged_mass.metal``.

The heavy-hitter KV-overflow policies rank cached positions by the attention mass they received: for each
sequence, kv head and position, the softmax probability summed over the query heads of that kv head's group
(the decode step has one query per sequence). Decode attention computes those probabilities anyway, so the mass is
gathered from its own scores instead of a second score pass (:mod:`mlxkv.kv.overflow.mass`):

- the single-pass reference sums its softmax over each group (:func:`place_by_position` puts it at its logical
  positions);
- split-K (the reference's ``partials`` and the Metal mass variant) keeps each visible token's logit per query
  head, ``(B, H, P)`` with ``P = max_blocks_per_seq * block_size``; a split's probabilities ``exp(score - lse_s)``
  need the final rescale ``exp(lse_s - LSE)`` by the merged log-sum-exp ``LSE`` (splits and sink), known only
  after every split: :func:`mass_from_scores` exponentiates each logit once against ``LSE``.

Output: float32 ``(B, kv_heads, P)`` indexed by logical position in the sequence's block table; positions outside
the visible range ``[start, context_len)`` (past the context, before a window or chunk) hold 0.
"""

from __future__ import annotations

import mlx.core as mx

from .geometry import visible_start

# atol = rtol for mass vs reference (kernel, self-check) and for reference vs the second-pass mass. Scores are
# float32 in every implementation whatever the K/V dtype and the sums differ in order only. Measured on unit-normal
# inputs: reference vs the second pass of mlxkv/kv/overflow/mass.py at most 1.2e-7 (contexts up to 4000, 1-4
# splits, sinks / window / chunk); the emulated Metal variant vs the reference at most 5e-7
# (tests/test_kernels_mass.py).
MASS_TOLERANCE = 1e-5


def visible_positions(context_lens: mx.array, P: int, window: int | None, chunk_size: int | None) -> mx.array:
    """``(B, P)`` bool: position ``t`` is in ``[start, context_len)`` (``context_len`` clamped to ``P``, as the kernel
    clamps)."""
    lens = mx.clip(context_lens, 0, P)  # (B,)
    start = visible_start(lens, window, chunk_size)  # (B,)
    t = mx.arange(P, dtype=mx.int32)[None]  # (1, P)
    return (t >= start[:, None]) & (t < lens[:, None])  # (B, P)


def place_by_position(values: mx.array, pos: mx.array, valid: mx.array, P: int, fill: float) -> mx.array:
    """Per-position ``values`` ``(..., B, n)`` at positions ``pos`` ``(B, n)`` of a ``(..., B, P)`` array of
    ``fill``; entries with ``valid`` false (or ``pos`` outside ``[0, P)``) are dropped."""
    keep = valid & (pos >= 0) & (pos < P)  # (B, n)
    index = mx.broadcast_to(mx.where(keep, pos, P), values.shape)  # dropped entries land in column P
    out = mx.full((*values.shape[:-1], P + 1), fill, dtype=values.dtype)  # (..., B, P + 1)
    return mx.put_along_axis(out, index, values, axis=-1)[..., :P]  # (..., B, P)


def mass_from_scores(
    scores: mx.array,
    lse: mx.array,
    sinks: mx.array | None,
    context_lens: mx.array,
    kv_heads: int,
    *,
    window: int | None,
    chunk_size: int | None,
) -> mx.array:
    """Attention mass ``(B, kv_heads, P)`` float32 from per-head logits and the splits' log-sum-exps.

    Args:
        scores: ``(B, H, P)`` float32 scaled logits; read only at visible positions.
        lse: ``(B, H, S)`` per-split log-sum-exps (``-inf`` for a split that saw nothing).
        sinks: ``(H,)`` sink logits or None (they take probability, and no position gets theirs).
        context_lens: int32 ``(B,)``; ``window`` / ``chunk_size`` as in decode attention.
    """
    B, H, P = scores.shape
    top = lse.max(axis=-1)  # (B, H)
    if sinks is not None:
        top = mx.maximum(top, sinks.astype(mx.float32)[None, :])
    top = mx.where(top == -mx.inf, 0.0, top)
    denom = mx.exp(lse - top[..., None]).sum(axis=-1)  # (B, H)
    if sinks is not None:
        denom = denom + mx.exp(sinks.astype(mx.float32)[None, :] - top)
    visible = visible_positions(context_lens, P, window, chunk_size)[:, None, :]  # (B, 1, P)
    safe = mx.where(visible, scores, -mx.inf)  # (B, H, P): unwritten kernel entries never reach exp
    probs = mx.exp(safe - top[..., None]) / mx.where(denom == 0, 1.0, denom)[..., None]  # (B, H, P)
    probs = mx.where(visible & (denom != 0)[..., None], probs, 0.0)
    return probs.reshape(B, kv_heads, H // kv_heads, P).sum(axis=2)  # (B, KVH, P)
