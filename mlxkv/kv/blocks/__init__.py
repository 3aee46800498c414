"""Paged KV block manager: pure Python (no MLX), testable alone.

What the storage layer needs (and all it needs)
-----------------------------------------------
Page arrays, per layer: ``keys[kv_heads, num_blocks, block_size, head_dim]`` (values alike), indexed by
block id on the second axis. Block 0 is the *null block*: a placeholder that is never written or read for real K/V.

Layers are grouped by attention type into KV-cache groups (``KVCacheGroupSpec``: "full", "sliding" with a
window W, "chunked" with a chunk size C); every group shares the pool and the block size. Block ids are
global: a block in use belongs to one group, so a layer of group ``g`` reads and writes only blocks from
``g``'s tables. (Simplest storage: each layer has its own page array of ``num_blocks`` pages. Tighter,
vLLM-style: groups with equal layer counts share arrays, layer j of every group using array j.)

From ``KVCacheManager`` the storage layer receives three things:

1. **Block tables**, ``manager.block_tables(seq_id) -> [table_of_group_0, ...]``: block ids; table[i]
   holds positions ``[i*B, (i+1)*B)``. A sliding/chunked group has the null block (0) for positions its
   layers no longer attend to; attention must mask them (they are outside the window/chunk anyway).
2. **Slot mappings** for new tokens, ``SlotAllocation.slot_mapping[g][k]`` (or
   ``manager.slot_mapping(seq_id, start, end)``): flat slot ``block_id * B + offset`` where the K/V of the
   k-th new token goes: row ``offset`` of page ``block_id``, for every kv head.
3. **Copy instructions**, ``CopyOp(group_id, src_block, dst_block, num_tokens)`` from ``open``/``resume``
   (partial prefix reuse) and ``allocate_slots`` (copy-on-write): copy rows ``[0, num_tokens)`` of page
   ``src_block`` into page ``dst_block`` in every layer of ``group_id``. Apply them, in order, before the
   next model step writes any K/V.

Engine protocol
---------------
``open(prompt, salt=, extra=, spans=, retention=, priority=)`` → ``OpenResult`` (seq id, cached tokens,
copies); ``allocate_slots(seq, n | token_ids=)`` → ``SlotAllocation`` or None when blocks run
out; after the model step ``commit(seq, n)`` marks tokens verified (only verified full blocks are cached);
``trim(seq, n)`` drops rejected drafts; ``fork(seq, n)``; ``free(seq)`` (also to preempt: the freed blocks stay
cached, so opening the sequence again over its tokens is a prefix hit).
``choose_victim`` / ``stats`` / ``events`` for the scheduler and metrics.

Modules: block (KVCacheBlock, null block), free_queue, hashing (chained hashes, salt), retention
(priorities), eviction (policies), events (ring buffer), block_pool, specs (groups), coordinator (hit
search), tables (per-sequence operations), sequence (records), manager (the API).
"""

from mlxkv.kv.blocks.block import DEFAULT_PRIORITY, NULL_BLOCK_ID, KVCacheBlock
from mlxkv.kv.blocks.block_pool import BlockPool, NoFreeBlocksError, PoolStats
from mlxkv.kv.blocks.coordinator import KVCacheCoordinator, PartialMatch, PrefixHit
from mlxkv.kv.blocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBuffer,
)
from mlxkv.kv.blocks.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityLRUPolicy,
)
from mlxkv.kv.blocks.hashing import HASH_ALGOS, HashContext, make_hash_fn
from mlxkv.kv.blocks.manager import KVCacheManager
from mlxkv.kv.blocks.retention import RetentionConfig, TokenRangeRetention
from mlxkv.kv.blocks.seq_state import (
    CopyOp,
    ManagerStats,
    OpenResult,
    SlotAllocation,
    slot_mapping,
)
from mlxkv.kv.blocks.specs import KVCacheGroupSpec

__all__ = [
    "DEFAULT_PRIORITY",
    "EVICTION_POLICIES",
    "HASH_ALGOS",
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CopyOp",
    "EventBatch",
    "EvictionPolicy",
    "HashContext",
    "KVCacheBlock",
    "KVCacheCoordinator",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVEventBuffer",
    "LFUPolicy",
    "LRUPolicy",
    "ManagerStats",
    "NoFreeBlocksError",
    "OpenResult",
    "PartialMatch",
    "PoolStats",
    "PrefixHit",
    "PriorityLRUPolicy",
    "RetentionConfig",
    "SlotAllocation",
    "TokenRangeRetention",
    "make_hash_fn",
    "slot_mapping",
]
