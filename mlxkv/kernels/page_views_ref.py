"""Attention over *views* of the pages, for the pure-MLX path: no copy of rows that sit together.

On the CPU (any backend where the paged kernel is the reference) the kernel gathers every visible row of a
sequence each step. Two common cases need no such copy:

* **Shared prefixes** (:func:`shared_prefix_attention`, batches): the sequences of a
  :class:`~mlxkv.kernels.cascade.PrefixGroup` attend to their shared pages in one matmul per kv head, all their
  queries stacked as rows (``(KVH, n * G, D) @ (KVH, D, P)``), reading the pages in place, run by run, when
  they lie in a few runs of consecutive pages (else one gather for the whole group, not one per sequence): a
  prefix cached in one piece plus a block another request cached later is two runs; each sequence's own
  pages after the shared ones are gathered as the reference gathers them.
* **A few runs of consecutive pages** (:func:`runs_attention`, one sequence: a decode step, or a prefill chunk
  over a cached prefix, causal): each run is a zero-copy slice of the stored rows; one matmul pair per run. A
  decode step over few rows takes one softmax over the runs' scores side by side instead of merged states.

The partial softmax states (max ``m``, sum ``l``, un-normalised output; scores in base 2, see :func:`_exp2`)
are merged exactly, so the answer is flat attention's up to float rounding (the cascade identity). Every given
row visible (causally), no sinks.
"""

from __future__ import annotations

import mlx.core as mx

from .cascade import PrefixGroup
from .fast_exp import exp2 as fast_exp2
from .geometry import page_runs
from .paged_attention_ref import gather_head_major

#: ``log2(e)``: scores times this are base-2 exponents (see :func:`_exp2`).
LOG2E = 1.4426950408889634
#: Shared pages in at most this many runs of consecutive pages are attended run by run, in place (more: gathered).
MAX_SHARED_RUNS = 8
#: A decode step with at most this many scores (query heads x visible rows) takes one softmax over its runs'
#: concatenated scores (:func:`_decode_one_softmax`) instead of a state per run merged: fewer operations, and below
#: this size the exponentials cost less than the per-operation overhead of the merge (measured on the CPU: 2 runs,
#: 4 heads over 128 / 433 rows 155 / 183 -> 86 / 139 us per layer; past ~8K scores the merge with the compiled
#: exponential is faster).
ONE_SOFTMAX_MAX_SCORES = 8192
#: Softmax states over at least this many scores sum their powers with a matmul against a ones column (BLAS) instead
#: of MLX's reduction: measured on the CPU, 2 kv heads x 50 rows over 4K keys 0.42-0.63 -> 0.16-0.29 ms per layer
#: (a tail of 25 tokens prefilled over a 4K cached prefix: TTFT 3-6% lower); below ~16K scores the two are even.
MATMUL_SUM_MIN_SCORES = 32768


