"""Batched decode over *quantized* pages with shared prefixes attended once (pure MLX, ``mx.quantized_matmul``).

The quantized twin of :func:`mlxkv.kernels.page_views_ref.shared_prefix_attention`: the sequences of a
:class:`~mlxkv.kernels.cascade.PrefixGroup` attend to their shared pages in one quantized matmul per kv head, all
their queries stacked as rows, reading the page planes in place run by run (zero-copy slices of the stored rows)
when they lie in a few runs of consecutive pages; each sequence's own pages after the shared ones are gathered (the
planes of those pages only). The partial softmax states (base 2, as there) are merged exactly, so the result is
flat attention over every visible row up to float rounding. Every row visible, no sinks, no window or chunk.

Planes are mlx-lm's ``(packed uint32, scales, biases)``; the stored rows of each are ``(1, KVH, NB * bs, w)``
(:mod:`mlxkv.kv.paged.quantized_pages`).
"""

from __future__ import annotations

import mlx.core as mx

from .cascade import PrefixGroup
from .geometry import page_runs
from .page_views_ref import LOG2E, MAX_SHARED_RUNS, _exp2, _merge, _row_sums, own_pages

Planes = tuple  # (packed, scales, biases)


def quantized_shared_prefix_attention(
    queries: mx.array,
    k_rows: Planes,
    v_rows: Planes,
    block_tables: mx.array,
    host_tables: list[list[int]],
    host_lens: list[int],
    groups: list[PrefixGroup],
    *,
    scale: float,
    bits: int,
    group_size: int,
    block_size: int,
) -> mx.array:
    """Decode attention of B sequences over quantized pages, each group's shared pages attended once.

    Args:
        queries: ``(B, H, 1, D)``.
        k_rows, v_rows: the layer's planes as stored rows, each ``(1, KVH, NB * bs, w)``.
        block_tables: int32 ``(B, max_blocks)`` (null-padded); host_tables / host_lens: the same tables and the
            context lengths (the current token included) as Python lists.
        groups: prefix groups (each member keeps at least one suffix token); rows in no group attend to all their
            pages as their own.
        bits, group_size: the planes' quantization; block_size: rows per page.

    Returns:
        ``(B, H, 1, D)`` in the query dtype.
    """
    B, H, _, D = queries.shape
    KVH = k_rows[0].shape[1]
    G = H // KVH
    bs = block_size
    dtype = k_rows[1].dtype  # the scales' dtype: what quantized_matmul multiplies in
    q = (queries.reshape(B, KVH, G, D).astype(mx.float32) * (scale * LOG2E)).astype(dtype)  # (B, KVH, G, D)

    def qmm(x: mx.array, planes: Planes, transpose: bool) -> mx.array:
        return mx.quantized_matmul(x, *planes, transpose=transpose, group_size=group_size, bits=bits)

    # Own pages: their planes gathered.
    page = own_pages(host_lens, groups, bs)  # (B, n)
    n = page.shape[1]
    ids = mx.take_along_axis(block_tables, mx.minimum(page, block_tables.shape[1] - 1), axis=1)  # (B, n)
    k_own, v_own = (tuple(_gather_pages(p, ids, bs) for p in planes) for planes in (k_rows, v_rows))
    pos = (page[..., None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(B, 1, 1, n * bs)  # (B, 1, 1, n * bs)
    valid = pos < mx.array(host_lens, dtype=mx.int32).reshape(B, 1, 1, 1)  # >= 1 true per row
    scores = mx.where(valid, qmm(q, k_own, True).astype(mx.float32), -mx.inf)  # (B, KVH, G, n * bs)
    m, l, o = _quantized_state(scores, v_own, qmm, dtype)  # (B, KVH, G, .)

    for group in groups:
        rows = list(group.rows)
        idx = mx.array(rows, dtype=mx.int32)
        qg = q[idx].transpose(1, 0, 2, 3).reshape(1, KVH, len(rows) * G, D)  # (1, KVH, n * G, D)
        shared = None
        for kp, vp in _shared_planes(k_rows, v_rows, host_tables[rows[0]][: group.shared_pages], bs):
            part = _quantized_state(qmm(qg, kp, True).astype(mx.float32), vp, qmm, dtype)  # (1, KVH, n * G, .)
            shared = part if shared is None else _merge(*shared, *part)
        mg, lg, og = (x.reshape(KVH, len(rows), G, -1).transpose(1, 0, 2, 3) for x in shared)  # (n, KVH, G, .)
        merged = _merge(m[idx], l[idx], o[idx], mg, lg, og)
        for full, part in zip((m, l, o), merged, strict=True):
            full[idx] = part
    out = o / l  # (B, KVH, G, D)
    return out.reshape(B, H, 1, D).astype(queries.dtype)


def _quantized_state(scores: mx.array, v: Planes, qmm, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """:func:`~mlxkv.kernels.page_views_ref._softmax_state` with the values quantized: ``(m, l, o)``."""
    m = scores.max(axis=-1, keepdims=True)  # finite: every row sees at least one key
    e = _exp2(scores - m)
    return m, _row_sums(e), qmm(e.astype(dtype), v, False).astype(mx.float32)


def _gather_pages(rows: mx.array, ids: mx.array, bs: int) -> mx.array:
    """Pages ``ids`` ``(B, n)`` of one plane stored as rows ``(1, KVH, NB * bs, w)``: ``(B, KVH, n * bs, w)``."""
    _, KVH, total, w = rows.shape
    pages = rows.reshape(KVH, total // bs, bs, w)  # (KVH, NB, bs, w)
    g = mx.take(pages, ids, axis=1)  # (KVH, B, n, bs, w)
    return g.reshape(KVH, ids.shape[0], -1, w).transpose(1, 0, 2, 3)  # (B, KVH, n * bs, w)


def _shared_planes(k_rows: Planes, v_rows: Planes, ids: list[int], bs: int) -> list[tuple[Planes, Planes]]:
    """The shared pages' planes, ``(1, KVH, P, w)`` each, in position order: a view per run of consecutive pages
    when they lie in at most ``MAX_SHARED_RUNS`` runs, else one gather."""
    runs = page_runs(ids, MAX_SHARED_RUNS)
    if runs is not None and all(first != 0 for first, _ in runs):
        return [tuple(tuple(p[:, :, first * bs:(first + n) * bs] for p in planes) for planes in (k_rows, v_rows))
                for first, n in runs]
    idx = mx.array([ids], dtype=mx.int32)  # (1, P)
    return [tuple(tuple(_gather_pages(p, idx, bs) for p in planes) for planes in (k_rows, v_rows))]
