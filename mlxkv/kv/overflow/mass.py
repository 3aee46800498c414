"""Attention mass per cached row: what the heavy-hitter policies rank rows by.

The overflow layout runs attention itself (``mx.fast.scaled_dot_product_attention``, so its output is the plain
cache's bit for bit) and, only when a policy needs statistics, computes the same scores once more here and
sums each key row's softmax probability over the query heads of its KV group and the new queries. Nothing here
runs for the plain, window or preempt caches.
"""

from __future__ import annotations

import mlx.core as mx


def masked_scores(queries: mx.array, keys: mx.array, scale: float, mask=None) -> mx.array:
    """Attention logits of ``queries`` over ``keys`` with the mask applied (masked logits at the dtype minimum).

    Args:
        queries: ``(B, n_q, L, D)``.
        keys: ``(B, n_kv, K, D)``.
        mask: ``None``, ``"causal"`` (aligned to the last key) or a boolean / additive array broadcastable to
            ``(B, n_q, L, K)``.

    Returns:
        ``(B, n_kv, rep, L, K)`` float32 logits, ``rep = n_q // n_kv`` (the query heads sharing one KV head).
    """
    B, n_q, L, D = queries.shape
    n_kv, K = keys.shape[1], keys.shape[2]
    rep = n_q // n_kv
    # one (rep * L, D) x (D, K) product per KV head: a broadcast over rep runs several times slower on CPU BLAS
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, rep * L, D)  # (B, n_kv, rep * L, D)
    scores = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, n_kv, rep, L, K)  # (B, n_kv, rep, L, K)
    if isinstance(mask, str):
        assert mask == "causal", f"unknown mask kind {mask!r}"
        mask = mx.arange(K - L, K)[:, None] >= mx.arange(K)[None]  # (L, K)
    if mask is None:
        return scores
    if mask.ndim == 4:  # (B|1, n_q|1, L, K) -> (B|1, n_kv|1, rep|1, L, K)
        mask = mask.reshape(mask.shape[0], n_kv, rep, L, -1) if mask.shape[1] == n_q else mx.expand_dims(mask, 2)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(mx.float32).min)
    return scores + mask.astype(mx.float32)


def with_sinks(scores: mx.array, sinks: mx.array | None) -> mx.array:
    """``scores`` with the per-head sink logit as an extra first column (it takes mass, emits nothing)."""
    if sinks is None:
        return scores
    B, n_kv, rep, L, _ = scores.shape
    sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, n_kv, rep, 1, 1), (B, n_kv, rep, L, 1))
    return mx.concatenate([sink, scores], axis=-1)  # (B, n_kv, rep, L, 1 + K)


def attention_mass(scores: mx.array, sinks: mx.array | None = None) -> mx.array:
    """Softmax probability each key received, summed over batch, query heads of its group and queries.

    Args:
        scores: ``(B, n_kv, rep, L, K)`` from :func:`masked_scores`.
        sinks: optional per-query-head sink logits ``(n_q,)`` (their column is dropped after the softmax).

    Returns:
        ``(n_kv, K)`` float32.
    """
    probs = mx.softmax(with_sinks(scores, sinks), axis=-1, precise=True)  # (B, n_kv, rep, L, [1 +] K)
    if sinks is not None:
        probs = probs[..., 1:]
    return probs.sum(axis=(0, 2, 3))  # (n_kv, K)


def decode_mass(queries: mx.array, keys: mx.array, scale: float, mask=None, sinks: mx.array | None = None) -> mx.array:
    """Attention mass each of ``keys``' rows receives from ``queries``: the one place the paged overflow policies
    get their statistics, so a kernel that returns the mass alongside the attention output can replace the second
    score pass here.

    Args:
        queries: ``(B, n_q, L, D)``; keys: ``(B, n_kv, K, D)``; mask: as :func:`masked_scores`; sinks: ``(n_q,)``.

    Returns:
        ``(n_kv, K)`` float32, summed over the batch, the query heads of each KV group and the queries.
    """
    return attention_mass(masked_scores(queries, keys, scale, mask), sinks)
