"""Eviction policies: tiny classes returning a block's primary sort key (SGLang's ``evict_policy`` style).

Only free blocks (ref_cnt == 0) are ever evicted. The pool files each freed cached block in the bucket
``policy.sort_key(block, now)`` (lower is evicted first) and keeps blocks within a bucket in the order they
were freed, so the full eviction order is ``(sort_key, free order)``: least recently used first, and within
one ``free`` call the order given, which the manager makes tail-first (a finished sequence's last block,
the least shareable, goes before its first). Blocks with no cached content are always reused first.
"""

from __future__ import annotations

from mlxkv.kv.blocks.block import KVCacheBlock


class EvictionPolicy:
    """Base policy. ``uses_priority``: keys depend on retention priorities (which can expire)."""

    name = "base"
    uses_priority = False

    def sort_key(self, block: KVCacheBlock, now: float) -> int:
        """Primary eviction key of a free cached block (>= 0; lower is evicted first)."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first; ignores priorities."""

    name = "lru"

    def sort_key(self, block: KVCacheBlock, now: float) -> int:
        return 0


class PriorityLRUPolicy(EvictionPolicy):
    """Lowest effective retention priority first, then least recently used. Equals LRU when every block
    has the default priority."""

    name = "priority"
    uses_priority = True

    def sort_key(self, block: KVCacheBlock, now: float) -> int:
        return block.effective_priority(now)


class LFUPolicy(EvictionPolicy):
    """Fewest prefix-cache hits first (counts capped at ``cap``), then least recently used."""

    name = "lfu"

    def __init__(self, cap: int = 64) -> None:
        if cap < 1:
            raise ValueError(f"LFUPolicy cap={cap}: expected >= 1")
        self.cap = cap

    def sort_key(self, block: KVCacheBlock, now: float) -> int:
        return min(block.hit_count, self.cap)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "priority": PriorityLRUPolicy,
    "lfu": LFUPolicy,
}


def make_eviction_policy(policy: str | EvictionPolicy | None = "lru") -> EvictionPolicy:
    """A policy instance from a name in EVICTION_POLICIES (or an instance, returned as is; None → LRU)."""
    if policy is None:
        return LRUPolicy()
    if isinstance(policy, EvictionPolicy):
        return policy
    cls = EVICTION_POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"eviction policy {policy!r}: expected one of {', '.join(EVICTION_POLICIES)}")
    return cls()
