"""The unit of paged KV storage: one block of ``block_size`` token slots, and its metadata.

A block's K/V rows live in the storage layer's page arrays at index ``block_id``; this record only says who
holds the block, what content it is known to hold (when cached), and where it sits in the free queue.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

NULL_BLOCK_ID = 0
"""Block id 0 is the null block: a placeholder in block tables for positions a layer no longer needs
(tokens that left a sliding window, finished chunks). It is never allocated, freed, cached or evicted."""

DEFAULT_PRIORITY = 35
"""Retention priority of a block that no rule raised or lowered (TensorRT-LLM's default)."""

BlockHash = bytes | int | Hashable
BlockRef = tuple[int, int]
"""``(block_id, generation)``: names one cached *content* of a block. The generation changes whenever the
block is cached or uncached, so a stale ref never matches a block that was evicted and refilled."""

ROOT_PARENT: BlockRef | None = None
"""Parent ref of the first block of a sequence."""

UNKNOWN_PARENT: BlockRef = (-1, -1)
"""Parent ref of a block whose predecessor's identity is unknown (sliding-window hits start mid-chain).
It never equals a real ref, so such a block can only be matched where a parent check is not required."""


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV block. Compared by identity. Field owners are given per field."""

    block_id: int  # fixed at creation; index into every page array of the block's group
    ref_cnt: int = 0  # BlockPool only (get_new_blocks / touch / free_blocks): number of block tables holding it
    # --- cache identity: BlockPool only (cache_full_block / cache_partial_block / uncache) -----------------
    cached: bool = False  # in the pool's cache index (full blocks by hash, every cached block by parent)
    block_hash: BlockHash | None = None  # chained hash; set only for a cached *full* block
    group_id: int = -1  # KV-cache group whose cache index holds the block (valid while cached)
    token_ids: tuple[int, ...] = ()  # tokens whose K/V the cached content holds (len < block_size: partial)
    extra_keys: tuple = ()  # extra hash keys of the cached content (salt on first blocks, LoRA, media...)
    parent: BlockRef | None = None  # ref of the chain predecessor when cached (None: first block)
    anchor: BlockRef | None = None  # sliding/chunked groups: ref of the full-attention block at the same
    #                                    index of the sequence that filled it (pins the whole prefix)
    tenant: Hashable = None  # cache salt of the chain's first block (None: unsalted), for the pool's quota
    generation: int = 0  # bumped on every cache / uncache; see BlockRef
    # --- retention: BlockPool only (set_retention; read by eviction policies) --------------------------
    priority: int = DEFAULT_PRIORITY  # 0..100, higher is kept longer
    priority_expiry: float | None = None  # clock time when `priority` falls back to DEFAULT_PRIORITY
    last_access: float = 0.0  # clock time of the last touch or free
    hit_count: int = 0  # prefix-cache hits since the block was last cached (LFU)
    # --- free queue links: FreeBlockQueue / BucketedFreeQueue only ----------------------------------------
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    free_bucket: int | None = None  # bucket of the free queue holding it; None while not free
    free_stamp: int = 0  # order inside its bucket (smaller is evicted first)
    is_null: bool = False  # fixed at creation: the null block

    @property
    def ref(self) -> BlockRef:
        """The ref naming this block's current cached content."""
        return (self.block_id, self.generation)

    @property
    def is_free(self) -> bool:
        """True while the block sits in the free queue (ref_cnt == 0, evictable or unused)."""
        return self.free_bucket is not None

    def effective_priority(self, now: float) -> int:
        """Retention priority at clock time ``now``: an expired priority reads as DEFAULT_PRIORITY."""
        if self.priority_expiry is not None and now >= self.priority_expiry:
            return DEFAULT_PRIORITY
        return self.priority

    def __repr__(self) -> str:
        state = "null" if self.is_null else ("cached" if self.cached else "plain")
        return (
            f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, {state}, "
            f"tokens={len(self.token_ids)}, prio={self.priority}, free={self.is_free})"
        )
