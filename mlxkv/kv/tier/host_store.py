"""Secondary-tier stores' common parts and the host-memory store.

Every store keys blocks by ``(group_id, block_hash)`` (the chained hash already names the whole prefix and
salt). Eviction inside a store takes the lowest retention priority first, least recently used among equals,
and only entries whose priority is at most the incoming block's: a block that would need to push out a more
valuable one (or is larger than the whole cap) is not stored. Caps are never exceeded. The disk store is in
disk.py.
"""

from __future__ import annotations

from collections import OrderedDict

from mlxkv.kv.tier.format import TierBlock

Key = tuple[int, bytes]  # (group_id, block_hash)


def block_key(block: TierBlock) -> Key:
    return (block.group_id, block.block_hash)


class PriorityLRU:
    """Byte accounting and eviction order: per priority, keys in least-recently-used-first order."""

    def __init__(self) -> None:
        self._buckets: dict[int, OrderedDict[Key, int]] = {}
        self._prio: dict[Key, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._prio)

    def __contains__(self, key: Key) -> bool:
        return key in self._prio

    def add(self, key: Key, priority: int, nbytes: int) -> None:
        assert key not in self._prio, "key already indexed"
        self._buckets.setdefault(priority, OrderedDict())[key] = nbytes
        self._prio[key] = priority
        self.nbytes += nbytes

    def touch(self, key: Key) -> None:
        self._buckets[self._prio[key]].move_to_end(key)

    def remove(self, key: Key) -> int:
        p = self._prio.pop(key)
        nbytes = self._buckets[p].pop(key)
        if not self._buckets[p]:
            del self._buckets[p]
        self.nbytes -= nbytes
        return nbytes

    def victims(self, need: int, capacity: int, max_priority: int) -> list[Key] | None:
        """Keys to evict (in order) so that ``need`` more bytes fit, taking only priorities <= max_priority;
        None when that cannot make room."""
        out, freed = [], 0
        if self.nbytes + need <= capacity:
            return out
        for p in sorted(self._buckets):
            if p > max_priority:
                break
            for key, nbytes in self._buckets[p].items():
                out.append(key)
                freed += nbytes
                if self.nbytes - freed + need <= capacity:
                    return out
        return None

    def by_priority(self) -> dict[int, int]:
        return {p: len(b) for p, b in sorted(self._buckets.items())}

    def keys(self) -> list[Key]:
        return list(self._prio)

    def priority(self, key: Key) -> int:
        return self._prio[key]

    def ordered(self) -> list[tuple[Key, int]]:
        """``(key, nbytes)`` in eviction order: lowest priority first, least recently used first among equals."""
        return [item for p in sorted(self._buckets) for item in self._buckets[p].items()]


def _check_capacity(capacity_bytes: int) -> None:
    if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise ValueError(f"capacity_bytes={capacity_bytes!r}: expected an integer >= 0")


class HostMemoryStore:
    """Blocks kept in host memory (numpy arrays), at most ``capacity_bytes`` of K/V payload."""

    def __init__(self, capacity_bytes: int):
        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._lru = PriorityLRU()
        self._blocks: dict[Key, TierBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Key) -> bool:
        return key in self._blocks

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def put(self, block: TierBlock) -> tuple[bool, list[TierBlock]]:
        """Store ``block``; returns ``(stored, evicted blocks)``."""
        key = block_key(block)
        if key in self._blocks:
            self.pop(key)
        victims = self._lru.victims(block.nbytes, self.capacity_bytes, block.priority)
        if victims is None:
            return False, []
        evicted = [self.pop(k) for k in victims]
        self._lru.add(key, block.priority, block.nbytes)
        self._blocks[key] = block
        assert self._lru.nbytes <= self.capacity_bytes
        return True, evicted

    def get(self, key: Key) -> TierBlock | None:
        block = self._blocks.get(key)
        if block is not None:
            self._lru.touch(key)
        return block

    def pop(self, key: Key) -> TierBlock:
        self._lru.remove(key)
        return self._blocks.pop(key)

    def clear(self) -> None:
        for key in list(self._blocks):
            self.pop(key)

    def by_priority(self) -> dict[int, int]:
        return self._lru.by_priority()
