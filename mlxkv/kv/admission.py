"""Paged-pool policy for the batch engine: how many blocks a sequence needs, the longest sequence a block pool
holds, and a request's retention and priority on its block-manager record."""

from __future__ import annotations

from typing import Any

from mlxkv.engine.request import GenerationRequest, RetentionSpec


def blocks_needed(specs: list, block_size: int, num_tokens: int) -> int:
    """Blocks a sequence of ``num_tokens`` tokens holds at most, over every manager group."""
    total = 0
    for spec in specs:
        full = -(-num_tokens // block_size)
        if spec.kind == "sliding":
            full = min(full, -(-spec.window // block_size) + 1)
        elif spec.kind == "chunked":
            full = min(full, -(-spec.chunk_size // block_size) + 1)
        total += full
    return total


def max_paged_tokens(manager: Any) -> int:
    """Longest sequence (tokens) that fits the whole block pool alone."""
    usable = manager.pool.num_usable_blocks
    lo, hi = 0, usable * manager.block_size + 1  # blocks_needed is monotonic in the token count
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if blocks_needed(manager.specs, manager.block_size, mid) <= usable else (lo, mid)
    return lo


def retention_config(spec: RetentionSpec | None) -> Any:
    """The block manager's RetentionConfig for a request's retention rules (None: the default)."""
    from mlxkv.kv.blocks.retention import RetentionConfig

    if spec is None:
        return None
    return RetentionConfig(ranges=tuple((r.start, r.end, r.priority, r.duration) for r in spec.ranges),
                           decode_priority=spec.decode_priority, decode_duration_s=spec.decode_duration)


def apply_request_policy(manager: Any, seq_id: int, request: GenerationRequest) -> None:
    """Set a just-opened sequence's retention and scheduling priority on the manager's record of it.

    ``CachePool.open`` does not take them (yet), so they are set here, before the sequence commits any block;
    its prefix-hit blocks get the request's retention merged in, as the manager's own ``open`` does.
    Requests admit lower ``priority`` values first; the manager preempts lower values first: it gets the
    negation.
    """
    state = manager._get(seq_id)
    state.priority = -request.priority
    retention = retention_config(request.retention)
    if retention is None:
        return
    state.retention = retention
    pool, B = manager.pool, manager.block_size
    now = pool.clock()
    for table in state.tables:
        for i, block in enumerate(table.blocks[: table.num_cached]):
            pool.set_retention(block, *retention.block_retention(i * B, (i + 1) * B, state.prompt_len, now))
