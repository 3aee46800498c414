"""Cascade attention: sequences sharing a whole-page prefix attend to it once.

For each group of sequences whose block tables start with the same ``n`` blocks, one batched
pass attends all the group's queries to those ``n`` shared pages (the queries are stacked as
extra heads of a single "sequence", so the shared K/V is read once). Each sequence then attends
its own suffix (its table shifted by ``n`` pages: attention has no positional term, so the shift
is exact), and the two partial states are merged by log-sum-exp with the sinks, as split-K
partials are. Full-attention layers only: a window or chunk changes what a prefix may see.

The engine's batched decode passes its step's groups to the dispatcher when the paged kernel runs
(:mod:`mlxkv.kv.batching.attention_backends`), keeping those :func:`worth_cascading` selects. Measured on
a shared 2-core CPU with the reference kernels (``python scripts/bench_cascade.py``: 8 sequences,
SmolLM2-135M's attention shape; noisy, three runs): 4K context with 95% shared was faster every
time (1.8x-2.7x without sinks, 1.1x-2.9x with), while 512 tokens at 95%, and 25% or 5% shared,
went either way (0.6x-2.3x). Hence the rule: cascade a prefix of at least ``MIN_SHARED_TOKENS``
tokens that is at least half of every member's context. No Metal timing exists.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from mlxkv import env

from .geometry import check_paged_inputs, default_scale, plan_splits


# Fewest shared tokens, absolute and as a fraction of each member's context, for cascade to pay.
MIN_SHARED_TOKENS = 2048
MIN_SHARED_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """Sequences (batch rows) whose first ``shared_pages`` block-table entries are identical."""

    rows: tuple[int, ...]
    shared_pages: int


def find_prefix_groups(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    *,
    min_group: int | None = None,
    min_shared_pages: int | None = None,
) -> list[PrefixGroup]:
    """Group rows by their first block and keep groups sharing enough whole pages.

    A shared page must be full for every member and leave each member at least its current
    token as suffix (``shared_pages <= (L - 1) // block_size``). One level: rows are bucketed by
    their first block id and a bucket's shared length is its longest common prefix.
    Defaults come from ``MLXKV_CASCADE_MIN_GROUP`` / ``MLXKV_CASCADE_MIN_SHARED_PAGES``.
    """
    min_group = env.flags().cascade_min_group_size if min_group is None else min_group
    min_shared_pages = env.flags().cascade_min_shared_pages if min_shared_pages is None else min_shared_pages
    buckets: dict[int, list[int]] = defaultdict(list)
    for row, (table, L) in enumerate(zip(block_tables, context_lens, strict=True)):
        if table and table[0] != 0 and (L - 1) // block_size >= min_shared_pages:
            buckets[table[0]].append(row)
    groups = []
    for rows in buckets.values():
        if len(rows) < min_group:
            continue
        shared = min((context_lens[r] - 1) // block_size for r in rows)
        first = block_tables[rows[0]]
        for p in range(shared):
            if any(block_tables[r][p] != first[p] for r in rows):
                shared = p
                break
        if shared >= min_shared_pages:
            groups.append(PrefixGroup(rows=tuple(rows), shared_pages=shared))
    return groups


def worth_cascading(groups: list[PrefixGroup], context_lens: list[int], block_size: int) -> list[PrefixGroup]:
    """The groups whose shared pages hold ``MIN_SHARED_TOKENS`` tokens and at least ``MIN_SHARED_FRACTION``
    of every member's context."""
    out = []
    for g in groups:
        shared = g.shared_pages * block_size
        if shared >= MIN_SHARED_TOKENS and all(shared >= MIN_SHARED_FRACTION * context_lens[r] for r in g.rows):
            out.append(g)
    return out


def cascade_attention(
    impl_for: Callable[[int], object],
    queries: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    groups: list[PrefixGroup],
    *,
    scale: float | None = None,
    sinks: mx.array | None = None,
    num_splits: int | None = None,
) -> mx.array:
    """Paged decode attention computed as shared-prefix passes + suffix pass + LSE merge.

    Args:
        impl_for: ``gqa -> implementation`` (``partials``/``merge`` interface); the shared pass
            asks for ``rows * gqa`` query heads per kv head.
        groups: from :func:`find_prefix_groups`; rows in no group attend normally.
        Other arguments as :func:`~mlxkv.kernels.paged_attention_ref.paged_attention_reference`.

    Returns:
        ``[B, n_heads, 1, head_dim]``, equal to flat attention up to float rounding.
    """
    B, H, D, bs, KVH, G = check_paged_inputs(
        queries, k_pages, v_pages, block_tables, context_lens, None, None, sinks
    )
    scale = default_scale(D) if scale is None else float(scale)
    lens = context_lens.tolist()
    max_blocks = block_tables.shape[1]
    shift = [0] * B
    for group in groups:
        for r in group.rows:
            shift[r] = group.shared_pages

    # Suffix pass: every row, its table shifted past its group's shared pages.
    shift_arr = mx.array(shift, dtype=mx.int32)  # (B,)
    cols = mx.minimum(shift_arr[:, None] + mx.arange(max_blocks, dtype=mx.int32), max_blocks - 1)
    suffix_tables = mx.take_along_axis(block_tables, cols, axis=1)  # (B, max_blocks)
    suffix_lens = [L - s * bs for L, s in zip(lens, shift, strict=True)]
    base = impl_for(G)
    plan = plan_splits(max(suffix_lens), bs, num_splits=num_splits, max_blocks_per_seq=max_blocks)
    o_suffix, lse_suffix = base.partials(
        queries, k_pages, v_pages, suffix_tables, mx.array(suffix_lens, dtype=mx.int32), plan,
        scale=scale, window=None, chunk_size=None,
    )  # (B, H, S1, D), (B, H, S1)

    # Shared passes: per group (cut to what the implementation's kv-head grouping allows).
    passes = []  # (rows, o (n, H, S2, D), lse (n, H, S2))
    limit = getattr(base, "max_gqa", None)  # most query heads per kv head the kernel holds
    for group in groups:
        step = len(group.rows) if limit is None else max(1, limit // G)
        for i in range(0, len(group.rows), step):
            rows = group.rows[i : i + step]
            passes.append((rows, *_shared_pass(impl_for, queries, k_pages, v_pages, block_tables,
                                                rows, group.shared_pages, scale, num_splits)))
    if not passes:
        return base.merge(o_suffix, lse_suffix, sinks, queries.dtype)

    S2 = max(o.shape[2] for _, o, _ in passes)
    o_shared = mx.zeros((B, H, S2, D), dtype=mx.float32)
    lse_shared = mx.full((B, H, S2), -mx.inf, dtype=mx.float32)
    for rows, o, lse in passes:
        idx = mx.array(rows, dtype=mx.int32)
        o_shared[idx, :, : o.shape[2]] = o
        lse_shared[idx, :, : o.shape[2]] = lse
    o_all = mx.concatenate([o_suffix, o_shared], axis=2)  # (B, H, S1 + S2, D)
    lse_all = mx.concatenate([lse_suffix, lse_shared], axis=2)  # (B, H, S1 + S2)
    return base.merge(o_all, lse_all, sinks, queries.dtype)


def _shared_pass(impl_for, queries, k_pages, v_pages, block_tables, rows, shared_pages, scale, num_splits):
    """All ``rows``' queries against their shared pages in one pass; per-row partials."""
    _, H, _, D = queries.shape
    KVH, bs = k_pages.shape[0], k_pages.shape[2]
    n, G = len(rows), H // KVH
    idx = mx.array(rows, dtype=mx.int32)
    q = queries[idx].reshape(n, KVH, G, D).transpose(1, 0, 2, 3)  # (KVH, n, G, D)
    q = q.reshape(1, KVH * n * G, 1, D)  # one "sequence" with n*G query heads per kv head
    table = block_tables[rows[0] : rows[0] + 1, :shared_pages]  # (1, shared_pages)
    lens = mx.array([shared_pages * bs], dtype=mx.int32)
    plan = plan_splits(shared_pages * bs, bs, num_splits=num_splits, max_blocks_per_seq=shared_pages)
    o, lse = impl_for(n * G).partials(q, k_pages, v_pages, table, lens, plan,
                                      scale=scale, window=None, chunk_size=None)
    S = plan.num_splits
    o = o.reshape(KVH, n, G, S, D).transpose(1, 0, 2, 3, 4).reshape(n, H, S, D)  # (n, H, S, D)
    lse = lse.reshape(KVH, n, G, S).transpose(1, 0, 2, 3).reshape(n, H, S)  # (n, H, S)
    return o, lse
