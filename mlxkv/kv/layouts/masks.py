"""Attention masks from token positions.

Every layout knows the token position of each key row it returns from ``update_and_fetch``; the mask
is then one rule applied to (query position, key position) pairs, whatever order the rows are in:

    visible(q, k) = k <= q  and  (q - k < window  or  k < sinks)

Rows that hold no token get position ``EMPTY`` (never visible).
"""

from __future__ import annotations

import mlx.core as mx

EMPTY = 2**30  # position of a row with no token: greater than any query position, so never visible


def visible(q_pos: mx.array, k_pos: mx.array, window: int | None = None, sinks: int = 0) -> mx.array:
    """Boolean ``(N, K)`` mask: query ``i`` (at ``q_pos[i]``) may attend key ``j`` (at ``k_pos[j]``)."""
    q = q_pos[:, None]  # (N, 1)
    k = k_pos[None]  # (1, K)
    mask = k <= q
    if window is not None:
        near = (q - k) < window
        if sinks > 0:
            near = near | (k < sinks)
        mask = mask & near
    return mask  # (N, K)


def causal_window(N: int, offset: int, window: int | None = None) -> mx.array:
    """``(N, offset + N)`` mask for keys at positions ``0 .. offset+N-1`` (mlx-lm's causal mask)."""
    return visible(mx.arange(offset, offset + N), mx.arange(offset + N), window)


def standard_mask(N: int, offset: int, return_array: bool = False, window_size: int | None = None):
    """The mask a full-attention cache holding ``offset`` tokens gives ``N`` new queries.

    ``"causal"`` or ``None`` where no array is needed, like mlx-lm (so attention takes its fast path).
    """
    if window_size is not None:
        return causal_window(N, offset, window_size)
    if N == 1:
        return None
    if return_array:
        return causal_window(N, offset)
    return "causal"
