"""Pure-MLX paged decode attention: the reference twin of ``metal_kernels/paged_attention.metal``.

Both compute, per (sequence, kv head, split), an online-softmax state over the split's visible
tokens (running max ``m``, running sum ``l``, float32 accumulator ``acc``), emit the normalised
partial output and its log-sum-exp, and then merge the splits (and the optional sink logits) by
log-sum-exp. The kernel walks one token per simdgroup step; the reference walks one *step of
pages* at a time, gathering them with ``mx.take`` into a head-major layout so that each step is two
matmuls over all kv heads at once. Sliding and chunked layers visit only their in-window pages.

Cost on CPU: per step, one gather of the step's K and V rows (a copy) plus the two matmuls that
dense SDPA also does, so the reference stays within a small constant of dense SDPA at any context.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv import env

from .layout import (
    SplitPlan,
    check_paged_inputs,
    default_scale,
    host_max_context_len,
    plan_splits,
    visible_start,
)

# Elements (tokens x batch x kv_heads x head_dim) gathered per step: bounds temporary memory
# (~16 MB of float32 per K or V step) without a Python iteration per page.
STEP_ELEMENTS = 1 << 22


class ReferencePagedAttention:
    """Pure-MLX implementation of the paged-attention kernel interface (``partials`` + ``merge``)."""

    name = "reference"
    # CPU (and any non-Metal backend): split-K buys no parallelism there, only more ops per layer, so the
    # reference runs one split unless the caller or MLXKV_PAGED_DECODE_SPLITS asks for more (measured: 4K
    # context, batch 1, tiny llama: 0.58x -> 0.81x of dense decode).
    default_num_splits = 1

    def partials(
        self,
        queries: mx.array,
        k_pages: mx.array,
        v_pages: mx.array,
        block_tables: mx.array,
        context_lens: mx.array,
        plan: SplitPlan,
        *,
        scale: float,
        window: int | None,
        chunk_size: int | None,
    ) -> tuple[mx.array, mx.array]:
        """Per-split normalised outputs ``(B, H, S, D)`` float32 and log-sum-exps ``(B, H, S)``.

        A split that sees no token (a short sequence in a long batch) has ``lse = -inf`` and a zero
        output, so it drops out of the merge.
        """
        B, H, _, D = queries.shape
        _, bs, KVH, _ = k_pages.shape
        G = H // KVH
        max_blocks = block_tables.shape[1]
        k_rows = k_pages.reshape(-1, D)  # (num_blocks * bs * KVH, D): one row per (slot, kv head)
        v_rows = v_pages.reshape(-1, D)
        q = queries.reshape(B, KVH, G, D).transpose(1, 0, 2, 3).astype(mx.float32) * scale  # (KVH, B, G, D)

        starts = visible_start(context_lens, window, chunk_size)  # (B,)
        first_page = starts // bs  # (B,)
        in_page = mx.arange(bs, dtype=mx.int32)  # (bs,)
        heads = mx.arange(KVH, dtype=mx.int32)[:, None, None]  # (KVH, 1, 1)
        step_pages = max(1, STEP_ELEMENTS // (bs * B * KVH * D))

        outs, lses = [], []
        for s in range(plan.num_splits):
            lo = s * plan.pages_per_split
            hi = min(lo + plan.pages_per_split, plan.visible_pages)
            m = mx.full((KVH, B, G), -mx.inf, dtype=mx.float32)  # running max
            l = mx.zeros((KVH, B, G), dtype=mx.float32)  # running sum of exp
            acc = mx.zeros((KVH, B, G, D), dtype=mx.float32)  # running sum of p * v
            for p0 in range(lo, hi, step_pages):
                n = min(step_pages, hi - p0)
                page = first_page[:, None] + mx.arange(p0, p0 + n, dtype=mx.int32)  # (B, n)
                blocks = mx.take_along_axis(block_tables, mx.minimum(page, max_blocks - 1), axis=1)  # (B, n)
                slots = (blocks[..., None] * bs + in_page).reshape(B, n * bs)  # (B, n*bs)
                pos = (page[..., None] * bs + in_page).reshape(B, n * bs)  # (B, n*bs)
                valid = (pos >= starts[:, None]) & (pos < context_lens[:, None])  # (B, n*bs)
                rows = slots[None] * KVH + heads  # (KVH, B, n*bs)
                k = mx.take(k_rows, rows, axis=0).astype(mx.float32)  # (KVH, B, n*bs, D)
                v = mx.take(v_rows, rows, axis=0).astype(mx.float32)  # (KVH, B, n*bs, D)
                scores = q @ k.swapaxes(-1, -2)  # (KVH, B, G, n*bs)
                scores = mx.where(valid[None, :, None, :], scores, -mx.inf)
                m_new = mx.maximum(m, scores.max(axis=-1))  # (KVH, B, G)
                m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # no (-inf) - (-inf)
                corr = mx.exp(m - m_safe)  # 0 while nothing was seen
                p = mx.exp(scores - m_safe[..., None])  # (KVH, B, G, n*bs)
                l = l * corr + p.sum(axis=-1)
                acc = acc * corr[..., None] + p @ v  # (KVH, B, G, D)
                m = m_new
            empty = l == 0  # saw no token; a NaN from the inputs still propagates
            outs.append(mx.where(empty[..., None], 0.0, acc / mx.where(empty, 1.0, l)[..., None]))
            lses.append(mx.where(empty, -mx.inf, m + mx.log(mx.where(empty, 1.0, l))))
        o_part = mx.stack(outs, axis=3)  # (KVH, B, G, S, D)
        lse = mx.stack(lses, axis=3)  # (KVH, B, G, S)
        o_part = o_part.transpose(1, 0, 2, 3, 4).reshape(B, H, plan.num_splits, D)  # (B, H, S, D)
        lse = lse.transpose(1, 0, 2, 3).reshape(B, H, plan.num_splits)  # (B, H, S)
        return o_part, lse

    def merge(
        self, o_part: mx.array, lse: mx.array, sinks: mx.array | None, dtype: mx.Dtype
    ) -> mx.array:
        """Log-sum-exp merge of split partials (and sink logits) into ``(B, H, 1, D)`` of ``dtype``."""
        return merge_partials(o_part, lse, sinks, dtype)


def merge_partials(
    o_part: mx.array, lse: mx.array, sinks: mx.array | None, dtype: mx.Dtype
) -> mx.array:
    """Combine normalised partials ``(B, H, S, D)`` with their log-sum-exps ``(B, H, S)``.

    A sink contributes ``exp(sink)`` to the softmax denominator and nothing to the numerator, like
    the ``sinks`` argument of ``mx.fast.scaled_dot_product_attention``.
    """
    B, H, S, D = o_part.shape
    top = lse.max(axis=-1)  # (B, H)
    if sinks is not None:
        top = mx.maximum(top, sinks.astype(mx.float32)[None, :])
    top = mx.where(top == -mx.inf, 0.0, top)
    w = mx.exp(lse - top[..., None])  # (B, H, S); exp(-inf) = 0 for empty splits
    denom = w.sum(axis=-1)  # (B, H)
    if sinks is not None:
        denom = denom + mx.exp(sinks.astype(mx.float32)[None, :] - top)
    num = (w[..., None] * o_part).sum(axis=2)  # (B, H, D)
    empty = denom == 0
    out = mx.where(empty[..., None], 0.0, num / mx.where(empty, 1.0, denom)[..., None])
    return out[:, :, None, :].astype(dtype)  # (B, H, 1, D)


def run_paged_attention(
    impl,
    queries: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: mx.array | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> mx.array:
    """Validate, plan the splits, and run ``impl.partials`` then ``impl.merge``.

    ``impl`` is any object with the ``partials``/``merge`` interface of
    :class:`ReferencePagedAttention` (the Metal kernel pair has it too).
    """
    check_paged_inputs(queries, k_pages, v_pages, block_tables, context_lens, window, chunk_size, sinks)
    D, bs = queries.shape[-1], k_pages.shape[1]
    if num_splits is None and env.paged_decode_splits() is None:
        num_splits = getattr(impl, "default_num_splits", None)  # None: split by context length
    plan = plan_splits(
        host_max_context_len(context_lens, max_context_len),
        bs,
        window=window,
        chunk_size=chunk_size,
        num_splits=num_splits,
        max_blocks_per_seq=block_tables.shape[1],
    )
    scale = default_scale(D) if scale is None else float(scale)
    o_part, lse = impl.partials(
        queries, k_pages, v_pages, block_tables, context_lens, plan,
        scale=scale, window=window, chunk_size=chunk_size,
    )
    return impl.merge(o_part, lse, sinks, queries.dtype)


REFERENCE = ReferencePagedAttention()


def paged_attention_reference(
    queries: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: mx.array | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> mx.array:
    """Decode attention of one query token per sequence over paged K/V, in pure MLX.

    Args:
        queries: ``[B, n_heads, 1, head_dim]``.
        k_pages, v_pages: ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_tables: int32 ``[B, max_blocks_per_seq]``; padding entries point at block 0.
        context_lens: int32 ``[B]``, tokens visible to each sequence including the current one.
        scale: score scale, default ``1/sqrt(head_dim)``.
        window: sliding window W (attend to the last W positions), or None.
        chunk_size: chunked attention (attend from the start of the current chunk), or None.
        sinks: per-head sink logits ``[n_heads]``, or None.
        num_splits: split-K count; default by context length (``MLXKV_PAGED_DECODE_SPLITS``).
        max_context_len: host-side bound on ``context_lens`` (avoids a device sync), or None.

    Returns:
        ``[B, n_heads, 1, head_dim]`` in the query dtype.

    Raises:
        ValueError: inputs that do not follow the layout in :mod:`mlxkv.kernels`.
    """
    return run_paged_attention(
        REFERENCE, queries, k_pages, v_pages, block_tables, context_lens,
        scale=scale, window=window, chunk_size=chunk_size, sinks=sinks,
        num_splits=num_splits, max_context_len=max_context_len,
    )
