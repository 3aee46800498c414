"""Block-table operations of one sequence against the pool: attach a prefix hit, grow with copy-on-write,
cache verified full blocks, release what a window left behind, trim, fork and release.

Rule for every write: new K/V never lands in a block that another table holds or that the cache indexes.
Such a block is copied first (copy-on-write, a CopyOp) or, when this sequence is its only holder, dropped
from the cache. Only verified (committed) tokens ever enter the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv.kv.blocks.block import UNKNOWN_PARENT, KVCacheBlock
from mlxkv.kv.blocks.block_pool import BlockPool
from mlxkv.kv.blocks.coordinator import KVCacheCoordinator, PrefixHit
from mlxkv.kv.blocks.hashing import HashContext, HashFn, extend_block_hashes
from mlxkv.kv.blocks.seq_state import CopyOp, GroupTable, SequenceState
from mlxkv.kv.blocks.snapshots import StateSnapshotIndex, prefix_of
from mlxkv.kv.blocks.specs import KVCacheGroupSpec


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockTables:
    """Stateless helper over one pool: every method takes the sequence whose tables it changes."""

    def __init__(
        self, pool: BlockPool, specs: Sequence[KVCacheGroupSpec], hash_fn: HashFn, *, enable_block_reuse: bool,
        enable_partial_reuse: bool, copy_on_partial_reuse: bool, snapshots: StateSnapshotIndex | None = None,
    ) -> None:
        self.pool, self.specs, self.hash_fn = pool, list(specs), hash_fn
        self.block_size = pool.block_size
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_partial_reuse and enable_block_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.snapshots = snapshots  # recurrent layers: a hit also needs their state (snapshots.py)
        self.coordinator = KVCacheCoordinator(pool, self.specs, self.enable_partial_reuse)
        full = [g for g, spec in enumerate(self.specs) if spec.is_full]
        self.anchor_group = self.coordinator.anchor_group
        self.commit_order = full + [g for g in range(len(self.specs)) if g not in full]  # anchors first
        self.dropped_blocks = 0  # table entries overflow policies dropped so far (drop)
        self.restored_blocks = 0  # dropped entries the offload policy brought back (restore)

    # ---- prefix hits ----------------------------------------------------------------------------------
    def find(self, tokens: Sequence[int], hashes, ctx: HashContext) -> PrefixHit:
        """Longest usable hit; the last token is always left to compute (its logits are needed)."""
        if not self.enable_block_reuse:
            return PrefixHit(self.block_size, 0, [[] for _ in self.specs])
        hit = self.coordinator.find_prefix_hit(tokens, hashes, ctx, max_tokens=len(tokens) - 1)
        while self.snapshots is not None and hit.num_full_blocks:  # fixed point: lengths only shrink
            k = self.snapshots.deepest(hashes, lambda n: prefix_of(tokens, ctx, n, self.block_size),
                                       hit.num_full_blocks)
            if k == hit.num_full_blocks:
                break
            hit = self.coordinator.find_prefix_hit(tokens, hashes, ctx, max_tokens=k * self.block_size)
        return hit

    def attach(self, seq: SequenceState, hit: PrefixHit | None = None) -> tuple[int, list[CopyOp]]:
        """Take the prefix hit of a sequence with empty tables; returns (cached tokens, copies). ``hit``: the one
        :meth:`find` gave for its tokens while the pool's cache is unchanged since (not searched again)."""
        bs, pool = self.block_size, self.pool
        hashes = extend_block_hashes(self.hash_fn, seq.tokens, len(seq.tokens), bs, seq.ctx, seq.block_hashes)
        if hit is None:
            hit = self.find(seq.tokens, hashes, seq.ctx)
        now = pool.clock()
        for g, table in enumerate(seq.tables):
            blocks = hit.blocks[g]
            pool.touch(blocks, hit=True)
            for i, block in enumerate(blocks):
                pool.set_retention(block, *seq.retention.block_retention(i * bs, (i + 1) * bs, seq.prompt_len, now))
            table.blocks = list(blocks)
            table.refs = [None if b.is_null else b.ref for b in blocks]
            table.num_cached = hit.num_full_blocks
        copies = self._take_partial(seq, hit) if hit.partial else []
        n = hit.num_full_blocks * bs + (hit.num_partial_tokens if copies is not None else 0)
        seq.num_allocated = seq.num_committed = n
        return n, copies or []

    def _take_partial(self, seq: SequenceState, hit: PrefixHit) -> list[CopyOp] | None:
        """Append every group's partially matching block, taken or copied; None (nothing taken) if not
        possible."""
        pool, n = self.pool, hit.num_partial_tokens
        takes: list[KVCacheBlock] = []
        srcs: list[KVCacheBlock] = []
        for m in hit.partial:
            if m.block.ref_cnt == 0 and (m.block.block_hash is None or not self.copy_on_partial_reuse):
                takes.append(m.block)  # nobody holds it: write into it directly (it leaves the cache)
            elif self.copy_on_partial_reuse:
                srcs.append(m.block)  # held by another sequence, or a full block worth keeping: copy
            else:
                return None
        pool.touch(takes, hit=True)
        pool.touch(srcs, hit=True)  # pin copy sources so allocating the targets cannot evict them
        if len(srcs) > pool.num_free_blocks:
            pool.free_blocks(takes + srcs)
            return None
        dsts = iter(pool.get_new_blocks(len(srcs)))
        copies = []
        for g, m in enumerate(hit.partial):
            if any(m.block is t for t in takes):
                pool.uncache(m.block)
                seq.tables[g].blocks.append(m.block)
            else:
                dst = next(dsts)
                copies.append(CopyOp(g, m.block.block_id, dst.block_id, n))
                seq.unconfirmed_copies.add(dst.block_id)
                seq.tables[g].blocks.append(dst)
            seq.tables[g].refs.append(None)
        pool.free_blocks(srcs)
        return copies

    # ---- growing ------------------------------------------------------------------------------------------
    def release_skipped(self, seq: SequenceState) -> None:
        """Sliding/chunked groups: release blocks no future token attends to (they stay cached)."""
        for spec, table in zip(self.specs, seq.tables):
            if spec.is_full:
                continue
            stop = min(spec.first_needed(seq.num_committed) // self.block_size, len(table.blocks))
            if stop <= table.num_released:
                continue
            gone = [table.blocks[i] for i in range(table.num_released, stop) if not table.blocks[i].is_null]
            for i in range(table.num_released, stop):
                table.blocks[i] = self.pool.null_block
            table.num_released = stop
            self.pool.free_blocks(gone[::-1])

    def blocks_needed(self, seq: SequenceState, n: int) -> int:
        """New blocks ``grow(seq, n)`` takes from the pool."""
        bs, start, total = self.block_size, seq.num_allocated, 0
        for table in seq.tables:
            total += ceil_div(start + n, bs) - len(table.blocks)
            if n > 0 and start % bs and table.blocks[start // bs].ref_cnt > 1:
                total += 1  # copy-on-write of a shared tail
        return total

    def grow(self, seq: SequenceState, n: int) -> tuple[list[CopyOp], list[list[int]]]:
        """Slots for positions ``[num_allocated, num_allocated + n)`` (the caller checked they fit)."""
        bs, start = self.block_size, seq.num_allocated
        copies: list[CopyOp] = []
        new_blocks: list[list[int]] = []
        for g, table in enumerate(seq.tables):
            if n > 0 and start % bs:
                self._make_writable(g, table, start // bs, start % bs, copies)
            last = table.blocks[-1] if table.blocks else None
            after = None if last is None or last.is_null else last.block_id  # keep the table's pages consecutive
            new = self.pool.get_new_blocks(ceil_div(start + n, bs) - len(table.blocks), after=after)
            table.blocks.extend(new)
            table.refs.extend([None] * len(new))
            new_blocks.append([b.block_id for b in new])
        seq.num_allocated += n
        seq.unconfirmed_copies.update(c.dst_block for c in copies)
        return copies, new_blocks

    def _make_writable(self, g: int, table: GroupTable, idx: int, used: int, copies: list[CopyOp]) -> None:
        block = table.blocks[idx]
        assert not block.is_null, "the block receiving new tokens is never released"
        if block.ref_cnt > 1:  # shared (fork, or a hit block cut by trim): copy-on-write
            (dst,) = self.pool.get_new_blocks(1)
            copies.append(CopyOp(g, block.block_id, dst.block_id, used))
            self.pool.free_blocks([block])
            table.blocks[idx] = dst
        elif block.cached:  # ours alone but cached: its content is about to change
            self.pool.uncache(block)
        table.refs[idx] = None
        table.num_cached = min(table.num_cached, idx)

    # ---- caching verified blocks --------------------------------------------------------------------------
    def cache_full_blocks(self, seq: SequenceState) -> None:
        """Cache every full block of verified tokens not cached yet (full-attention groups first: their
        refs anchor the windowed groups' blocks)."""
        if not self.enable_block_reuse:
            return
        bs, pool = self.block_size, self.pool
        full = seq.num_committed // bs
        if seq.cache_limit is not None:
            full = min(full, seq.cache_limit)
        hashes = extend_block_hashes(self.hash_fn, seq.tokens, full * bs, bs, seq.ctx, seq.block_hashes)
        now = pool.clock()
        anchors = seq.tables[self.anchor_group] if self.anchor_group is not None else None
        for g in self.commit_order:
            table = seq.tables[g]
            for i in range(table.num_cached, full):
                block = table.blocks[i]
                if block.is_null:
                    continue
                tokens = tuple(seq.tokens[i * bs : (i + 1) * bs])
                if block.cached and block.block_hash is None:
                    # registered as a partial block when a sharer finished; it has filled up since
                    assert block.token_ids == tokens[: len(block.token_ids)]
                    pool.uncache(block)
                if block.cached:
                    assert block.token_ids == tokens, "a shared cached block must hold this sequence's tokens"
                else:
                    rule = seq.retention.block_retention(i * bs, (i + 1) * bs, seq.prompt_len, now)
                    pool.set_retention(block, *rule, merge=False)
                    pool.cache_full_block(
                        block, group_id=g, block_hash=hashes[i], parent_hash=hashes[i - 1] if i else None,
                        parent_ref=None if i == 0 else (table.refs[i - 1] or UNKNOWN_PARENT),
                        token_ids=tokens, extra_keys=seq.ctx.block_extra_keys(i, bs),
                        anchor=None if self.specs[g].is_full or anchors is None else anchors.refs[i],
                    )
                table.refs[i] = block.ref
            table.num_cached = max(table.num_cached, full)

    # ---- shrinking, sharing, releasing ----------------------------------------------------------------
    def trimmable_to(self, seq: SequenceState, target: int) -> int:
        """The shortest length >= target whose needed blocks are held or still cached."""
        while target < seq.num_allocated and not self._restorable(seq, target):
            target += 1
        return target

    def _restorable(self, seq: SequenceState, length: int) -> bool:
        for spec, table in zip(self.specs, seq.tables):
            if not spec.is_full:
                for i in spec.needed_blocks(length, self.block_size):
                    if table.blocks[i].is_null and self.pool.resolve(table.refs[i]) is None:
                        return False
        return True

    def trim(self, seq: SequenceState, target: int) -> None:
        """Shrink to ``target`` positions (from ``trimmable_to``): release emptied blocks tail first and take
        back released blocks the shorter sequence needs again."""
        bs, pool = self.block_size, self.pool
        for spec, table in zip(self.specs, seq.tables):
            keep = ceil_div(target, bs)
            dropped = table.blocks[keep:]
            del table.blocks[keep:], table.refs[keep:]
            pool.free_blocks(dropped[::-1])
            table.dropped = {i for i in table.dropped if i < keep}
            table.num_cached = min(table.num_cached, target // bs)
            if not spec.is_full:
                needed = spec.needed_blocks(target, bs)
                table.num_released = min(table.num_released, needed.start)
                for i in needed:
                    if table.blocks[i].is_null:
                        block = pool.resolve(table.refs[i])
                        pool.touch([block], hit=False)
                        table.blocks[i] = block
        del seq.tokens[target:]
        del seq.block_hashes[target // bs :]
        seq.num_allocated = target
        seq.num_committed = min(seq.num_committed, target)

    def share(self, seq: SequenceState) -> list[GroupTable]:
        """Copies of a sequence's tables holding one more reference on every block (fork)."""
        tables = [GroupTable(list(t.blocks), list(t.refs), t.num_cached, t.num_released, set(t.dropped))
                  for t in seq.tables]
        for table in tables:
            self.pool.touch(table.blocks, hit=False)
        return tables

    def release(self, seq: SequenceState) -> None:
        """Release every block tail first; a verified partial tail stays findable for partial reuse."""
        bs, pool = self.block_size, self.pool
        idx, used = divmod(seq.num_committed, bs)
        now = pool.clock()
        for g, table in enumerate(seq.tables):
            if (self.enable_partial_reuse and used and idx < len(table.blocks)
                    and (seq.cache_limit is None or idx < seq.cache_limit)):
                block = table.blocks[idx]
                # skip a copy target whose copy may never have run (no commit since)
                if not block.is_null and not block.cached and block.block_id not in seq.unconfirmed_copies:
                    rule = seq.retention.block_retention(idx * bs, seq.num_committed, seq.prompt_len, now)
                    pool.set_retention(block, *rule, merge=False)
                    pool.cache_partial_block(
                        block, group_id=g, parent_ref=None if idx == 0 else (table.refs[idx - 1] or UNKNOWN_PARENT),
                        token_ids=seq.tokens[idx * bs : seq.num_committed], extra_keys=seq.ctx.block_extra_keys(idx, bs),
                    )
            pool.free_blocks(table.blocks[::-1])
        for table in seq.tables:
            table.blocks, table.refs, table.num_cached, table.num_released = [], [], 0, 0
            table.dropped = set()

    def drop(self, seq: SequenceState, group: int, indices: Sequence[int]) -> None:
        """Drop this sequence's reference to blocks ``indices`` of a full-attention ``group`` (an overflow
        policy evicting whole pages): their entries become the null block; a block another table or the prefix
        cache holds stays for them. Blocks written from here on are never cached for this sequence."""
        table, bs = seq.tables[group], self.block_size
        assert self.specs[group].is_full, "only full-attention groups drop blocks (windows release their own)"
        tail = (seq.num_allocated - 1) // bs
        gone = []
        for i in indices:
            assert 0 <= i < tail and i not in table.dropped, f"block {i} cannot be dropped (tail {tail})"
            gone.append(table.blocks[i])
            table.blocks[i] = self.pool.null_block
            table.dropped.add(i)
        limit = seq.num_allocated // bs
        seq.cache_limit = limit if seq.cache_limit is None else min(seq.cache_limit, limit)
        self.dropped_blocks += len(gone)
        self.pool.free_blocks(gone)

    def restore(self, seq: SequenceState, group: int, index: int) -> int | None:
        """Give dropped entry ``index`` of full-attention ``group`` a new block (the offload policy writes the
        page's K/V back into it); returns its id, or None when the pool has no free block. The block never
        enters the prefix cache: its page attended a reduced context before it was offloaded."""
        table = seq.tables[group]
        assert index in table.dropped, f"block {index} was not dropped"
        if self.pool.num_free_blocks < 1:
            return None
        (block,) = self.pool.get_new_blocks(1)
        table.blocks[index] = block
        table.dropped.discard(index)
        if index >= table.num_cached:  # caching resumes at num_cached: keep it from reaching this entry
            seq.cache_limit = index if seq.cache_limit is None else min(seq.cache_limit, index)
        self.restored_blocks += 1
        return block.block_id
