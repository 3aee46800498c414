"""PagedKVStorage: a :class:`~mlxkv.kv.store.CachePool`'s sequences in pages of one block pool
(:class:`mlxkv.kv.paged.PagedBackend`), behind the :class:`~mlxkv.kv.storage.Storage` protocol.

Every sequence is registered with the block manager over its tokens (taking its prefix hit); room, preemption
victims, forks (shared blocks), the prefix cache and the secondary tier are the manager's and the backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxkv.kv.admission import blocks_needed, max_paged_tokens
from mlxkv.kv.blocks.block_map import block_map
from mlxkv.kv.sequence import DenseSlots
from mlxkv.kv.storage import NO_TIER, TierIO
from mlxkv.kv.storage_stats import paged_stats

if TYPE_CHECKING:
    from mlxkv.kv.blocks.events import EventBatch
    from mlxkv.kv.paged import PagedBackend
    from mlxkv.kv.sequence import Sequence


class PagedKVStorage:
    """Paged storage over ``backend``; keeps which pool sequence each manager sequence is (preemption victims)."""

    is_paged = True

    def __init__(self, backend: PagedBackend):
        self.paged = backend
        self.manager = backend.manager
        self.tier: TierIO = backend.tier if backend.tier is not None else NO_TIER
        self._by_manager_id: dict[int, Sequence] = {}

    @property
    def prefix_caching(self) -> bool:
        return self.manager.pool.enable_caching

    @property
    def state_snapshots(self) -> bool:
        return self.manager.snapshots is not None

    def check_overflow(self, overflow: Any) -> None:
        self.paged.check_overflow(overflow)

    # ---- sequences ----------------------------------------------------------------------------------------
    def attach(self, seq: Sequence, tokens: list[int] | None) -> None:
        if not tokens:
            raise ValueError("backend='paged': open() needs the prompt token ids (prompt=[...])")
        seq.caches, seq.paged = self.paged.open(tokens, seq.cache_request)
        seq.slots = seq.paged
        seq.prompt_length = seq.prompt_length or len(tokens)
        self._by_manager_id[seq.paged.seq_id] = seq

    def detach(self, seq: Sequence) -> None:
        seq.caches = []  # drop our references so MLX can free the buffers
        if seq.paged is not None:
            self._by_manager_id.pop(seq.paged.seq_id, None)
            self.paged.release(seq.paged)  # blocks back to the pool, tail first; verified ones stay cached
            seq.paged = None
            seq.slots = DenseSlots(seq)  # no blocks held: nothing to feed or commit until resumed

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        pairs = self.paged.fork(parent.paged, parent.caches, len(children))
        for child, (caches, paged) in zip(children, pairs):
            child.caches, child.paged, child.slots = caches, paged, paged
            self._by_manager_id[paged.seq_id] = child

    # ---- room -------------------------------------------------------------------------------------------------
    def can_extend(self, seq: Sequence, num_tokens: int) -> bool:
        return self.manager.can_allocate(seq.paged.seq_id, num_tokens)

    def victim_for(self, seq: Sequence) -> Sequence | None:
        victim = self.manager.choose_victim(requester=seq.paged.seq_id)
        return None if victim is None else self._by_manager_id[victim]

    def admission_cost(self, num_tokens: int) -> int:
        return blocks_needed(self.manager.specs, self.paged.block_size, num_tokens)

    def free_capacity(self) -> int:
        return self.manager.pool.num_free_blocks

    def has_decode_headroom(self, num_sequences: int) -> bool:
        return self.free_capacity() >= num_sequences * 2 * len(self.manager.specs)

    def max_sequence_tokens(self) -> int:
        return max_paged_tokens(self.manager)

    # ---- the prefix cache and the pool's memory ---------------------------------------------------------------
    def evict_cached(self, salt: str | None) -> int:
        pool = self.manager.pool
        if salt is None:
            n = pool.evict_cached(pool.stats().evictable)
            pool.reset_prefix_cache()  # refused (no event) while blocks are in use
            return n
        return pool.evict_cached(pool.stats().evictable, where=lambda b: b.tenant == salt)  # tenant: chain's salt

    def release_due_in(self) -> float | None:
        return self.paged.release_due_in()

    def release_unused(self) -> int:
        return self.paged.release_unused()

    # ---- what it holds ----------------------------------------------------------------------------------------
    def kv_events(self, since: int) -> EventBatch:
        return self.manager.events.read(since)

    def block_map(self) -> dict:
        return block_map(self.manager.pool)

    def stats(self) -> dict:
        return paged_stats(self.paged)

    def check_invariants(self, sequences: list[Sequence]) -> None:
        self.paged.check_invariants()
        open_ids = sorted(s.paged.seq_id for s in sequences if s.paged is not None)
        assert open_ids == sorted(self.paged.sequences) == sorted(self._by_manager_id)
