"""A per-tenant quota on one block pool's cached blocks: :class:`TenantQuota`.

A tenant is a cache salt (None: requests without one). Only a chain's first block carries the salt among its
extra keys (hashing.HashContext); the pool gives every later block its parent's tenant when it caches it, so
nothing here walks a chain. The quota only matters under contention: a tenant alone may fill the pool, but when a
block must be evicted and some tenant holds more than ``share`` of the usable blocks, that tenant's free cached
blocks go first (in its own eviction order) instead of the global head, so one tenant flooding the pool with
long prompts cannot push out the others' prefixes.
"""

from __future__ import annotations

from collections.abc import Hashable

from mlxkv.kv.blocks.block import KVCacheBlock
from mlxkv.kv.blocks.free_queue import BucketedFreeQueue

SCAN_LIMIT = 4096
"""Free cached blocks an allocation may look past (beyond those it takes) for an over-quota tenant's blocks;
an over-quota tenant's blocks further back are not found and the global eviction order applies then."""


class TenantQuota:
    """Cached blocks per tenant of one pool, and the tenants holding more than their share.

    Args:
        share: fraction of the usable blocks one tenant may hold cached before its blocks are evicted first,
            in (0, 1] (1: no quota).
        usable_blocks: the pool's allocatable blocks.
        scan_limit: see SCAN_LIMIT.
    """

    __slots__ = ("_counts", "_over", "limit", "scan_limit", "share")

    def __init__(self, share: float, usable_blocks: int, scan_limit: int = SCAN_LIMIT) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"tenant_share={share!r}: expected a number in (0, 1] (1 = no per-tenant quota)")
        self.share = share
        self.limit = int(share * usable_blocks)  # a tenant with more cached blocks than this is over quota
        self.scan_limit = scan_limit
        self._counts: dict[Hashable, int] = {}  # tenant -> cached blocks (held or free)
        self._over: set[Hashable] = set()  # tenants whose count exceeds `limit`

    @property
    def over(self) -> frozenset:
        """Tenants holding more cached blocks than their share."""
        return frozenset(self._over)

    def counts(self) -> dict[Hashable, int]:
        """Cached blocks per tenant."""
        return dict(self._counts)

    def add(self, block: KVCacheBlock) -> None:
        """Count a block just cached (its ``tenant`` set)."""
        c = self._counts.get(block.tenant, 0) + 1
        self._counts[block.tenant] = c
        if c > self.limit:
            self._over.add(block.tenant)

    def remove(self, block: KVCacheBlock) -> None:
        """Uncount a cached block about to lose its content."""
        c = self._counts[block.tenant] - 1
        if c:
            self._counts[block.tenant] = c
        else:
            del self._counts[block.tenant]
        if c <= self.limit:
            self._over.discard(block.tenant)

    def victims(self, free: BucketedFreeQueue, want: int) -> list[KVCacheBlock]:
        """Up to ``want`` free cached blocks of over-quota tenants, in eviction order, none taking its tenant
        below the limit; looks at most ``scan_limit + want`` free cached blocks. Takes nothing out of ``free``."""
        if not self._over or want <= 0:
            return []
        excess = {t: self._counts[t] - self.limit for t in self._over}
        out: list[KVCacheBlock] = []
        budget = self.scan_limit + want
        for block in free.cached_blocks():
            budget -= 1
            if budget < 0:
                break
            left = excess.get(block.tenant, 0)
            if left > 0:
                out.append(block)
                excess[block.tenant] = left - 1
                if len(out) == want:
                    break
        return out

    def check(self, cached: list[KVCacheBlock]) -> None:
        """Assert the counts match the pool's cached blocks (tests)."""
        counts: dict[Hashable, int] = {}
        for block in cached:
            counts[block.tenant] = counts.get(block.tenant, 0) + 1
        assert counts == self._counts, f"tenant counts {self._counts} != {counts}"
        assert self._over == {t for t, c in counts.items() if c > self.limit}, "over-quota set out of sync"
