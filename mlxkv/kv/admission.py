"""Sizing sequences against a block pool: the blocks a sequence holds at most, the longest one a pool holds."""

from __future__ import annotations

from typing import Any


def blocks_needed(specs: list, block_size: int, num_tokens: int) -> int:
    """Blocks a sequence of ``num_tokens`` tokens holds at most, over every manager group (a windowed or
    chunked group holds its span, and one block more while a window straddles a block boundary)."""
    total = 0
    for spec in specs:
        blocks = -(-num_tokens // block_size)
        span = spec.attention.span()
        if span is not None:
            blocks = min(blocks, -(-span // block_size) + 1)
        total += blocks
    return total


def max_paged_tokens(manager: Any) -> int:
    """Longest sequence (tokens) that fits the whole block pool alone."""
    usable = manager.pool.num_usable_blocks
    lo, hi = 0, usable * manager.block_size + 1  # blocks_needed is monotonic in the token count
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if blocks_needed(manager.specs, manager.block_size, mid) <= usable else (lo, mid)
    return lo


def paged_blocks_for(model: Any, block_size: int, context_tokens: int) -> int:
    """Pool blocks one sequence of ``context_tokens`` tokens can need: every KV group (full, each window,
    each chunk size) may hold the whole context, plus one spare block per group and the null block."""
    from mlxkv.kv.layouts import layer_kind, make_caches

    groups = {layer_kind(c) for c in make_caches(model)}
    return len(groups) * (-(-context_tokens // block_size) + 1) + 1
