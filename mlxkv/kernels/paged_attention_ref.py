"""Pure-MLX paged decode attention: the reference twin of ``metal_kernels/paged_attention.metal``.

Both compute, per (sequence, kv head, split), an online-softmax state over the split's visible
tokens (running max ``m``, running sum ``l``, float32 accumulator ``acc``), emit the normalised
partial output and its log-sum-exp, and then merge the splits (and the optional sink logits) by
log-sum-exp. The kernel walks a few tokens per simdgroup step; the reference walks one *step of
pages* at a time, gathering them with ``mx.take`` into a head-major layout so that each step is two
matmuls over all kv heads at once. Sliding and chunked layers visit only their in-window pages.

The gather takes whole ``(block_size, head_dim)`` runs: the pages are head-outermost
(``[kv_heads, num_blocks, block_size, head_dim]``), so run ``head * num_blocks + block`` of the pages
seen as ``(kv_heads * num_blocks, block_size * head_dim)`` is one kv head's rows of one page, and
gathering runs ``(KVH, B, n)`` yields ``(KVH, B, n * block_size, head_dim)`` directly, with no
transpose copy. Cost on CPU: per step, that one gather of K and of V (a copy) plus the two matmuls
dense SDPA also does, so the reference stays within a small constant of dense SDPA at any context.
With one split and no sinks (the CPU default), :meth:`ReferencePagedAttention.single_pass` skips the
online-softmax bookkeeping and the merge: one gather, then exactly dense SDPA's matmul, softmax and
matmul over the gathered rows.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv import env

from .geometry import (
    SplitPlan,
    check_paged_inputs,
    default_scale,
    host_max_context_len,
    plan_splits,
    visible_start,
)
from .paged_mass_ref import mass_from_scores, place_by_position

# Elements (tokens x batch x kv_heads x head_dim) gathered per step: bounds temporary memory
# (~16 MB of float32 per K or V step) without a Python iteration per page.
STEP_ELEMENTS = 1 << 22
# Elements gathered at once by ``single_pass`` (~64 MB of float32 per K or V); larger steps use ``partials``.
SINGLE_PASS_ELEMENTS = 1 << 24


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
        scores: bool = False,
    ) -> tuple[mx.array, ...]:
        """Per-split normalised outputs ``(B, H, S, D)`` float32 and log-sum-exps ``(B, H, S)``; with ``scores``
        also the scaled logits ``(B, H, max_blocks * block_size)`` float32 at logical positions (``-inf`` where
        not visible), for :meth:`mass`.

        A split that sees no token (a short sequence in a long batch) has ``lse = -inf`` and a zero
        output, so it drops out of the merge.
        """
        B, H, _, D = queries.shape
        KVH, _, bs, _ = k_pages.shape
        G = H // KVH
        q = queries.reshape(B, KVH, G, D).transpose(1, 0, 2, 3).astype(mx.float32) * scale  # (KVH, B, G, D)

        starts = visible_start(context_lens, window, chunk_size)  # (B,)
        first_page = starts // bs  # (B,)
        in_page = mx.arange(bs, dtype=mx.int32)  # (bs,)
        step_pages = max(1, STEP_ELEMENTS // (bs * B * KVH * D))

        P = block_tables.shape[1] * bs
        scores_out = scores  # the name is reused per step below
        outs, lses, kept = [], [], []
        for s in range(plan.num_splits):
            lo = s * plan.pages_per_split
            hi = min(lo + plan.pages_per_split, plan.visible_pages)
            m = mx.full((KVH, B, G), -mx.inf, dtype=mx.float32)  # running max
            l = mx.zeros((KVH, B, G), dtype=mx.float32)  # running sum of exp
            acc = mx.zeros((KVH, B, G, D), dtype=mx.float32)  # running sum of p * v
            for p0 in range(lo, hi, step_pages):
                n = min(step_pages, hi - p0)
                page = first_page[:, None] + mx.arange(p0, p0 + n, dtype=mx.int32)  # (B, n)
                pos = (page[..., None] * bs + in_page).reshape(B, n * bs)  # (B, n*bs)
                valid = (pos >= starts[:, None]) & (pos < context_lens[:, None])  # (B, n*bs)
                k, v = gather_head_major(k_pages, v_pages, block_tables, page)  # (KVH, B, n*bs, D) each
                scores = q @ k.swapaxes(-1, -2)  # (KVH, B, G, n*bs)
                scores = mx.where(valid[None, :, None, :], scores, -mx.inf)
                if scores_out:
                    kept.append((scores, pos[:, None], valid[:, None]))  # (KVH, B, G, n*bs), (B, 1, n*bs) x2
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
        if not scores_out:
            return o_part, lse
        # The steps' positions are disjoint: one placement of all of them at their logical positions.
        logits = place_by_position(mx.concatenate([k[0] for k in kept], axis=-1),
                                   mx.concatenate([k[1] for k in kept], axis=-1),
                                   mx.concatenate([k[2] for k in kept], axis=-1), P, -mx.inf)  # (KVH, B, G, P)
        return o_part, lse, logits.transpose(1, 0, 2, 3).reshape(B, H, P)  # ..., (B, H, P)

    def mass(self, scores: mx.array, lse: mx.array, sinks: mx.array | None, context_lens: mx.array, *,
             kv_heads: int, window: int | None, chunk_size: int | None) -> mx.array:
        """Attention mass ``(B, kv_heads, P)`` from :meth:`partials`' logits (:func:`mass_from_scores`)."""
        return mass_from_scores(scores, lse, sinks, context_lens, kv_heads, window=window, chunk_size=chunk_size)

    def single_pass(
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
        with_mass: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array] | None:
        """One split, no sinks: ``(B, H, 1, D)`` in the query dtype, or None when the visible rows are too
        many to gather at once (the caller then runs ``partials`` + ``merge``). ``with_mass``: ``(out, mass)``,
        the mass ``(B, kv_heads, max_blocks * block_size)`` being this softmax summed over each group.

        Gathers every visible row once into a head-major ``(KVH, B, P, D)`` block, masks the positions
        outside ``[start, context_len)`` and runs matmul, a float32 softmax and matmul — the operations
        of dense SDPA. A sequence with no visible token gets a zero output, as in ``partials``.
        """
        B, H, _, D = queries.shape
        KVH, _, bs, _ = k_pages.shape
        G = H // KVH
        n = plan.visible_pages
        P = n * bs
        if plan.num_splits != 1 or P * B * KVH * D > SINGLE_PASS_ELEMENTS:
            return None
        starts = visible_start(context_lens, window, chunk_size)  # (B,)
        page = starts[:, None] // bs + mx.arange(n, dtype=mx.int32)  # (B, n)
        pos = (page[..., None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(B, P)  # (B, P)
        valid = (pos >= starts[:, None]) & (pos < context_lens[:, None])  # (B, P)
        k, v = gather_head_major(k_pages, v_pages, block_tables, page)  # (KVH, B, P, D) each
        q = queries.reshape(B, KVH, G, D).transpose(1, 0, 2, 3).astype(mx.float32) * scale  # (KVH, B, G, D)
        scores = mx.where(valid[None, :, None, :], q @ k.swapaxes(-1, -2), -mx.inf)  # (KVH, B, G, P)
        probs = mx.softmax(scores, axis=-1, precise=True)  # (KVH, B, G, P); NaN where nothing is visible
        out = mx.where((context_lens > starts)[None, :, None, None], probs @ v, 0.0)  # (KVH, B, G, D)
        out = out.transpose(1, 0, 2, 3).reshape(B, H, 1, D).astype(queries.dtype)  # (B, H, 1, D)
        if not with_mass:
            return out
        mass = mx.where(valid[None], probs.sum(axis=2), 0.0)  # (KVH, B, P)
        mass = place_by_position(mass, pos, valid, block_tables.shape[1] * bs, 0.0)  # (KVH, B, max_blocks * bs)
        return out, mass.transpose(1, 0, 2)  # (B, KVH, max_blocks * bs)

    def merge(
        self, o_part: mx.array, lse: mx.array, sinks: mx.array | None, dtype: mx.Dtype
    ) -> mx.array:
        """Log-sum-exp merge of split partials (and sink logits) into ``(B, H, 1, D)`` of ``dtype``."""
        return merge_partials(o_part, lse, sinks, dtype)


def gather_head_major(
    k_pages: mx.array, v_pages: mx.array, block_tables: mx.array, page: mx.array
) -> tuple[mx.array, mx.array]:
    """K and V of the table pages ``page`` ``(B, n)`` (clipped to the table) as float32 ``(KVH, B, n * bs, D)``.

    One ``mx.take`` per array over whole ``(bs, D)`` runs: run ``h * NB + block`` of the pages seen as
    ``(KVH * NB, bs * D)`` holds kv head ``h``'s rows of page ``block``.
    """
    KVH, NB, bs, D = k_pages.shape
    B, n = page.shape
    blocks = mx.take_along_axis(block_tables, mx.minimum(page, block_tables.shape[1] - 1), axis=1)  # (B, n)
    runs = blocks[None] + (mx.arange(KVH, dtype=mx.int32) * NB)[:, None, None]  # (KVH, B, n)
    out = []
    for pages in (k_pages, v_pages):
        rows = mx.take(pages.reshape(KVH * NB, bs * D), runs, axis=0)  # (KVH, B, n, bs * D)
        out.append(rows.reshape(KVH, B, n * bs, D).astype(mx.float32))
    return out[0], out[1]


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
    with_mass: bool = False,
    check_inputs=check_paged_inputs,
) -> mx.array | tuple[mx.array, mx.array]:
    """Validate, plan the splits, and run ``impl.partials`` then ``impl.merge``.

    ``impl`` is any object with the ``partials``/``merge`` interface of
    :class:`ReferencePagedAttention` (the Metal kernel pair has it too). ``check_inputs`` (arguments and
    result as :func:`~mlxkv.kernels.geometry.check_paged_inputs`) validates the pages in another layout
    (quantized planes). ``with_mass``: ``(out, mass)``, the attention mass ``(B, kv_heads, max_blocks *
    block_size)`` float32 from the same scores (:mod:`mlxkv.kernels.paged_mass_ref`; ``impl.partials(...,
    scores=True)`` then ``impl.mass``).
    """
    checked = check_inputs(queries, k_pages, v_pages, block_tables, context_lens, window, chunk_size, sinks)
    bs, kv_heads = checked[3], checked[4]
    D = queries.shape[-1]
    if num_splits is None and env.flags().paged_decode_splits is None:
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
    single_pass = getattr(impl, "single_pass", None)
    if single_pass is not None and sinks is None:
        out = single_pass(
            queries, k_pages, v_pages, block_tables, context_lens, plan,
            scale=scale, window=window, chunk_size=chunk_size, **({"with_mass": True} if with_mass else {}),
        )
        if out is not None:
            return out
    parts = impl.partials(
        queries, k_pages, v_pages, block_tables, context_lens, plan,
        scale=scale, window=window, chunk_size=chunk_size, **({"scores": True} if with_mass else {}),
    )
    out = impl.merge(parts[0], parts[1], sinks, queries.dtype)
    if not with_mass:
        return out
    return out, impl.mass(parts[2], parts[1], sinks, context_lens, kv_heads=kv_heads, window=window,
                          chunk_size=chunk_size)


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
    with_mass: bool = False,
) -> mx.array | tuple[mx.array, mx.array]:
    """Decode attention of one query token per sequence over paged K/V, in pure MLX.

    Args:
        queries: ``[B, n_heads, 1, head_dim]``.
        k_pages, v_pages: ``[kv_heads, num_blocks, block_size, head_dim]``.
        block_tables: int32 ``[B, max_blocks_per_seq]``; padding entries point at block 0.
        context_lens: int32 ``[B]``, tokens visible to each sequence including the current one.
        scale: score scale, default ``1/sqrt(head_dim)``.
        window: sliding window W (attend to the last W positions), or None.
        chunk_size: chunked attention (attend from the start of the current chunk), or None.
        sinks: per-head sink logits ``[n_heads]``, or None.
        num_splits: split-K count; default by context length (``MLXKV_PAGED_DECODE_SPLITS``).
        max_context_len: host-side bound on ``context_lens`` (avoids a device sync), or None.
        with_mass: also return the attention mass (:mod:`mlxkv.kernels.paged_mass_ref`).

    Returns:
        ``[B, n_heads, 1, head_dim]`` in the query dtype; with ``with_mass``, ``(that, mass)``, mass float32
        ``[B, kv_heads, max_blocks_per_seq * block_size]`` by logical position (0 where not visible).

    Raises:
        ValueError: inputs that do not follow the layout in :mod:`mlxkv.kernels`.
    """
    return run_paged_attention(
        REFERENCE, queries, k_pages, v_pages, block_tables, context_lens,
        scale=scale, window=window, chunk_size=chunk_size, sinks=sinks,
        num_splits=num_splits, max_context_len=max_context_len, with_mass=with_mass,
    )
