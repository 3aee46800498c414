"""KVCacheManager: the per-sequence API the engine uses over one pool and one or more KV-cache groups.

Lifecycle of a sequence (positions are token indices):

    res = m.open(prompt, salt=..., retention=...)     # prefix hit: res.num_cached_tokens need no compute
    a = m.allocate_slots(res.seq_id, n)               # slots for the next n prompt tokens (or token_ids=...)
    ...model step: apply res.copies / a.copies, then write K/V at a.slot_mapping...
    m.commit(res.seq_id)                              # verified: full blocks become cached
    m.trim(seq_id, k)                                 # drop the last k tokens (rejected drafts)
    m.fork(seq_id, n) / m.free(seq_id)                # a preempted sequence is freed, then opened again
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from mlxkv.kv.blocks.block_pool import BlockPool
from mlxkv.kv.blocks.block_tables import BlockTables, ceil_div
from mlxkv.kv.blocks.coordinator import PrefixHit
from mlxkv.kv.blocks.events import KVEventBuffer
from mlxkv.kv.blocks.eviction import EvictionPolicy
from mlxkv.kv.blocks.hashing import (
    HashContext,
    HashFn,
    MemoizedHash,
    extend_block_hashes,
    make_hash_fn,
)
from mlxkv.kv.blocks.retention import DEFAULT_RETENTION, RetentionConfig
from mlxkv.kv.blocks.seq_state import (
    GroupTable,
    ManagerStats,
    OpenResult,
    SequenceState,
    SlotAllocation,
)
from mlxkv.kv.blocks.snapshots import StateSnapshotIndex, prefix_of
from mlxkv.kv.blocks.specs import KVCacheGroupSpec


class ManagerSettings(Protocol):
    """What :meth:`KVCacheManager.from_config` reads: :class:`mlxkv.config.KvCacheConfig` has these fields."""

    block_size: int
    enable_block_reuse: bool
    enable_partial_reuse: bool
    copy_on_partial_reuse: bool
    hash_algo: str
    primary_tenant_share: float


class KVCacheManager:
    """Block tables and prefix caching for every sequence of one engine, and the preemption ranking. Not
    thread-safe.

    Args:
        num_blocks: pool size including the null block.
        block_size: token slots per block.
        groups: attention groups (default: one full-attention group).
        enable_block_reuse: prefix caching on/off.
        enable_partial_reuse: reuse the matching prefix of a cached block past the last full hit.
        copy_on_partial_reuse: copy such a block when another sequence holds it (else skip the reuse).
        hash_algo: "sha256" | "builtin" | "xxhash" | callable (see hashing.py).
        eviction_policy: "priority" (default; LRU among equal retention priorities) | "lru" | "lfu".
        event_capacity: KV events kept in the ring buffer.
        clock: monotonic seconds for retention expiry.
        tenant_share: per-tenant (cache salt) quota on the pool's cached blocks, in (0, 1] (1: none); see
            tenant_quota.py.
        state_snapshot_blocks: models with recurrent layers: pool blocks one recurrent-state snapshot costs;
            > 0 turns snapshots on (a prefix hit then ends where a snapshot exists; no partial reuse, since
            snapshots sit at block boundaries). See snapshots.py.
        initial_blocks, grow_blocks: lazy allocation of the pool's storage (block_pool.py; None: whole).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        groups: Sequence[KVCacheGroupSpec] | None = None,
        *,
        enable_block_reuse: bool = True,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        hash_algo: str | HashFn = "sha256",
        eviction_policy: str | EvictionPolicy = "priority",
        event_capacity: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        tenant_share: float = 1.0,
        state_snapshot_blocks: int = 0,
        initial_blocks: int | None = None,
        grow_blocks: int = 1,
    ) -> None:
        self.block_size = block_size
        self.specs = list(groups) if groups else [KVCacheGroupSpec("full")]
        self.pool = BlockPool(
            num_blocks, block_size, enable_caching=enable_block_reuse, eviction_policy=eviction_policy,
            events=KVEventBuffer(event_capacity), clock=clock, tenant_share=tenant_share,
            initial_blocks=initial_blocks, grow_blocks=grow_blocks,
        )
        self.hash_fn = make_hash_fn(hash_algo)
        if hash_algo in ("sha256", "xxhash"):  # slow per block: remember recent prefixes' hashes
            self.hash_fn = MemoizedHash(self.hash_fn)
        self.snapshots = (StateSnapshotIndex(self.pool, len(self.specs), state_snapshot_blocks)
                          if state_snapshot_blocks and enable_block_reuse else None)
        self.tables = BlockTables(
            self.pool, self.specs, self.hash_fn, enable_block_reuse=enable_block_reuse,
            enable_partial_reuse=enable_partial_reuse and self.snapshots is None,
            copy_on_partial_reuse=copy_on_partial_reuse, snapshots=self.snapshots,
        )
        self._seqs: dict[int, SequenceState] = {}
        self._ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._prompt_tokens = self._hit_tokens = 0

    @classmethod
    def from_config(
        cls, config: ManagerSettings, num_blocks: int, groups: Sequence[KVCacheGroupSpec] | None = None, **kw
    ) -> KVCacheManager:
        """A manager with the block size, reuse and hashing settings of a config (a ``KvCacheConfig``)."""
        return cls(
            num_blocks, config.block_size, groups, enable_block_reuse=config.enable_block_reuse,
            enable_partial_reuse=config.enable_partial_reuse, copy_on_partial_reuse=config.copy_on_partial_reuse,
            hash_algo=config.hash_algo, tenant_share=config.primary_tenant_share, **kw,
        )

    @property
    def events(self) -> KVEventBuffer:
        """KV events (BlockStored / BlockRemoved / AllBlocksCleared); see events.py for readers."""
        return self.pool.events

    # ---- opening --------------------------------------------------------------------------------------
    def find_prefix_hit(self, tokens: Sequence[int], salt=None, extra: tuple = (), spans: tuple = ()) -> PrefixHit:
        """Longest usable cached prefix of a prompt (at most len - 1 tokens); takes nothing."""
        ctx = HashContext(salt, tuple(extra), tuple(spans))
        hashes = extend_block_hashes(self.hash_fn, tokens, len(tokens), self.block_size, ctx, [])
        return self.tables.find(tokens, hashes, ctx)

    def open(
        self,
        tokens: Sequence[int],
        *,
        salt: str | bytes | None = None,
        extra: tuple = (),
        spans: tuple = (),
        retention: RetentionConfig | None = None,
        priority: int = 0,
        block_hashes: Sequence | None = None,
        hit: PrefixHit | None = None,
    ) -> OpenResult:
        """Register a sequence with its prompt and take its prefix hit.

        Args:
            tokens: prompt token ids (at least one).
            salt: cache salt; sequences with different salts never share blocks.
            extra: extra hash keys for every block (e.g. a LoRA name); spans: ``(start, end, key)`` token
                ranges with a key for the blocks they overlap (e.g. image hashes).
            retention: retention priorities for this sequence's blocks.
            priority: scheduling priority (higher is preempted later).
            block_hashes: the chained hashes of the prompt's full blocks under this salt, extra and spans, when
                the caller has them already (a tier lookup): not computed again. ``hit``: :meth:`find_prefix_hit`'s
                answer for these tokens while ``pool.cache_version`` is unchanged since: not searched again.
        Returns:
            OpenResult: the engine computes from ``num_cached_tokens`` on, after applying ``copies``.
        """
        tokens = list(map(int, tokens))
        if not tokens:
            raise ValueError("open() needs at least one prompt token")
        seq = SequenceState(
            seq_id=next(self._ids), tokens=tokens, prompt_len=len(tokens),
            ctx=HashContext(salt, tuple(extra), tuple(spans)), retention=retention or DEFAULT_RETENTION,
            priority=priority, arrival=next(self._arrivals), tables=[GroupTable() for _ in self.specs],
        )
        if block_hashes is not None:
            seq.block_hashes = list(block_hashes[:len(tokens) // self.block_size])
        self._seqs[seq.seq_id] = seq
        cached, copies = self.tables.attach(seq, hit)
        state = None
        if self.snapshots is not None and cached:
            k = cached // self.block_size
            state = self.snapshots.take(seq.block_hashes[k - 1], lambda: prefix_of(tokens, seq.ctx, k, self.block_size))
        self._prompt_tokens += len(tokens)
        self._hit_tokens += cached
        return OpenResult(seq.seq_id, cached, copies, self.block_tables(seq.seq_id), state)

    # ---- recurrent-state snapshots ----------------------------------------------------------------------
    def store_snapshot(self, seq_id: int, num_blocks: int, payload) -> bool:
        """Store ``payload``, the recurrent state of ``seq_id`` after its first ``num_blocks`` full blocks (all
        committed, hence cached), in the pool's budget; False when snapshots are off or there is no room."""
        seq = self._get(seq_id)
        if self.snapshots is None or num_blocks < 1 or seq.num_committed < num_blocks * self.block_size:
            return False
        self.tables.cache_full_blocks(seq)  # its block hashes
        bs, i = self.block_size, num_blocks - 1
        rule = seq.retention.block_retention(i * bs, (i + 1) * bs, seq.prompt_len, self.pool.clock())
        return self.snapshots.put(seq.block_hashes[i], num_blocks, prefix_of(seq.tokens, seq.ctx, num_blocks, bs),
                                  tuple(seq.tokens[i * bs:(i + 1) * bs]), seq.ctx.block_extra_keys(0, bs), rule,
                                  payload)  # block 0's extra keys carry the salt: the snapshot's tenant

    # ---- growing --------------------------------------------------------------------------------------
    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots`` for that many tokens would succeed now without preempting."""
        seq = self._get(seq_id)
        self.tables.release_skipped(seq)
        return self.tables.blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        seq_id: int,
        num_new_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> SlotAllocation | None:
        """Slots for the next tokens of a sequence.

        Either ``num_new_tokens`` of its pending prompt tokens (default: all), or new ``token_ids`` (decode
        input, draft tokens) once every prompt token has a slot. Returns None when the blocks do not fit; this
        sequence is then unchanged (the engine makes room: :meth:`choose_victim`).
        """
        seq = self._get(seq_id)
        pending = len(seq.tokens) - seq.num_allocated
        if token_ids is not None:
            if pending:
                raise ValueError(f"sequence {seq_id} has {pending} prompt tokens without slots; allocate them first")
            n = len(token_ids)
        else:
            n = pending if num_new_tokens is None else num_new_tokens
            if not 0 <= n <= pending:
                raise ValueError(f"num_new_tokens={num_new_tokens}: expected 0..{pending} (pending prompt tokens)")
        self.tables.release_skipped(seq)
        if self.tables.blocks_needed(seq, n) > self.pool.num_free_blocks:
            return None
        start = seq.num_allocated
        copies, new_blocks = self.tables.grow(seq, n)
        if token_ids is not None:
            seq.tokens.extend(int(t) for t in token_ids)
        slots = self.slot_mapping(seq_id, start, start + n)
        return SlotAllocation(seq_id, start, n, slots, new_blocks, copies)

    def set_token(self, seq_id: int, position: int, token_id: int) -> None:
        """Name the token at an allocated, not yet committed ``position`` (allocated under a placeholder id while
        its value was still being computed: an overlapped decode step). Ids are hashed only at commit."""
        seq = self._get(seq_id)
        if not seq.num_committed <= position < seq.num_allocated:
            raise ValueError(f"position {position}: expected an allocated, uncommitted one "
                             f"({seq.num_committed}..{seq.num_allocated - 1})")
        seq.tokens[position] = int(token_id)

    def commit(self, seq_id: int, num_tokens: int | None = None) -> None:
        """Mark the next ``num_tokens`` allocated tokens as written and verified (default: all); full
        blocks of verified tokens become cached. Call it after the model step; unverified (draft) tokens
        are never cached."""
        seq = self._get(seq_id)
        room = seq.num_allocated - seq.num_committed
        n = room if num_tokens is None else num_tokens
        if not 0 <= n <= room:
            raise ValueError(f"num_tokens={num_tokens}: expected 0..{room}")
        seq.num_committed += n
        seq.unconfirmed_copies.clear()  # a model step ran, applying every copy handed out before it
        self.tables.cache_full_blocks(seq)

    def trim(self, seq_id: int, n: int) -> int:
        """Drop the last ``n`` tokens with their slots (pending prompt tokens after them too), releasing
        emptied blocks. Sliding/chunked groups take back released blocks the shorter sequence needs again
        from the cache; where one was evicted, the trim stops short. Returns the number of tokens removed."""
        if n < 0:
            raise ValueError(f"trim n={n}: expected >= 0")
        seq = self._get(seq_id)
        target = self.tables.trimmable_to(seq, max(0, seq.num_allocated - n))
        removed = seq.num_allocated - target
        self.tables.trim(seq, target)
        return removed

    def drop_blocks(self, seq_id: int, group: int, indices: Sequence[int]) -> None:
        """Drop ``seq_id``'s reference to blocks ``indices`` of full-attention ``group`` (an overflow policy's
        eviction; never the block receiving new tokens); blocks it writes from then on are never cached."""
        self.tables.drop(self._get(seq_id), group, indices)

    def restore_block(self, seq_id: int, group: int, index: int) -> int | None:
        """A new block for ``seq_id``'s dropped entry ``index`` of full-attention ``group`` (the offload policy
        bringing a page back from host memory); its id, or None when no block is free. Never cached."""
        return self.tables.restore(self._get(seq_id), group, index)

    def fork(self, seq_id: int, n: int = 1) -> list[int]:
        """``n`` new sequences sharing every block of ``seq_id`` (ref counts); a shared partial tail is copied
        on its first write (a CopyOp from ``allocate_slots``). Fork after the model step that wrote the
        parent's allocated slots. Returns the new ids."""
        if n < 1:
            raise ValueError(f"fork n={n}: expected >= 1")
        parent = self._get(seq_id)
        out = []
        for _ in range(n):
            child = SequenceState(
                seq_id=next(self._ids), tokens=list(parent.tokens), prompt_len=parent.prompt_len, ctx=parent.ctx,
                retention=parent.retention, priority=parent.priority, arrival=next(self._arrivals),
                tables=self.tables.share(parent), block_hashes=list(parent.block_hashes),
                num_allocated=parent.num_allocated, num_committed=parent.num_committed,
                unconfirmed_copies=set(parent.unconfirmed_copies), cache_limit=parent.cache_limit,
            )
            self._seqs[child.seq_id] = child
            out.append(child.seq_id)
        return out

    # ---- releasing, and whom to preempt --------------------------------------------------------------
    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first; verified content stays cached (a preempted sequence opened
        again over its tokens finds it as a prefix hit)."""
        seq = self._get(seq_id)
        self.tables.release(seq)
        del self._seqs[seq_id]

    def choose_victim(self, requester: int | None = None) -> int | None:
        """The sequence to preempt: lowest priority, then newest. With ``requester``, only one ranking strictly
        below it (never the requester itself); None when there is none."""
        def rank(s: SequenceState):
            return (s.priority, -s.arrival)

        cands = [s for s in self._seqs.values() if s.seq_id != requester]
        if requester is not None:
            bar = rank(self._get(requester))
            cands = [s for s in cands if rank(s) < bar]
        return min(cands, key=rank).seq_id if cands else None

    # ---- views --------------------------------------------------------------------------------------------
    def _get(self, seq_id: int) -> SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        return seq

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def num_tokens(self, seq_id: int) -> int:
        """Positions with a slot."""
        return self._get(seq_id).num_allocated

    def num_committed(self, seq_id: int) -> int:
        """Positions whose K/V is written and verified."""
        return self._get(seq_id).num_committed

    def token_ids(self, seq_id: int) -> list[int]:
        """Known tokens: those with slots, then pending prompt tokens."""
        return list(self._get(seq_id).tokens)

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """Per group, the block ids of a sequence (0, the null block, where a group released a block)."""
        return [[b.block_id for b in t.blocks] for t in self._get(seq_id).tables]

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[list[int]]:
        """Per group, the flat slot of each position in ``[start, end)``."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_allocated:
            raise ValueError(f"positions [{start}, {end}): expected within [0, {seq.num_allocated}]")
        bs = self.block_size  # O(end - start), not O(table length): this runs every decode step
        return [[t.blocks[p // bs].block_id * bs + p % bs for p in range(start, end)] for t in seq.tables]

    def stats(self) -> ManagerStats:
        return ManagerStats(prompt_tokens=self._prompt_tokens, hit_tokens=self._hit_tokens, running=len(self._seqs),
                            pool=self.pool.stats())

    def check_invariants(self) -> None:
        """Assert pool and table consistency (tests): each ref count equals the tables holding the block."""
        self.pool.check_invariants()
        if self.snapshots is not None:
            self.snapshots.check_invariants()
        held: dict[int, int] = {}
        for seq in self._seqs.values():
            for spec, table in zip(self.specs, seq.tables):
                assert len(table.blocks) == len(table.refs) == ceil_div(seq.num_allocated, self.block_size)
                for i in spec.needed_blocks(seq.num_committed, self.block_size):
                    assert i in table.dropped or not table.blocks[i].is_null, f"seq {seq.seq_id} lost needed block {i}"
                for block in table.blocks:
                    if not block.is_null:
                        held[block.block_id] = held.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0), f"{block}: {held.get(block.block_id, 0)} tables"
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_usable_blocks
