"""The block pool: every KV block, the free queue, the cache index, retention and events.

Blocks ``1..num_blocks-1`` are allocatable; block 0 is the null block. A block is *used* while some block
table holds it (ref_cnt > 0) and *free* otherwise; a free block may still hold *cached* content, which a
prefix hit can revive (``touch``) until the block is evicted to serve an allocation.

Cache index (per KV-cache group): full blocks by chained hash, and every cached block (full or partial) by
``(parent ref, extra keys, first token)`` for token-granular partial reuse. Content identity is a
``(block_id, generation)`` ref; the generation changes on every cache / uncache.

Lazily allocated pools (``initial_blocks``): ``num_blocks`` is the budget every capacity figure, admission and
preemption sees, but only the ids below :attr:`BlockPool.allocated` are backed by storage. The rest are a
*reserve*: counted free, never in the free queue. An allocation that finds no free block without cached
content takes a chunk of the reserve (:meth:`BlockPool._grow`, ids in ascending order) before it evicts
anything, so cached content is kept exactly as long as in a pool allocated whole; resize hooks let the storage
follow. :meth:`BlockPool.release_tail` gives back the ids above the highest held block (their cached content
evicted through the usual path: evict hooks, events).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxkv.kv.blocks.block import DEFAULT_PRIORITY, BlockHash, BlockRef, KVCacheBlock
from mlxkv.kv.blocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBuffer,
)
from mlxkv.kv.blocks.eviction import EvictionPolicy, make_eviction_policy
from mlxkv.kv.blocks.free_queue import UNCACHED_BUCKET, BucketedFreeQueue
from mlxkv.kv.blocks.hashing import image_labels, salt_of
from mlxkv.kv.blocks.retention import merge_retention
from mlxkv.kv.blocks.tenant_quota import TenantQuota


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int  # allocatable blocks (the null block excluded)
    used: int  # held by at least one block table
    free: int  # unused: never-used, uncached, or cached and evictable
    cached: int  # holding cached content (used or free)
    evictable: int  # free and cached
    cached_by_priority: dict[int, int]  # cached blocks per effective retention priority
    evictions: int  # cached blocks evicted so far
    allocated: int = 0  # allocatable blocks backed by storage now (num_blocks when allocated whole)


class BlockPool:
    """All KV blocks of one pool. Not thread-safe (the engine owns it).

    Args:
        num_blocks: total blocks including the null block (>= 2).
        block_size: token slots per block.
        enable_caching: keep freed full blocks findable for prefix reuse.
        eviction_policy: "lru" (default), "priority", "lfu" or an EvictionPolicy.
        events: event buffer (a fresh 4096-event one by default).
        clock: monotonic seconds, for retention expiry (injectable for tests).
        tenant_share: share of the usable blocks one tenant (cache salt) may hold cached before its free
            cached blocks are evicted ahead of the others', in (0, 1] (1: no quota; see tenant_quota.py).
        initial_blocks: ids backed at start, the null block included (None: all ``num_blocks``, allocated
            whole); the pool then grows as allocations need (module docstring).
        grow_blocks: the least a growth adds (it adds at least a quarter of what is allocated, so a pool
            growing to its budget copies its storage a bounded number of times).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        eviction_policy: str | EvictionPolicy | None = "lru",
        events: KVEventBuffer | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenant_share: float = 1.0,
        initial_blocks: int | None = None,
        grow_blocks: int = 1,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: expected >= 2 (the null block plus one usable block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: expected >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.policy = make_eviction_policy(eviction_policy)
        self.events = events if events is not None else KVEventBuffer()
        self.clock = clock
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        if grow_blocks < 1:
            raise ValueError(f"grow_blocks={grow_blocks}: expected >= 1")
        self.grow_blocks = grow_blocks
        self.allocated = num_blocks if initial_blocks is None else max(1, min(num_blocks, initial_blocks))
        self._resize_hooks: list[Callable[[int], None]] = []
        self._free = BucketedFreeQueue()
        for block in self.blocks[1:self.allocated]:
            self._free.push(block, UNCACHED_BUCKET)
        self._by_hash: dict[tuple[int, BlockHash], dict[int, KVCacheBlock]] = {}
        self._by_parent: dict[tuple, dict[int, KVCacheBlock]] = {}
        self.cache_version = 0  # changes whenever a block is cached or uncached: a prefix search holds while equal
        self._expiry_heap: list[tuple[float, int, int]] = []  # (expiry, block_id, free_stamp) of free blocks
        self._evict_hooks: list[Callable[[KVCacheBlock], None]] = []
        self.num_evictions = 0
        self.quota = TenantQuota(tenant_share, num_blocks - 1)

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (unused plus evictable cached, the unallocated reserve included)."""
        return len(self._free) + self.num_reserve_blocks

    @property
    def num_reserve_blocks(self) -> int:
        """Blocks of the budget not backed by storage yet (0 in a pool allocated whole)."""
        return len(self.blocks) - self.allocated

    # ---- lazy allocation --------------------------------------------------------------------------------
    def add_resize_hook(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(allocated)`` whenever the backed ids change to ``[0, allocated)`` (the storage follows)."""
        self._resize_hooks.append(hook)

    def _grow(self, short: int) -> None:
        """Back at least ``short`` more ids (a chunk: at least ``grow_blocks`` and a quarter of what is
        allocated, at most the reserve), as free blocks without content in ascending id order."""
        old = self.allocated
        new = min(len(self.blocks), old + max(short, self.grow_blocks, old // 4))
        for hook in self._resize_hooks:
            hook(new)
        self.allocated = new
        for block in self.blocks[old:new]:
            self._free.push(block, UNCACHED_BUCKET)

    def release_tail(self, keep: int = 1) -> int:
        """Give back the backed ids above the highest block any table holds (and at or above ``keep``): their
        cached content is evicted through the usual path (evict hooks, BlockRemoved events) and they return to
        the reserve. Returns how many blocks were given back."""
        cut = self.allocated
        while cut > max(1, keep) and self.blocks[cut - 1].ref_cnt == 0:
            cut -= 1
        if cut == self.allocated:
            return 0
        tail = self.blocks[cut:self.allocated]
        for block in tail:
            if block.cached:  # an evict hook may uncache others too (a snapshot's blocks): all stay free
                self._evict(block)
        for block in tail:
            self._free.remove(block)
        released = self.allocated - cut
        self.allocated = cut
        for hook in self._resize_hooks:
            hook(self.allocated)
        return released

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of allocatable blocks in use."""
        return self.num_used_blocks / self.num_usable_blocks

    # ---- allocation and reference counts --------------------------------------------------------------
    def get_new_blocks(self, n: int, after: int | None = None) -> list[KVCacheBlock]:
        """Take ``n`` blocks (ref_cnt 1), evicting cached content in eviction order. Raises NoFreeBlocksError.

        Block ids are handed out so that a table's pages tend to be consecutive in the pool (on CPU a
        sequence's consecutive pages are read as a zero-copy view, see :mod:`mlxkv.kv.paged.page_arrays`), without
        changing *which* cached content is evicted: first the blocks right after ``after`` (the id of the
        table's current last block) while they are free and hold no cached content (every such block is worth
        the same), then the rest in eviction order, sorted by id (a released sequence's blocks come back
        reversed, tail first, and would otherwise be handed out descending).
        """
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, only {self.num_free_blocks} free or evictable")
        self._expire_priorities()
        now = self.clock()
        out = []
        nxt = -1 if after is None else after + 1
        while 0 < nxt < self.allocated and len(out) < n:
            block = self.blocks[nxt]
            if block.ref_cnt != 0 or block.cached:
                break
            self._free.remove(block)
            out.append(block)
            nxt += 1
        rest = []
        short = n - len(out) - self._free.count(UNCACHED_BUCKET)
        if short > 0 and self.num_reserve_blocks:  # grow before evicting any cached content
            self._grow(short)
        if self.quota.over and n > len(out):  # over-quota tenants' cached blocks before the global head
            for block in self.quota.victims(self._free, n - len(out) - self._free.count(UNCACHED_BUCKET)):
                self._free.remove(block)
                self._evict(block)
                rest.append(block)
        for _ in range(n - len(out) - len(rest)):
            block = self._free.popleft()
            if block.cached:
                self._evict(block)
            rest.append(block)
        out.extend(sorted(rest, key=lambda b: b.block_id))
        for block in out:
            block.ref_cnt = 1
            block.last_access = now
        return out

    def touch(self, blocks: Sequence[KVCacheBlock], hit: bool = True) -> None:
        """Add a reference to each block (a prefix hit when ``hit``, else sharing by fork)."""
        now = self.clock()
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1
            block.last_access = now
            if hit:
                block.hit_count += 1

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue in the order given
        (the first given is evicted first among equals). The null block is skipped."""
        now = self.clock()
        for block in blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            block.last_access = now
            if block.ref_cnt == 0:
                self._push_free(block, now)

    def _push_free(self, block: KVCacheBlock, now: float) -> None:
        if not block.cached:
            self._free.push(block, UNCACHED_BUCKET)
            return
        key = self.policy.sort_key(block, now)
        assert key >= 0, f"eviction policy {self.policy.name} returned negative key {key}"
        self._free.push(block, key)
        if self.policy.uses_priority and block.priority_expiry is not None and now < block.priority_expiry:
            if len(self._expiry_heap) > 2 * len(self.blocks) + 64:  # drop stale entries now and then
                self._expiry_heap = [e for e in self._expiry_heap if self.blocks[e[1]].free_stamp == e[2]]
                heapq.heapify(self._expiry_heap)
            heapq.heappush(self._expiry_heap, (block.priority_expiry, block.block_id, block.free_stamp))

    def _expire_priorities(self) -> None:
        """Move free blocks whose priority expired to their new bucket's head (next to be evicted there)."""
        if not self._expiry_heap:
            return
        now = self.clock()
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            _, block_id, stamp = heapq.heappop(self._expiry_heap)
            block = self.blocks[block_id]
            if block.free_bucket in (None, UNCACHED_BUCKET) or block.free_stamp != stamp:
                continue  # revived or evicted since
            key = self.policy.sort_key(block, now)
            if key != block.free_bucket:
                self._free.remove(block)
                self._free.push(block, key, front=True)

    # ---- cache index ----------------------------------------------------------------------------------
    def _register(self, block, group_id, parent_ref, token_ids, extra_keys, anchor=None) -> None:
        assert not block.is_null and not block.cached, f"cannot cache {block}"
        assert block.ref_cnt > 0, f"only a held block can be cached: {block}"
        block.cached = True
        self.cache_version += 1
        block.group_id = group_id
        block.token_ids = tuple(token_ids)
        block.extra_keys = extra_keys
        block.parent = parent_ref
        block.anchor = anchor
        block.generation += 1
        block.hit_count = 0
        key = (group_id, parent_ref, extra_keys, block.token_ids[0])
        self._by_parent.setdefault(key, {})[block.block_id] = block
        # a chain's tenant is its first block's salt; later blocks take it from the parent (held by the same
        # sequence, so resolvable), a windowed block whose parent is unknown from its anchor
        if parent_ref is None:
            block.tenant = salt_of(extra_keys)
        else:
            source = self.resolve(parent_ref) or self.resolve(anchor)
            block.tenant = source.tenant if source is not None else salt_of(extra_keys)
        self.quota.add(block)

    def cache_full_block(
        self,
        block: KVCacheBlock,
        *,
        group_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        parent_ref: BlockRef | None,
        token_ids: Sequence[int],
        extra_keys: tuple,
        anchor: BlockRef | None = None,
    ) -> bool:
        """Make a held, filled block findable by hash; emits BlockStored. False when caching is off."""
        if not self.enable_caching:
            return False
        assert len(token_ids) == self.block_size, "only full blocks are hashed"
        self._register(block, group_id, parent_ref, token_ids, extra_keys, anchor)
        block.block_hash = block_hash
        self._by_hash.setdefault((group_id, block_hash), {})[block.block_id] = block
        self.events.append(
            BlockStored((block_hash,), parent_hash, block.token_ids, self.block_size, group_id, block.priority,
                        image_labels(extra_keys))
        )
        return True

    def cache_partial_block(
        self, block: KVCacheBlock, *, group_id: int, parent_ref: BlockRef | None, token_ids: Sequence[int],
        extra_keys: tuple,
    ) -> bool:
        """Make a held, partly filled block findable for partial reuse (no hash, no event)."""
        if not self.enable_caching:
            return False
        assert 0 < len(token_ids) < self.block_size, "a partial block holds 1..block_size-1 tokens"
        self._register(block, group_id, parent_ref, token_ids, extra_keys)
        return True

    def uncache(self, block: KVCacheBlock, emit: bool = True) -> None:
        """Forget a block's cached content (it is about to be overwritten, or evicted)."""
        if not block.cached:
            return
        key = (block.group_id, block.parent, block.extra_keys, block.token_ids[0])
        siblings = self._by_parent[key]
        del siblings[block.block_id]
        if not siblings:
            del self._by_parent[key]
        if block.block_hash is not None:
            hkey = (block.group_id, block.block_hash)
            same = self._by_hash[hkey]
            del same[block.block_id]
            if not same:
                del self._by_hash[hkey]
            if emit:
                self.events.append(BlockRemoved((block.block_hash,), block.group_id))
        self.quota.remove(block)
        block.tenant = None
        block.cached = False
        self.cache_version += 1
        block.block_hash = None
        block.token_ids = ()
        block.extra_keys = ()
        block.parent = block.anchor = None
        block.generation += 1
        block.priority, block.priority_expiry = DEFAULT_PRIORITY, None
        block.hit_count = 0
        if block.free_bucket is not None and block.free_bucket != UNCACHED_BUCKET:
            self._free.remove(block)
            self._free.push(block, UNCACHED_BUCKET, front=True)

    def add_evict_hook(self, hook: Callable[[KVCacheBlock], None]) -> None:
        """Call ``hook(block)`` on each eviction while the block still holds its content (secondary tier)."""
        self._evict_hooks.append(hook)

    def _evict(self, block: KVCacheBlock) -> None:
        for hook in self._evict_hooks:
            hook(block)
        self.uncache(block)
        self.num_evictions += 1

    def lookup(self, group_id: int, block_hash: BlockHash) -> list[KVCacheBlock]:
        """Cached full blocks of ``group_id`` whose hash is ``block_hash`` (verify tokens before use)."""
        found = self._by_hash.get((group_id, block_hash))
        return list(found.values()) if found else []

    def children(
        self, group_id: int, parent_ref: BlockRef | None, extra_keys: tuple, first_token: int
    ) -> list[KVCacheBlock]:
        """Cached blocks (full or partial) following ``parent_ref`` whose first token is ``first_token``."""
        found = self._by_parent.get((group_id, parent_ref, extra_keys, first_token))
        return list(found.values()) if found else []

    def resolve(self, ref: BlockRef | None) -> KVCacheBlock | None:
        """The block still holding the cached content ``ref`` names, or None."""
        if ref is None or ref[0] <= 0:
            return None
        block = self.blocks[ref[0]]
        return block if block.cached and block.generation == ref[1] else None

    def set_retention(
        self, block: KVCacheBlock, priority: int, expiry: float | None, merge: bool = True
    ) -> None:
        """Set a block's retention: assign it (``merge=False``: the block's content is new) or merge a
        sharing request's rules into it (higher effective priority wins; see retention.merge_retention)."""
        if block.is_null:
            return
        now = self.clock()
        current = (block.priority, block.priority_expiry)
        block.priority, block.priority_expiry = (
            merge_retention(current, (priority, expiry), now) if merge else (priority, expiry)
        )
        if block.free_bucket is not None and block.cached:
            self._free.remove(block)
            self._push_free(block, now)

    def evict_cached(self, n: int, where: Callable[[KVCacheBlock], bool] | None = None) -> int:
        """Evict up to ``n`` free cached blocks in eviction order (only those ``where`` accepts, every one judged
        before any is evicted); returns how many."""
        self._expire_priorities()
        victims = []
        for block in self._free:
            if len(victims) >= n:
                break
            if block.cached and (where is None or where(block)):
                victims.append(block)
        for block in victims:
            self._evict(block)
        return len(victims)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and emit AllBlocksCleared; refused (False) while any block is in use."""
        if self.num_used_blocks > 0:
            return False
        for block in self.blocks[1:]:
            self.uncache(block, emit=False)
        self._expiry_heap.clear()
        self.events.append(AllBlocksCleared())
        return True

    # ---- introspection --------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        self._expire_priorities()
        now = self.clock()
        by_prio: dict[int, int] = {}
        cached = evictable = 0
        for block in self.blocks[1:]:
            if block.cached:
                cached += 1
                evictable += block.ref_cnt == 0
                p = block.effective_priority(now)
                by_prio[p] = by_prio.get(p, 0) + 1
        return PoolStats(
            num_blocks=self.num_usable_blocks, used=self.num_used_blocks, free=self.num_free_blocks,
            cached=cached, evictable=evictable, cached_by_priority=dict(sorted(by_prio.items())),
            evictions=self.num_evictions, allocated=self.allocated - 1,
        )

    def cached_by_tenant(self) -> dict:
        """Cached blocks (held or free) per tenant: cache salt, None for unsalted requests."""
        return self.quota.counts()

    def eviction_order(self) -> list[KVCacheBlock]:
        """Free blocks in the order allocations would take them (tests and cache inspection)."""
        self._expire_priorities()
        return list(self._free)

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (tests; O(num_blocks))."""
        free = list(self._free)
        assert len(free) == len(self._free) == len({b.block_id for b in free})
        assert self.null_block.free_bucket is None and not self.null_block.cached
        for block in self.blocks[1:self.allocated]:
            assert (block.ref_cnt == 0) == block.is_free, f"free-queue membership wrong for {block}"
            assert block.ref_cnt >= 0
        for block in self.blocks[self.allocated:]:
            assert block.ref_cnt == 0 and not block.is_free and not block.cached, f"reserve block in use: {block}"
        indexed = {b.block_id for d in self._by_parent.values() for b in d.values()}
        assert indexed == {b.block_id for b in self.blocks if b.cached}, "cache index out of sync"
        for (group_id, block_hash), same in self._by_hash.items():
            for block in same.values():
                assert block.cached and block.block_hash == block_hash and block.group_id == group_id
                assert len(block.token_ids) == self.block_size
        self.quota.check([b for b in self.blocks if b.cached])
