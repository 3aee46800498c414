"""Recurrent-state snapshots in the block pool: the bookkeeping (pure Python; the arrays are opaque payloads).

A model with recurrent layers (mlx-lm ``ArraysCache``: conv + SSM / gated-delta state) can resume a prompt from
cached attention blocks only if it also has every recurrent layer's state at that position. A *snapshot* is that
state after the first ``k`` full blocks of a sequence, keyed like the attention blocks: by the chained hash of
block ``k - 1`` (salt and extra keys included), so it is valid for any prompt whose first ``k * block_size``
tokens match. Content is checked, not trusted to the hash: a snapshot records the prefix it follows (its
tokens and every block's extra keys), and a hit must match it exactly. (A ref of the attention block it
follows would be cheaper, but a prefix is often cached twice, in blocks of two sequences that computed it
side by side; the hit search may verify either chain.)

Memory is the pool's: a snapshot holds ``blocks_per_snapshot`` pool blocks (its state bytes over one block's
K/V bytes, rounded up). They are cached blocks of their own group (``group_id``, after the attention groups),
free while no one reads them, so they sit in the pool's free queue and are evicted by the same policy
(priority, then LRU) as attention blocks, with the retention priority of the block they follow. Evicting
any of a snapshot's blocks drops the whole snapshot (its other blocks become plain free blocks). Payloads
are immutable arrays: a hit shares them (copy-on-write by construction), nothing is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.kv.blocks.block import BlockHash, BlockRef, KVCacheBlock
from mlxkv.kv.blocks.hashing import HashContext


def prefix_of(tokens: Sequence[int], ctx: HashContext, num_blocks: int, block_size: int) -> tuple:
    """The identity of a sequence's first ``num_blocks`` blocks: their tokens and each block's extra keys."""
    return (tuple(tokens[: num_blocks * block_size]),
            tuple(ctx.block_extra_keys(i, block_size) for i in range(num_blocks)))
from mlxkv.kv.blocks.block_pool import BlockPool


@dataclass(slots=True, eq=False)
class StateSnapshot:
    """One stored snapshot. Owned by :class:`StateSnapshotIndex`."""

    key: BlockHash  # chained hash of the block it follows
    num_blocks: int  # k: the state after the first k full blocks (k * block_size tokens)
    prefix: tuple  # (tokens of the first k blocks, their extra keys per block): what it is the state after
    blocks: list[KVCacheBlock]  # pool blocks holding its budget
    refs: list[BlockRef]  # their content refs when stored (any changed: the snapshot is gone)
    payload: Any  # the recurrent layers' state arrays (opaque here)


class StateSnapshotIndex:
    """Snapshots of recurrent state at block boundaries, stored in ``pool``'s budget.

    Args:
        pool: the block pool whose blocks carry the snapshots' memory.
        group_id: the pool group id of snapshot blocks (one past the attention groups).
        blocks_per_snapshot: pool blocks one snapshot costs (>= 1).
    """

    def __init__(self, pool: BlockPool, group_id: int, blocks_per_snapshot: int):
        if blocks_per_snapshot < 1:
            raise ValueError(f"blocks_per_snapshot={blocks_per_snapshot}: expected >= 1")
        self.pool = pool
        self.group_id = group_id
        self.blocks_per_snapshot = blocks_per_snapshot
        self._by_key: dict[BlockHash, list[StateSnapshot]] = {}
        self._by_block: dict[int, StateSnapshot] = {}
        self.stored = self.hits = self.dropped = self.skipped = 0  # counters for stats
        # called with a snapshot about to be evicted, payload still set (the secondary tier offloads it)
        self.on_evict: Callable[[StateSnapshot, KVCacheBlock], None] | None = None
        pool.add_evict_hook(self._on_evict)

    # ---- storing ----------------------------------------------------------------------------------------
    def put(self, key: BlockHash, num_blocks: int, prefix: tuple, token_ids: Sequence[int], extra_keys: tuple,
            retention: tuple[int, float | None], payload: Any) -> bool:
        """Store the state after the ``num_blocks`` blocks ``prefix`` (see :class:`StateSnapshot`) whose last block
        has hash ``key`` (``token_ids``: that block's, ``extra_keys``: the first block's, whose salt makes the
        snapshot's tenant, for the pool's index and quota). A live snapshot of the same prefix is refreshed
        instead. False when the pool has no free block for it (nothing is evicted then that an
        allocation would not evict anyway: the pool's policy picks the victims)."""
        for snap in self._by_key.get(key, ()):
            if snap.prefix == prefix and self._live(snap):
                self._refresh(snap)
                return True
        pool, k = self.pool, self.blocks_per_snapshot
        if pool.num_free_blocks < k:
            self.skipped += 1
            return False
        blocks = pool.get_new_blocks(k)  # held (ref 1) while registered: the pool caches only held blocks
        for block in blocks:
            pool.set_retention(block, *retention, merge=False)
            pool.cache_full_block(block, group_id=self.group_id, block_hash=key, parent_hash=None, parent_ref=None,
                                  token_ids=token_ids, extra_keys=extra_keys)
        snap = StateSnapshot(key, num_blocks, prefix, blocks, [b.ref for b in blocks], payload)
        self._by_key.setdefault(key, []).append(snap)
        for block in blocks:
            self._by_block[block.block_id] = snap
        pool.free_blocks(blocks)  # free and cached: evictable in policy order from now on
        self.stored += 1
        return True

    # ---- finding ----------------------------------------------------------------------------------------
    def find(self, key: BlockHash, prefix: Callable[[], tuple]) -> StateSnapshot | None:
        """The live snapshot after the block with hash ``key`` whose prefix is ``prefix()`` (built only when the
        hash matches), or None."""
        same = self._by_key.get(key)
        if not same:
            return None
        want = prefix()
        for snap in same:
            if snap.prefix == want and self._live(snap):
                return snap
        return None

    def live(self, key: BlockHash) -> StateSnapshot | None:
        """A live snapshot after the block with hash ``key`` (any prefix), or None."""
        return next((s for s in self._by_key.get(key, ()) if self._live(s)), None)

    def deepest(self, hashes: Sequence[BlockHash], prefix: Callable[[int], tuple], max_blocks: int) -> int:
        """The largest ``k <= max_blocks`` with a snapshot after block ``k - 1`` (``prefix(k)``: the request's
        first ``k`` blocks in :class:`StateSnapshot` form); 0 when there is none."""
        for k in range(min(max_blocks, len(hashes)), 0, -1):
            if self.find(hashes[k - 1], lambda: prefix(k)) is not None:
                return k
        return 0

    def take(self, key: BlockHash, prefix: Callable[[], tuple]) -> Any:
        """The payload of a hit (counted, and its blocks moved to the back of the eviction order)."""
        snap = self.find(key, prefix)
        assert snap is not None, "take() follows a deepest() that found this snapshot"
        self._refresh(snap)
        self.hits += 1
        return snap.payload

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _live(self, snap: StateSnapshot) -> bool:
        return all(self.pool.resolve(r) is b for r, b in zip(snap.refs, snap.blocks))

    def _refresh(self, snap: StateSnapshot) -> None:
        self.pool.touch(snap.blocks, hit=True)  # a use: LRU stamps renewed, as for a hit on attention blocks
        self.pool.free_blocks(snap.blocks)

    def _on_evict(self, block: KVCacheBlock) -> None:
        """Pool hook: a snapshot block is being evicted; the whole snapshot goes (its other blocks uncached)."""
        snap = self._by_block.get(block.block_id)
        if snap is None or block.group_id != self.group_id:
            return
        if self.on_evict is not None and self._live(snap):
            self.on_evict(snap, block)
        self._drop(snap, except_block=block)

    def _drop(self, snap: StateSnapshot, except_block: KVCacheBlock | None = None) -> None:
        for b in snap.blocks:
            self._by_block.pop(b.block_id, None)
            if b is not except_block and self.pool.resolve(b.ref) is b and b.ref in snap.refs:
                self.pool.uncache(b)
        same = self._by_key.get(snap.key, [])
        if snap in same:
            same.remove(snap)
        if not same:
            self._by_key.pop(snap.key, None)
        snap.payload = None
        self.dropped += 1

    def prune(self) -> None:
        """Forget snapshots whose blocks lost their content without an eviction (a prefix-cache reset)."""
        for snap in [s for same in self._by_key.values() for s in same if not self._live(s)]:
            self._drop(snap)

    def __len__(self) -> int:
        """Live snapshots."""
        return sum(1 for same in self._by_key.values() for s in same if self._live(s))

    def stats(self) -> dict:
        """Counters and sizes for ``/v1/cache/stats``."""
        self.prune()
        n = len(self)
        return {"count": n, "blocks": n * self.blocks_per_snapshot, "blocks_per_snapshot": self.blocks_per_snapshot,
                "stored": self.stored, "hits": self.hits, "evicted": self.dropped, "skipped_no_room": self.skipped}

    def check_invariants(self) -> None:
        """Every indexed block belongs to its snapshot; live snapshots' blocks are cached in the state group."""
        for bid, snap in self._by_block.items():
            assert any(b.block_id == bid for b in snap.blocks)
        for same in self._by_key.values():
            for snap in same:
                if self._live(snap):
                    assert all(b.cached and b.group_id == self.group_id for b in snap.blocks)
