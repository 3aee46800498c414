"""The figures of a paged block pool, for the engine's stats snapshot (``/v1/cache/stats``, ``/metrics``,
``mlxkv top``): blocks by state, the page arrays, the prefix hits, the secondary tier and the recurrent-state
snapshots.

Collected here from the backend, its block manager, its page arrays and its tier, so that the pool itself only
delegates (:meth:`mlxkv.kv.store.CachePool.block_stats`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxkv.kv.admission import max_paged_tokens

if TYPE_CHECKING:
    from mlxkv.kv.paged import PagedBackend


def paged_stats(backend: PagedBackend) -> dict:
    """``{"kv_blocks": ..., "evictions": n, "manager": ..., "tier": ..., "state_snapshots": ...}`` of ``backend``."""
    manager = backend.manager
    m = manager.stats()
    p = m.pool
    storage = backend.storage
    return {
        "kv_blocks": {"paged": True, "total": p.num_blocks, "used": p.used, "free": p.free, "cached": p.cached,
                      "allocated": p.allocated, "preallocated": backend.config.preallocate,
                      "allocated_bytes": storage.nbytes(),  # the page arrays as they are now
                      "budget_bytes": p.num_blocks * backend.bytes_per_block,
                      "evictable": p.evictable, "block_size": manager.block_size,
                      "capacity_tokens": max_paged_tokens(manager),
                      "cached_by_priority": {str(k): v for k, v in p.cached_by_priority.items()},
                      "overflow_dropped": manager.tables.dropped_blocks,
                      "overflow_restored": manager.tables.restored_blocks,
                      "overflow_host_bytes": backend.overflow_host_bytes(),
                      # how the pages store K/V (None: unquantized); bytes_per_block: every layer's share of a block
                      "kv_bits": storage.bits if storage.quantized else None,
                      "kv_group_size": storage.group_size if storage.quantized else None,
                      "bytes_per_block": backend.bytes_per_block},
        "evictions": p.evictions,
        "manager": {"prompt_tokens": m.prompt_tokens, "hit_tokens": m.hit_tokens, "running": m.running},
        "tier": backend.tier_stats(),
        "state_snapshots": backend.snapshot_stats(),
    }

