"""KVCacheManager: the per-sequence API the engine uses over one pool and one or more KV-cache groups.

Lifecycle of a sequence (positions are token indices):

    res = m.open(prompt, salt=..., retention=...)     # prefix hit: res.num_cached_tokens need no compute
    a = m.allocate_slots(res.seq_id, n)               # slots for the next n prompt tokens (or token_ids=...)
    ...model step writes K/V at a.slot_mapping (after applying res.copies / a.copies)...
    m.commit(res.seq_id)                              # those tokens are verified: full blocks become cached
    m.trim(seq_id, k)                                 # drop the last k tokens (rejected drafts)
    m.fork(seq_id, n) / m.preempt(seq_id) / m.resume(seq_id) / m.free(seq_id)

Writes never land in a block that another table holds or that is cached: the block is copied first
(copy-on-write, returned as CopyOp) or, when this sequence is its only holder, dropped from the cache.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Union

from mlxkv.blocks.block import UNKNOWN_PARENT, KVCacheBlock
from mlxkv.blocks.block_pool import BlockPool
from mlxkv.blocks.coordinator import KVCacheCoordinator, PrefixHit
from mlxkv.blocks.eviction import EvictionPolicy
from mlxkv.blocks.events import KVEventBuffer
from mlxkv.blocks.hashing import HashContext, HashFn, extend_block_hashes, make_hash_fn
from mlxkv.blocks.retention import DEFAULT_RETENTION, RetentionConfig
from mlxkv.blocks.sequence import (
    CopyOp, GroupTable, ManagerStats, OpenResult, SeqStatus, SequenceState, SlotAllocation, slot_mapping,
)
from mlxkv.blocks.specs import KVCacheGroupSpec

if TYPE_CHECKING:
    from mlxkv.config import KvCacheConfig


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables, prefix caching and preemption for every sequence of one engine. Not thread-safe.

    Args:
        num_blocks: pool size including the null block.
        block_size: token slots per block.
        groups: attention groups (default: one full-attention group).
        enable_block_reuse: prefix caching on/off.
        enable_partial_reuse: reuse the matching prefix of a cached block past the last full hit.
        copy_on_partial_reuse: copy such a block when another sequence holds it (else skip the reuse).
        hash_algo: "sha256" | "builtin" | "xxhash" | callable (see hashing.py).
        eviction_policy: "priority" (default; LRU among equal retention priorities) | "lru" | "lfu".
        clock: monotonic seconds for retention expiry.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        groups: Optional[Sequence[KVCacheGroupSpec]] = None,
        *,
        enable_block_reuse: bool = True,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        hash_algo: Union[str, HashFn] = "sha256",
        eviction_policy: Union[str, EvictionPolicy] = "priority",
        event_capacity: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.specs = list(groups) if groups else [KVCacheGroupSpec("full")]
        self.pool = BlockPool(
            num_blocks, block_size, enable_caching=enable_block_reuse, eviction_policy=eviction_policy,
            events=KVEventBuffer(event_capacity), clock=clock,
        )
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_partial_reuse and enable_block_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.hash_fn = make_hash_fn(hash_algo)
        self.coordinator = KVCacheCoordinator(self.pool, self.specs, self.enable_partial_reuse)
        full_groups = [g for g, spec in enumerate(self.specs) if spec.is_full]
        self._anchor_group = self.coordinator.anchor_group
        self._commit_order = full_groups + [g for g in range(len(self.specs)) if g not in full_groups]
        self._seqs: Dict[int, SequenceState] = {}
        self._ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._preempted_log: List[int] = []
        self._prompt_tokens = self._hit_tokens = self._preemptions = 0

    @classmethod
    def from_config(
        cls, config: "KvCacheConfig", num_blocks: int, groups: Optional[Sequence[KVCacheGroupSpec]] = None, **kw
    ) -> "KVCacheManager":
        """A manager with the reuse, hashing and block-size settings of a KvCacheConfig."""
        return cls(
            num_blocks, config.block_size, groups, enable_block_reuse=config.enable_block_reuse,
            enable_partial_reuse=config.enable_partial_reuse, copy_on_partial_reuse=config.copy_on_partial_reuse,
            hash_algo=config.hash_algo, **kw,
        )

    @property
    def events(self) -> KVEventBuffer:
        return self.pool.events

    # ---- opening: prefix hits -------------------------------------------------------------------------
    def find_prefix_hit(
        self, tokens: Sequence[int], salt=None, extra: tuple = (), spans: tuple = ()
    ) -> PrefixHit:
        """Longest usable cached prefix of a prompt (at most len - 1 tokens); takes nothing."""
        ctx = HashContext(salt, tuple(extra), tuple(spans))
        hashes = extend_block_hashes(self.hash_fn, tokens, len(tokens), self.block_size, ctx, [])
        return self._find(tokens, hashes, ctx)

    def _find(self, tokens, hashes, ctx) -> PrefixHit:
        if not self.enable_block_reuse:
            return PrefixHit(self.block_size, 0, [[] for _ in self.specs])
        return self.coordinator.find_prefix_hit(tokens, hashes, ctx, max_tokens=len(tokens) - 1)

    def open(
        self,
        tokens: Sequence[int],
        *,
        salt: Optional[Union[str, bytes]] = None,
        extra: tuple = (),
        spans: tuple = (),
        retention: Optional[RetentionConfig] = None,
        priority: int = 0,
    ) -> OpenResult:
        """Register a sequence with its prompt and take its prefix hit.

        Args:
            tokens: prompt token ids (at least one).
            salt: cache salt; sequences with different salts never share blocks.
            extra: extra hash keys for every block (e.g. LoRA name); spans: ``(start, end, key)`` ranges.
            retention: retention priorities of this sequence's blocks.
            priority: scheduling priority (higher is preempted later).
        Returns:
            OpenResult; the engine computes from ``num_cached_tokens`` on, after applying ``copies``.
        """
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("open() needs at least one prompt token")
        seq = SequenceState(
            seq_id=next(self._ids), tokens=tokens, prompt_len=len(tokens),
            ctx=HashContext(salt, tuple(extra), tuple(spans)), retention=retention or DEFAULT_RETENTION,
            priority=priority, arrival=next(self._arrivals), tables=[GroupTable() for _ in self.specs],
        )
        self._seqs[seq.seq_id] = seq
        result = self._attach_prefix(seq)
        self._prompt_tokens += len(tokens)
        self._hit_tokens += result.num_cached_tokens
        return result

    def _attach_prefix(self, seq: SequenceState) -> OpenResult:
        B, pool = self.block_size, self.pool
        hashes = extend_block_hashes(self.hash_fn, seq.tokens, len(seq.tokens), B, seq.ctx, seq.block_hashes)
        hit = self._find(seq.tokens, hashes, seq.ctx)
        now = pool.clock()
        for g, table in enumerate(seq.tables):
            blocks = hit.blocks[g]
            pool.touch(blocks, hit=True)
            for i, block in enumerate(blocks):
                if not block.is_null:
                    pool.set_retention(block, *seq.retention.block_retention(i * B, (i + 1) * B, seq.prompt_len, now))
            table.blocks = list(blocks)
            table.refs = [None if b.is_null else b.ref for b in blocks]
            table.num_cached = hit.num_full_blocks
        copies = self._take_partial(seq, hit) if hit.partial else []
        n = hit.num_full_blocks * B + (hit.num_partial_tokens if copies is not None else 0)
        seq.num_allocated = seq.num_committed = n
        return OpenResult(seq.seq_id, n, copies or [], self.block_tables(seq.seq_id))

    def _take_partial(self, seq: SequenceState, hit: PrefixHit) -> Optional[List[CopyOp]]:
        """Append the partially matching block of every group (taken, or copied); None if not possible."""
        pool, n = self.pool, hit.num_partial_tokens
        takes, srcs = [], []
        for m in hit.partial:
            if m.block.ref_cnt == 0 and (m.block.block_hash is None or not self.copy_on_partial_reuse):
                takes.append(m.block)  # nobody holds it: write into it directly (it leaves the cache)
            elif self.copy_on_partial_reuse:
                srcs.append(m.block)
            else:
                return None
        pool.touch(takes, hit=True)
        pool.touch(srcs, hit=True)  # pin copy sources so the copy targets cannot evict them
        if len(srcs) > pool.num_free_blocks:
            pool.free_blocks(takes + srcs)
            return None
        dsts = iter(pool.get_new_blocks(len(srcs)))
        copies = []
        for g, m in enumerate(hit.partial):
            if m.block in takes:
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

    # ---- growing: slots, copy-on-write, preemption -----------------------------------------------------
    def _release_skipped(self, seq: SequenceState) -> None:
        """Sliding/chunked groups: release blocks no future token attends to (they stay cached)."""
        for spec, table in zip(self.specs, seq.tables):
            if spec.is_full:
                continue
            stop = min(spec.first_needed(seq.num_committed) // self.block_size, len(table.blocks))
            gone = [table.blocks[i] for i in range(stop) if not table.blocks[i].is_null]
            if gone:
                for i in range(stop):
                    table.blocks[i] = self.pool.null_block
                self.pool.free_blocks(gone[::-1])

    def _blocks_needed(self, seq: SequenceState, n: int) -> int:
        B, start, total = self.block_size, seq.num_allocated, 0
        for table in seq.tables:
            total += _ceil_div(start + n, B) - len(table.blocks)
            if n > 0 and start % B and table.blocks[start // B].ref_cnt > 1:
                total += 1  # copy-on-write of a shared tail
        return total

    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots`` would succeed now without preempting anyone."""
        seq = self._running(seq_id)
        self._release_skipped(seq)
        return self._blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        seq_id: int,
        num_new_tokens: Optional[int] = None,
        token_ids: Optional[Sequence[int]] = None,
        *,
        preempt: bool = False,
    ) -> Optional[SlotAllocation]:
        """Slots for the next tokens of a sequence.

        Either ``num_new_tokens`` of its pending prompt tokens (default: all of them), or new ``token_ids``
        (decode input, draft tokens) once every prompt token has a slot. With ``preempt``, sequences ranking
        below this one (lower priority, then newer) are preempted until the blocks fit.
        Returns None when the blocks do not fit (nothing changes for this sequence).
        """
        seq = self._running(seq_id)
        pending = len(seq.tokens) - seq.num_allocated
        if token_ids is not None:
            if pending:
                raise ValueError(f"sequence {seq_id} has {pending} prompt tokens without slots; allocate them first")
            n = len(token_ids)
        else:
            n = pending if num_new_tokens is None else num_new_tokens
            if not 0 <= n <= pending:
                raise ValueError(f"num_new_tokens={num_new_tokens}: expected 0..{pending} (pending prompt tokens)")
        self._release_skipped(seq)
        preempted: List[int] = []
        while self._blocks_needed(seq, n) > self.pool.num_free_blocks:
            victim = self.choose_victim(requester=seq_id) if preempt else None
            if victim is None:
                return None
            self.preempt(victim)
            self._preempted_log.append(victim)
            preempted.append(victim)
        B, start = self.block_size, seq.num_allocated
        copies: List[CopyOp] = []
        new_blocks: List[List[int]] = []
        for g, table in enumerate(seq.tables):
            if n > 0 and start % B:
                self._make_writable(g, table, start // B, start % B, copies)
            new = self.pool.get_new_blocks(_ceil_div(start + n, B) - len(table.blocks))
            table.blocks.extend(new)
            table.refs.extend([None] * len(new))
            new_blocks.append([b.block_id for b in new])
        if token_ids is not None:
            seq.tokens.extend(int(t) for t in token_ids)
        seq.num_allocated += n
        seq.unconfirmed_copies.update(c.dst_block for c in copies)
        positions = range(start, start + n)
        slots = [slot_mapping([b.block_id for b in t.blocks], positions, B) for t in seq.tables]
        return SlotAllocation(seq_id, start, n, slots, new_blocks, copies, preempted)

    def _make_writable(self, g: int, table: GroupTable, idx: int, used: int, copies: List[CopyOp]) -> None:
        block = table.blocks[idx]
        assert not block.is_null, "the block receiving new tokens is never released"
        if block.ref_cnt > 1:  # shared (fork, or a hit block cut by trim): copy-on-write
            (dst,) = self.pool.get_new_blocks(1)
            copies.append(CopyOp(g, block.block_id, dst.block_id, used))
            self.pool.free_blocks([block])
            table.blocks[idx] = dst
        elif False:  # ours alone but cached: its content is about to change
            self.pool.uncache(block)
        table.refs[idx] = None
        table.num_cached = min(table.num_cached, idx)

    def take_preempted(self) -> List[int]:
        """Sequences preempted by ``allocate_slots(preempt=True)`` since the last call."""
        out, self._preempted_log = self._preempted_log, []
        return out

    def choose_victim(self, requester: Optional[int] = None) -> Optional[int]:
        """The running sequence to preempt: lowest priority, then newest. With ``requester``, only one
        ranking strictly below it (never the requester itself)."""
        def rank(s: SequenceState):
            return (s.priority, -s.arrival)

        cands = [s for s in self._seqs.values() if s.status is SeqStatus.RUNNING and s.seq_id != requester]
        if requester is not None:
            bar = rank(self._seqs[requester])
            cands = [s for s in cands if rank(s) < bar]
        return min(cands, key=rank).seq_id if cands else None

    # ---- verifying, trimming, forking ------------------------------------------------------------------
    def commit(self, seq_id: int, num_tokens: Optional[int] = None) -> None:
        """Mark the next ``num_tokens`` allocated tokens as written and verified (default: all); full
        blocks of verified tokens become cached. Unverified (draft) tokens are never cached."""
        seq = self._running(seq_id)
        n = seq.num_allocated - seq.num_committed if num_tokens is None else num_tokens
        if not 0 <= n <= seq.num_allocated - seq.num_committed:
            raise ValueError(f"num_tokens={num_tokens}: expected 0..{seq.num_allocated - seq.num_committed}")
        seq.num_committed += n
        seq.unconfirmed_copies.clear()  # a commit follows a model step, which applied every copy before it
        if self.enable_block_reuse:
            self._cache_full_blocks(seq)

    def _cache_full_blocks(self, seq: SequenceState) -> None:
        B, pool = self.block_size, self.pool
        full = seq.num_committed // B
        hashes = extend_block_hashes(self.hash_fn, seq.tokens, full * B, B, seq.ctx, seq.block_hashes)
        now = pool.clock()
        anchor_table = seq.tables[self._anchor_group] if self._anchor_group is not None else None
        for g in self._commit_order:
            table = seq.tables[g]
            for i in range(table.num_cached, full):
                block = table.blocks[i]
                if block.is_null:
                    continue
                tokens = tuple(seq.tokens[i * B : (i + 1) * B])
                if block.cached and block.block_hash is None:
                    # registered as a partial block when a sharer finished; it has filled up since
                    assert block.token_ids == tokens[: len(block.token_ids)]
                    pool.uncache(block)
                if block.cached:
                    assert block.token_ids == tokens, "a shared cached block must hold this sequence's tokens"
                else:
                    rule = seq.retention.block_retention(i * B, (i + 1) * B, seq.prompt_len, now)
                    pool.set_retention(block, *rule, merge=False)
                    pool.cache_full_block(
                        block, group_id=g, block_hash=hashes[i], parent_hash=hashes[i - 1] if i else None,
                        parent_ref=None if i == 0 else (table.refs[i - 1] or UNKNOWN_PARENT),
                        token_ids=tokens, extra_keys=seq.ctx.block_extra_keys(i, B),
                        anchor=None if self.specs[g].is_full or anchor_table is None else anchor_table.refs[i],
                    )
                table.refs[i] = block.ref
            table.num_cached = max(table.num_cached, full)

    def trim(self, seq_id: int, n: int) -> int:
        """Drop the last ``n`` tokens (with their slots; pending prompt tokens after them too) and release
        blocks left empty. Sliding/chunked groups take back released blocks the shorter sequence needs again
        from the cache; where one was evicted the trim stops short. Returns the number of tokens removed."""
        if n < 0:
            raise ValueError(f"trim n={n}: expected >= 0")
        seq = self._running(seq_id)
        B, pool = self.block_size, self.pool
        target = max(0, seq.num_allocated - n)
        while target < seq.num_allocated and not self._restorable(seq, target):
            target += 1
        removed = seq.num_allocated - target
        for spec, table in zip(self.specs, seq.tables):
            keep = _ceil_div(target, B)
            dropped = table.blocks[keep:]
            del table.blocks[keep:], table.refs[keep:]
            pool.free_blocks(dropped[::-1])
            table.num_cached = min(table.num_cached, target // B)
            if not spec.is_full:
                for i in spec.needed_blocks(target, B):
                    if table.blocks[i].is_null:
                        block = pool.resolve(table.refs[i])
                        pool.touch([block], hit=False)
                        table.blocks[i] = block
        del seq.tokens[target:]
        del seq.block_hashes[target // B :]
        seq.num_allocated = target
        seq.num_committed = min(seq.num_committed, target)
        return removed

    def _restorable(self, seq: SequenceState, length: int) -> bool:
        for spec, table in zip(self.specs, seq.tables):
            if not spec.is_full:
                for i in spec.needed_blocks(length, self.block_size):
                    if table.blocks[i].is_null and self.pool.resolve(table.refs[i]) is None:
                        return False
        return True

    def fork(self, seq_id: int, n: int = 1) -> List[int]:
        """``n`` new sequences sharing every block of ``seq_id`` (ref counts); a shared partial tail is
        copied on the first write (CopyOp from ``allocate_slots``). Fork after the step that wrote the
        parent's allocated slots. Returns the new ids."""
        if n < 1:
            raise ValueError(f"fork n={n}: expected >= 1")
        parent = self._running(seq_id)
        out = []
        for _ in range(n):
            child = SequenceState(
                seq_id=next(self._ids), tokens=list(parent.tokens), prompt_len=parent.prompt_len, ctx=parent.ctx,
                retention=parent.retention, priority=parent.priority, arrival=next(self._arrivals),
                tables=[GroupTable(list(t.blocks), list(t.refs), t.num_cached) for t in parent.tables],
                block_hashes=list(parent.block_hashes), num_allocated=parent.num_allocated,
                num_committed=parent.num_committed,
            )
            for table in child.tables:
                self.pool.touch(table.blocks, hit=False)
            self._seqs[child.seq_id] = child
            out.append(child.seq_id)
        return out

    # ---- releasing ---------------------------------------------------------------------------------------
    def free(self, seq_id: int) -> None:
        """Release a finished sequence's blocks, tail first; verified content stays cached."""
        seq = self._seqs.pop(self._get(seq_id).seq_id)
        if seq.status is SeqStatus.RUNNING:
            self._release(seq)

    def preempt(self, seq_id: int) -> None:
        """Release a running sequence's blocks for recompute later (``resume``); they stay cached."""
        seq = self._running(seq_id)
        self._release(seq)
        del seq.tokens[max(seq.num_committed, seq.prompt_len) :]  # unverified tokens are dropped
        del seq.block_hashes[len(seq.tokens) // self.block_size :]
        seq.tables = [GroupTable() for _ in self.specs]
        seq.num_allocated = seq.num_committed = 0
        seq.status = SeqStatus.PREEMPTED
        self._preemptions += 1

    def resume(self, seq_id: int) -> OpenResult:
        """Re-attach a preempted sequence to whatever of its tokens is still cached (not counted as hits)."""
        seq = self._get(seq_id)
        if seq.status is not SeqStatus.PREEMPTED:
            raise ValueError(f"sequence {seq_id} is {seq.status.value}, not preempted")
        seq.status = SeqStatus.RUNNING
        return self._attach_prefix(seq)

    def _release(self, seq: SequenceState) -> None:
        B, pool = self.block_size, self.pool
        idx, used = divmod(seq.num_committed, B)
        now = pool.clock()
        for g, table in enumerate(seq.tables):
            if self.enable_partial_reuse and used and idx < len(table.blocks):
                block = table.blocks[idx]
                # keep the verified partial tail findable (unless a copy into it may never have run)
                if not block.is_null and not block.cached and block.block_id not in seq.unconfirmed_copies:
                    rule = seq.retention.block_retention(idx * B, seq.num_committed, seq.prompt_len, now)
                    pool.set_retention(block, *rule, merge=False)
                    pool.cache_partial_block(
                        block, group_id=g, parent_ref=None if idx == 0 else (table.refs[idx - 1] or UNKNOWN_PARENT),
                        token_ids=seq.tokens[idx * B : seq.num_committed], extra_keys=seq.ctx.block_extra_keys(idx, B),
                    )
            pool.free_blocks(table.blocks[::-1])

    # ---- views -------------------------------------------------------------------------------------------
    def _get(self, seq_id: int) -> SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        return seq

    def _running(self, seq_id: int) -> SequenceState:
        seq = self._get(seq_id)
        if seq.status is not SeqStatus.RUNNING:
            raise ValueError(f"sequence {seq_id} is {seq.status.value}; resume() it first")
        return seq

    def status(self, seq_id: int) -> SeqStatus:
        return self._get(seq_id).status

    def sequences(self) -> List[int]:
        return list(self._seqs)

    def num_tokens(self, seq_id: int) -> int:
        """Positions with a slot."""
        return self._get(seq_id).num_allocated

    def num_committed(self, seq_id: int) -> int:
        return self._get(seq_id).num_committed

    def token_ids(self, seq_id: int) -> List[int]:
        return list(self._get(seq_id).tokens)

    def block_tables(self, seq_id: int) -> List[List[int]]:
        """Per group, the block ids of a sequence (0, the null block, where a group released a block)."""
        return [[b.block_id for b in t.blocks] for t in self._get(seq_id).tables]

    def slot_mapping(self, seq_id: int, start: int, end: int) -> List[List[int]]:
        """Per group, flat slots of positions ``[start, end)``."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_allocated:
            raise ValueError(f"positions [{start}, {end}): expected within [0, {seq.num_allocated}]")
        return [slot_mapping([b.block_id for b in t.blocks], range(start, end), self.block_size) for t in seq.tables]

    def stats(self) -> ManagerStats:
        running = sum(s.status is SeqStatus.RUNNING for s in self._seqs.values())
        return ManagerStats(
            prompt_tokens=self._prompt_tokens, hit_tokens=self._hit_tokens, preemptions=self._preemptions,
            running=running, preempted=len(self._seqs) - running, pool=self.pool.stats(),
        )

    def check_invariants(self) -> None:
        """Assert pool and table consistency (tests): ref counts equal the tables holding each block."""
        self.pool.check_invariants()
        held: Dict[int, int] = {}
        for seq in self._seqs.values():
            for spec, table in zip(self.specs, seq.tables):
                assert len(table.blocks) == len(table.refs) == _ceil_div(seq.num_allocated, self.block_size)
                for i in spec.needed_blocks(seq.num_committed, self.block_size):
                    assert not table.blocks[i].is_null, f"seq {seq.seq_id} lost needed block {i}"
                for block in table.blocks:
                    if not block.is_null:
                        held[block.block_id] = held.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0), f"ref count of {block} != {held.get(block.block_id, 0)}"
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_usable_blocks
