"""Geometry shared by every paged-attention implementation: visible ranges, split plans, checks.

The reference and the Metal kernel take the same :class:`SplitPlan` so they partition the context
identically; only the arithmetic inside a split differs (one matmul per step vs token by token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from mlxkv import env

# Tolerances (atol = rtol) for "kernel vs reference" and "reference vs dense SDPA", as MLX's SDPA
# tests use. float32 meets 1e-6 here: the split-K sums differ from dense SDPA's one-pass sum by
# ~2-6e-7 on unit-normal inputs up to 16K context (measured). Half types get one or two ulps of
# the output's final rounding.
TOLERANCES = {mx.float32: 1e-6, mx.float16: 1e-3, mx.bfloat16: 1e-2}

# Tokens per split when the split count is chosen by context length.
TOKENS_PER_SPLIT = 2048
MAX_SPLITS = 16


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """How a decode step partitions each sequence's visible pages into split-K ranges.

    Split ``s`` of sequence ``b`` covers the visible pages ``[first_page_b + s * pages_per_split,
    first_page_b + (s + 1) * pages_per_split)``, clipped to the visible tokens.
    """

    num_splits: int  # splits per (sequence, kv head); >= 1
    pages_per_split: int  # pages per split; >= 1
    visible_pages: int  # upper bound on any sequence's visible pages; num_splits*pps >= this


def default_scale(head_dim: int) -> float:
    """The usual ``1 / sqrt(head_dim)`` attention scale."""
    return 1.0 / math.sqrt(head_dim)


def visible_start(context_lens: mx.array, window: int | None, chunk_size: int | None) -> mx.array:
    """First visible position per sequence: 0, ``L - window`` (sliding) or the chunk start.

    ``context_lens`` counts the current token, which sits at position ``L - 1``.
    """
    start = mx.zeros_like(context_lens)  # (B,)
    if window is not None:
        start = mx.maximum(start, context_lens - window)
    if chunk_size is not None:
        start = mx.maximum(start, ((context_lens - 1) // chunk_size) * chunk_size)
    return start


def visible_page_bound(
    max_context_len: int, block_size: int, window: int | None, chunk_size: int | None
) -> int:
    """Most pages any sequence can touch: the whole context, or what a window/chunk can span."""
    bound = -(-max(max_context_len, 1) // block_size)
    if window is not None:  # W consecutive positions at any offset span <= this many pages
        bound = min(bound, (window + block_size - 2) // block_size + 1)
    if chunk_size is not None:
        if chunk_size % block_size == 0:  # chunk starts are page-aligned
            bound = min(bound, chunk_size // block_size)
        else:
            bound = min(bound, (chunk_size + block_size - 2) // block_size + 1)
    return bound


def choose_num_splits(visible_tokens: int) -> int:
    """Split count: ``MLXKV_PAGED_DECODE_SPLITS`` if set, else one per ~2K visible tokens (<= 16)."""
    override = env.flags().paged_decode_splits
    if override is not None:
        return override
    return max(1, min(MAX_SPLITS, -(-visible_tokens // TOKENS_PER_SPLIT)))


def plan_splits(
    max_context_len: int,
    block_size: int,
    *,
    window: int | None = None,
    chunk_size: int | None = None,
    num_splits: int | None = None,
    max_blocks_per_seq: int | None = None,
) -> SplitPlan:
    """Build the split plan for a decode step whose longest sequence has ``max_context_len`` tokens.

    Raises:
        ValueError: ``num_splits`` < 1.
    """
    pages = visible_page_bound(max_context_len, block_size, window, chunk_size)
    if max_blocks_per_seq is not None:
        pages = max(1, min(pages, max_blocks_per_seq))
    if num_splits is None:
        num_splits = choose_num_splits(pages * block_size)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}: expected an integer >= 1")
    splits = min(num_splits, pages)
    per_split = -(-pages // splits)
    splits = -(-pages // per_split)  # drop splits that would be empty for every sequence
    return SplitPlan(num_splits=splits, pages_per_split=per_split, visible_pages=pages)


def host_max_context_len(context_lens: mx.array, max_context_len: int | None) -> int:
    """The caller's bound if given, else read the lengths back from the device (one sync)."""
    if max_context_len is not None:
        return int(max_context_len)
    return int(mx.max(context_lens).item()) if context_lens.size else 0


