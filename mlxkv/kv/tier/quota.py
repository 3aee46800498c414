"""Per-tenant quotas for a secondary-tier store: :class:`TenantLRU` (tenants.py says what a tenant is)."""

from __future__ import annotations

from mlxkv.kv.tier.host_store import Key, PriorityLRU


class TenantLRU:
    """A store's priority-LRU index (host_store.PriorityLRU) with bytes per tenant, for a per-tenant quota.

    The quota only matters under contention: a tenant alone may fill the free space, but once over its quota it
    never pushes out another tenant's blocks (only its own), and its blocks over the quota are the first to go
    when a tenant within its quota needs room, whatever their priority. So one tenant at priority 100 cannot
    keep the others out.
    """

    def __init__(self) -> None:
        self.all = PriorityLRU()
        self._tenant: dict[Key, str] = {}  # key -> tenant
        self._per: dict[str, PriorityLRU] = {}  # tenant -> its own index

    def __len__(self) -> int:
        return len(self.all)

    def __contains__(self, key) -> bool:
        return key in self.all

    @property
    def nbytes(self) -> int:
        return self.all.nbytes

    def tenant(self, key) -> str | None:
        return self._tenant.get(key)

    def tenant_bytes(self, tenant: str) -> int:
        lru = self._per.get(tenant)
        return 0 if lru is None else lru.nbytes

    def add(self, key, priority: int, nbytes: int, tenant: str) -> None:
        self.all.add(key, priority, nbytes)
        self._tenant[key] = tenant
        self._per.setdefault(tenant, PriorityLRU()).add(key, priority, nbytes)

    def touch(self, key) -> None:
        self.all.touch(key)
        self._per[self._tenant[key]].touch(key)

    def remove(self, key) -> int:
        tenant = self._tenant.pop(key)
        own = self._per[tenant]
        own.remove(key)
        if not len(own):
            del self._per[tenant]
        return self.all.remove(key)

    def keys(self) -> list:
        return self.all.keys()

    def by_priority(self) -> dict[int, int]:
        return self.all.by_priority()

    def by_tenant(self) -> dict[str, int]:
        """Bytes per tenant."""
        return {t: lru.nbytes for t, lru in self._per.items()}

    def victims(self, need: int, capacity: int, priority: int, tenant: str, quota: int | None) -> list | None:
        """Keys to evict, in order, so that ``need`` more bytes of ``tenant`` at ``priority`` fit under
        ``capacity`` with each tenant held to ``quota`` bytes under contention; None when that cannot be done."""
        if self.all.nbytes + need <= capacity:
            return []
        if quota is None:
            return self.all.victims(need, capacity, priority)
        own = self._per.get(tenant)
        own_bytes = 0 if own is None else own.nbytes
        if own_bytes + need > quota:  # over its quota: only its own blocks may make room
            if own is None:
                return None
            return own.victims(need, capacity - (self.all.nbytes - own_bytes), priority)
        out, freed = [], 0
        for other, lru in sorted(self._per.items(), key=lambda kv: -kv[1].nbytes):
            over = lru.nbytes - quota
            if other == tenant or over <= 0:
                continue
            for key, nbytes in lru.ordered():  # squatters' blocks first, whatever their priority
                if over <= 0 or self.all.nbytes - freed + need <= capacity:
                    break
                out.append(key)
                freed += nbytes
                over -= nbytes
        if self.all.nbytes - freed + need <= capacity:
            return out
        taken = set(out)
        for key, nbytes in self.all.ordered():
            if key in taken:
                continue
            if self.all.priority(key) > priority:
                return None
            out.append(key)
            freed += nbytes
            if self.all.nbytes - freed + need <= capacity:
                return out
        return None
