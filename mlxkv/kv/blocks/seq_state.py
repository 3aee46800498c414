"""Per-sequence state of the manager, and the small records it hands to the engine and storage layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxkv.kv.blocks.block import BlockHash, BlockRef, KVCacheBlock
from mlxkv.kv.blocks.block_pool import PoolStats
from mlxkv.kv.blocks.hashing import HashContext
from mlxkv.kv.blocks.retention import RetentionConfig


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Storage instruction: copy token rows ``[0, num_tokens)`` of block ``src_block`` into ``dst_block`` in
    every layer of group ``group_id``. Apply before the next model step writes any K/V."""

    group_id: int
    src_block: int
    dst_block: int
    num_tokens: int


@dataclass(slots=True)
class OpenResult:
    """What ``open`` / ``resume`` found: the first ``num_cached_tokens`` tokens need no compute."""

    seq_id: int
    num_cached_tokens: int
    copies: list[CopyOp]
    block_tables: list[list[int]]
    state: object = None  # recurrent-state snapshot payload at num_cached_tokens (models with recurrent layers)


@dataclass(slots=True)
class SlotAllocation:
    """Slots for tokens at positions ``[start, start + num_tokens)``.

    slot_mapping: per group, the flat slot (``block_id * block_size + offset``) of each new token.
    new_blocks: per group, the block ids appended to the block table.
    copies: copy-on-write instructions to apply before writing.
    """

    seq_id: int
    start: int
    num_tokens: int
    slot_mapping: list[list[int]]
    new_blocks: list[list[int]]
    copies: list[CopyOp] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    prompt_tokens: int  # tokens of opened prompts (a preempted sequence opened again counts again)
    hit_tokens: int  # of those, tokens served from the prefix cache
    running: int  # open sequences
    pool: PoolStats

    @property
    def hit_rate(self) -> float:
        """Token-weighted prefix hit rate."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True, eq=False)
class GroupTable:
    """One sequence's block table in one group."""

    blocks: list[KVCacheBlock] = field(default_factory=list)  # block i holds positions [i*B, (i+1)*B)
    refs: list[BlockRef | None] = field(default_factory=list)  # content ref of block i once cached/hit
    num_cached: int = 0  # leading blocks already cached (committed or hit)
    num_released: int = 0  # sliding/chunked: leading entries already replaced by the null block
    dropped: set[int] = field(default_factory=set)  # full groups: entries an overflow policy dropped (null block)


@dataclass(slots=True, eq=False)
class SequenceState:
    """Owned by KVCacheManager; the engine sees it only through the manager's methods."""

    seq_id: int
    tokens: list[int]  # known tokens: [0, num_allocated) have slots, the rest are prompt tokens pending
    prompt_len: int
    ctx: HashContext
    retention: RetentionConfig
    priority: int  # scheduling priority: higher is preempted later
    arrival: int  # open/fork order: among equal priorities the newest is preempted first
    tables: list[GroupTable]
    block_hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks of `tokens`
    num_allocated: int = 0  # positions with a slot
    num_committed: int = 0  # positions whose K/V is written and verified (cacheable)
    unconfirmed_copies: set[int] = field(default_factory=set)  # copy targets not yet followed by a commit
    # leading blocks that may enter the prefix cache (None: all): blocks written after an overflow policy first
    # dropped blocks attended to a reduced context, so no full-context request may hit them
    cache_limit: int | None = None


def slot_mapping(block_table: Sequence[int], positions: Sequence[int], block_size: int) -> list[int]:
    """Flat slot index of each position: ``block_table[p // B] * B + p % B`` (page arrays viewed as
    ``[num_blocks * block_size, ...]``)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