def check_paged_inputs(
    queries: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    window: int | None,
    chunk_size: int | None,
    sinks: mx.array | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes and options; return ``(B, H, D, block_size, kv_heads, gqa)``.

    Raises:
        ValueError: a shape or option that does not match the documented layout.
    """
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"queries must be [B, n_heads, 1, head_dim], got {queries.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [kv_heads, num_blocks, block_size, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    B, H, _, D = queries.shape
    kv_heads, _, block_size, d_kv = k_pages.shape
    if d_kv != D:
        raise ValueError(f"head_dim mismatch: queries {D}, pages {d_kv}")
    if H % kv_heads:
        raise ValueError(f"n_heads={H} is not a multiple of kv_heads={kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != B or block_tables.dtype != mx.int32:
        raise ValueError(f"block_tables must be int32 [B={B}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (B,) or context_lens.dtype != mx.int32:
        raise ValueError(f"context_lens must be int32 [B={B}], got {context_lens.shape}")
    if window is not None and window < 1:
        raise ValueError(f"window={window}: expected None or an integer >= 1")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: expected None or an integer >= 1")
    if sinks is not None and sinks.shape != (H,):
        raise ValueError(f"sinks must be [n_heads={H}], got {sinks.shape}")
    return B, H, D, block_size, kv_heads, H // kv_heads


def check_table_contents(block_tables: mx.array, context_lens: mx.array, num_blocks: int, block_size: int) -> None:
    """Refuse tables that disagree with the pool: a block id outside ``[0, num_blocks)`` or a context
    length outside ``[0, max_blocks * block_size]`` (more tokens than the table row holds). One device sync.

    Raises:
        ValueError: naming the first bad row.
    """
    max_blocks = block_tables.shape[1]
    bad_ids = mx.any((block_tables < 0) | (block_tables >= num_blocks), axis=1)  # (B,)
    bad_lens = (context_lens < 0) | (context_lens > max_blocks * block_size)  # (B,)
    bad = mx.stack([bad_ids, bad_lens]).tolist()  # (2, B) on the host
    for row, (ids_wrong, len_wrong) in enumerate(zip(*bad, strict=True)):
        if ids_wrong:
            raise ValueError(f"block_tables row {row} has an id outside the pool [0, {num_blocks}): "
                             f"{block_tables[row].tolist()}")
        if len_wrong:
            raise ValueError(f"context_lens[{row}]={context_lens[row].item()} is outside [0, {max_blocks * block_size}] "
                             f"(the table row holds {max_blocks} blocks of {block_size})")


def check_host_tables(block_tables: list[list[int]], context_lens: list[int], num_blocks: int,
                      block_size: int) -> None:
    """:func:`check_table_contents` on host lists, before any array is built (per-step metadata,
    :mod:`mlxkv.kv.paged.step_context`): no device sync. Rows may differ in length (padding comes later).

    Raises:
        ValueError: naming the first bad row.
    """
    if len(block_tables) != len(context_lens):
        raise ValueError(f"{len(block_tables)} block tables but {len(context_lens)} context lengths")
    for row, (table, n) in enumerate(zip(block_tables, context_lens)):
        if table and (min(table) < 0 or max(table) >= num_blocks):
            raise ValueError(f"block_tables row {row} has an id outside the pool [0, {num_blocks}): {list(table)}")
        if not 0 <= n <= len(table) * block_size:
            raise ValueError(f"context_lens[{row}]={n} is outside [0, {len(table) * block_size}] "
                             f"(the table row holds {len(table)} blocks of {block_size})")


def page_runs(block_ids: list[int], limit: int | None = None) -> list[tuple[int, int]] | None:
    """``block_ids`` as runs ``(first id, pages)`` of consecutive ids, in order; None past ``limit`` runs."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif limit is not None and len(runs) == limit:
            return None
        else:
            runs.append((b, 1))
    return runs