def shared_prefix_attention(
    queries: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_tables: mx.array,
    host_tables: list[list[int]],
    host_lens: list[int],
    groups: list[PrefixGroup],
    *,
    scale: float,
) -> mx.array:
    """Decode attention of B sequences, each group's shared pages attended once.

    Args:
        queries: ``(B, H, 1, D)``; k_pages, v_pages: ``(KVH, NB, bs, D)``.
        block_tables: int32 ``(B, max_blocks)`` (null-padded); host_tables / host_lens: the same tables
            and the context lengths (the current token included) as Python lists.
        groups: from :func:`~mlxkv.kernels.cascade.find_prefix_groups` (each member keeps at least one
            suffix token); rows in no group attend to all their pages as suffix.

    Returns:
        ``(B, H, 1, D)`` in the query dtype.
    """
    B, H, _, D = queries.shape
    KVH, _, bs, _ = k_pages.shape
    G = H // KVH
    q = queries.reshape(B, KVH, G, D).transpose(1, 0, 2, 3).astype(mx.float32) * (scale * LOG2E)  # (KVH, B, G, D)
    # Own pages: gathered (the reference's whole-run gather).
    page = own_pages(host_lens, groups, bs)  # (B, n)
    n = page.shape[1]
    k, v = gather_head_major(k_pages, v_pages, block_tables, page)  # (KVH, B, n * bs, D) each
    pos = (page[..., None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(B, n * bs)  # (B, n * bs)
    valid = pos < mx.array(host_lens, dtype=mx.int32)[:, None]  # (B, n * bs); >= 1 true per row
    m, l, o = _softmax_state(mx.where(valid[None, :, None], q @ k.swapaxes(-1, -2), -mx.inf), v)  # (KVH, B, G, .)

    for group in groups:
        rows = list(group.rows)
        qg = (q if len(rows) == B else q[:, mx.array(rows, dtype=mx.int32)]).reshape(KVH, len(rows) * G, D)
        shared = None
        for kp, vp in _shared_rows(k_pages, v_pages, host_tables[rows[0]][: group.shared_pages]):  # (KVH, P, D)
            part = _softmax_state(qg @ kp.swapaxes(-1, -2), vp)  # (KVH, n * G, .)
            shared = part if shared is None else _merge(*shared, *part)
        mg, lg, og = (x.reshape(KVH, len(rows), G, -1) for x in shared)
        if len(rows) < B:  # rows outside the group: an empty state (m = -inf, l = 0, o = 0)
            idx = mx.array(rows, dtype=mx.int32)
            mg = _spread(mg, idx, m.shape, -mx.inf)
            lg, og = _spread(lg, idx, l.shape, 0.0), _spread(og, idx, o.shape, 0.0)
        m, l, o = _merge(m, l, o, mg, lg, og)
    out = o / l  # (KVH, B, G, D)
    return out.transpose(1, 0, 2, 3).reshape(B, H, 1, D).astype(queries.dtype)


def _exp2(x: mx.array) -> mx.array:
    """``2 ** x``: on MLX's CPU backend ``mx.power(2, x)`` takes ~6-10 ns per element and ``mx.exp`` ~16-26 ns
    (measured, 128K-1M float32 elements), and the softmax's exponentials dominate attention over long contexts
    there. Scores are kept in base 2 (queries scaled by ``log2(e)``): the softmax is the same function. Inputs of
    8K-384K elements take the compiled polynomial of :mod:`mlxkv.kernels.fast_exp` (2-6 ns per element)."""
    return fast_exp2(x)


def _softmax_state(scores: mx.array, v: mx.array, masked: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """Max ``(.., 1)``, sum of powers of two ``(.., 1)`` and un-normalised output ``(.., D)`` of base-2 ``scores``.

    ``masked``: some rows may be all ``-inf`` (every key masked); they get the empty state ``(-inf, 0, 0)``."""
    m = scores.max(axis=-1, keepdims=True)
    e = _exp2(scores - (mx.where(m == -mx.inf, 0, m) if masked else m))
    return m, _row_sums(e), e @ v


def _row_sums(e: mx.array) -> mx.array:
    """``e.sum(axis=-1, keepdims=True)``; from ``MATMUL_SUM_MIN_SCORES`` elements on as ``e @ ones``,
    ``(.., n) @ (n, 1)``."""
    if e.size >= MATMUL_SUM_MIN_SCORES:
        return e @ mx.ones((e.shape[-1], 1), dtype=e.dtype)
    return e.sum(axis=-1, keepdims=True)


def _merge(m1, l1, o1, m2, l2, o2) -> tuple[mx.array, mx.array, mx.array]:
    """Combine two softmax states over disjoint keys (``m1`` finite: every query sees the first key)."""
    m = mx.maximum(m1, m2)
    a1, a2 = _exp2(m1 - m), _exp2(m2 - m)
    return m, l1 * a1 + l2 * a2, o1 * a1 + o2 * a2


def own_pages(host_lens: list[int], groups: list[PrefixGroup], block_size: int) -> mx.array:
    """Table positions of each row's own pages ``(B, n)``: from the end of its group's shared pages on (from 0 for
    a row in no group), as many as the longest row needs."""
    shift = [0] * len(host_lens)
    for group in groups:
        for r in group.rows:
            shift[r] = group.shared_pages
    n = max(-(-L // block_size) - s for L, s in zip(host_lens, shift, strict=True))
    return mx.array(shift, dtype=mx.int32)[:, None] + mx.arange(n, dtype=mx.int32)  # (B, n)


def _spread(x: mx.array, idx: mx.array, shape: tuple[int, ...], fill: float) -> mx.array:
    """``x`` ``(KVH, n, ...)`` placed at rows ``idx`` of a ``shape`` array filled with ``fill``."""
    out = mx.full(shape, fill, dtype=mx.float32)
    out[:, idx] = x
    return out


def _shared_rows(k_pages: mx.array, v_pages: mx.array, ids: list[int]) -> list[tuple[mx.array, mx.array]]:
    """The rows of pages ``ids`` as ``(KVH, P, D)`` key/value pieces in position order: a view per run of
    consecutive pages when they lie in at most ``MAX_SHARED_RUNS`` runs (a prefix cached in one piece, then a
    block cached later by another request: two runs), else one gather."""
    KVH, _, bs, D = k_pages.shape
    runs = page_runs(ids, MAX_SHARED_RUNS)
    if runs is not None and all(first != 0 for first, _ in runs):
        return [tuple(p[:, first:first + n].reshape(KVH, n * bs, D) for p in (k_pages, v_pages)) for first, n in runs]
    idx = mx.array(ids, dtype=mx.int32)
    return [tuple(mx.take(p, idx, axis=1).reshape(KVH, len(ids) * bs, D) for p in (k_pages, v_pages))]


def runs_attention(queries: mx.array, k_rows: mx.array, v_rows: mx.array, runs: list[tuple[int, int]], *,
                   scale: float) -> mx.array:
    """One sequence's attention over ``runs`` ``(first row, rows)`` of the stored rows, causal.

    The ``L`` queries are the sequence's newest ``L`` positions, i.e. the last ``L`` of the runs' rows: query
    ``i`` sees every row up to its own (``L == 1``, a decode step, sees them all; ``L > 1``, a prefill chunk
    over a cached prefix, is masked only in the runs holding the chunk's own rows).

    Args:
        queries: ``(1, H, L, D)``.
        k_rows, v_rows: the pages stored as rows ``(1, KVH, NB * bs, D)`` (:mod:`mlxkv.kv.paged.page_arrays`).
        runs: the visible rows in position order as ranges of consecutive rows (at least ``L`` rows in all).

    Returns:
        ``(1, H, L, D)`` in the query dtype.
    """
    _, H, L, D = queries.shape
    KVH = k_rows.shape[1]
    G = H // KVH
    if L == 1 and H * sum(n for _, n in runs) <= ONE_SOFTMAX_MAX_SCORES:
        return _decode_one_softmax(queries, k_rows, v_rows, runs, scale)
    q = queries.reshape(KVH, G * L, D).astype(mx.float32) * (scale * LOG2E)  # (KVH, G * L, D): row g * L + i
    first_query = sum(n for _, n in runs) - L  # position (within the runs) of query 0
    query_pos = mx.arange(first_query, first_query + L, dtype=mx.int32)  # (L,)
    state, pos = None, 0
    for row, n in runs:
        k, v = k_rows[0, :, row:row + n], v_rows[0, :, row:row + n]  # (KVH, n, D) views
        if k.dtype != mx.float32:
            k, v = k.astype(mx.float32), v.astype(mx.float32)
        scores = q @ k.swapaxes(-1, -2)  # (KVH, G * L, n)
        masked = pos + n - 1 > first_query  # some row lies past a query
        if masked:
            seen = mx.arange(pos, pos + n, dtype=mx.int32)[None] <= query_pos[:, None]  # (L, n)
            scores = mx.where(mx.tile(seen, (G, 1)), scores, -mx.inf)
        # (KVH, G * L, 1), (KVH, G * L, 1), (KVH, G * L, D); all-masked rows only past query 0
        part = _softmax_state(scores, v, masked and pos > first_query)
        state = part if state is None else _merge(*state, *part)
        pos += n
    _, l, o = state
    return (o / l).reshape(1, H, L, D).astype(queries.dtype)


def _decode_one_softmax(queries: mx.array, k_rows: mx.array, v_rows: mx.array, runs: list[tuple[int, int]],
                        scale: float) -> mx.array:
    """:func:`runs_attention` of one decode query ``(1, H, 1, D)`` (it sees every row): the runs' scores side by
    side, one softmax, each run's slice of the weights times its values. Returns ``(1, H, 1, D)``."""
    _, H, _, D = queries.shape
    KVH = k_rows.shape[1]
    q = queries.reshape(1, KVH, H // KVH, D).astype(mx.float32) * scale  # (1, KVH, G, D)
    k_views = [k_rows[:, :, row:row + n] for row, n in runs]  # (1, KVH, n, D) each, zero-copy
    v_views = [v_rows[:, :, row:row + n] for row, n in runs]
    if k_rows.dtype != mx.float32:
        k_views = [k.astype(mx.float32) for k in k_views]
        v_views = [v.astype(mx.float32) for v in v_views]
    scores = [q @ k.swapaxes(-1, -2) for k in k_views]  # (1, KVH, G, n) each
    weights = mx.softmax(scores[0] if len(runs) == 1 else mx.concatenate(scores, axis=-1), axis=-1,
                         precise=True)  # (1, KVH, G, rows)
    out, pos = None, 0
    for (_, n), v in zip(runs, v_views):
        part = (weights if len(runs) == 1 else weights[..., pos:pos + n]) @ v  # (1, KVH, G, D)
        out = part if out is None else out + part
        pos += n
    return out.reshape(1, H, 1, D).astype(queries.dtype)
