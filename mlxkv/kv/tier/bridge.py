"""TierBridge: the secondary tier behind a PagedBackend's block pool — evict → offload, hit → restore.

Two hooks, nothing else in the paged code changes:

- the pool's eviction hook copies an evicted cached full block's K/V (every layer of its group) to the host
  and offers it to the tier (which keeps it only at ``min_priority`` or above);
- :meth:`TierBridge.restore`, called before ``PagedBackend.open(prompt)``, extends the prompt's primary
  prefix hit with blocks found in the tier: each is verified (tokens, extra-keys digest, layout), written
  into fresh pages and cached in the pool exactly as if it had never left, so the following ``open`` finds
  it as an ordinary hit.

Before that, :meth:`TierBridge.ready` (the scheduler's question for a queued prompt) makes the prompt's
:class:`~mlxkv.kv.tier.prefix_lookup.PrefixLookup` — hashes, primary hit, the tier blocks that extend it, host vs
disk — and starts reading its disk blocks on the read-ahead thread; the open takes that lookup
(:meth:`TierBridge.lookup_for_open`): the restore extends its hit, and the block manager's open reuses its hashes
and, while the pool's cache is unchanged since, that hit.

With a disk store, cached blocks are also written *behind* (:meth:`TierBridge.persist`, every
``write_interval_s`` seconds between engine steps; :meth:`TierBridge.flush` at shutdown): the blocks stored since
the last sweep (the pool's ``BlockStored`` events), at or above the tier's priority threshold and not on disk
yet, are copied to host memory on the engine thread and written by the write-behind thread, so a restart finds
them and a crash loses at most the last interval's blocks.

Every layout is covered: full-attention groups restore every block of the hit, sliding-window and chunked
groups only the blocks of their window at the hit's end (restore_plan.py), linked and anchored as the
block manager's hit search checks them. Models with recurrent layers also offload, write behind and restore
their state snapshots (state_tier.py), so a hit found across the tier has a snapshot at its end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlxkv.kv.blocks import KVCacheBlock
from mlxkv.kv.blocks.cache_request import CacheRequest
from mlxkv.kv.blocks.coordinator import PrefixHit
from mlxkv.kv.blocks.events import BlockStored
from mlxkv.kv.blocks.hashing import HashContext, extend_block_hashes
from mlxkv.kv.tier.format import TierBlock, extra_digest, to_host, to_mx
from mlxkv.kv.tier.host_store import Key
from mlxkv.kv.tier.prefix_lookup import Lookups, PrefixLookup, lookup_key
from mlxkv.kv.tier.restore_plan import plan_restore
from mlxkv.kv.tier.secondary import SecondaryTier
from mlxkv.kv.tier.state_tier import SnapshotTier
from mlxkv.kv.tier.tenants import tenant_digest
from mlxkv.kv.tier.write_behind import DEFAULT_QUEUE_BYTES, WriteBehind

log = logging.getLogger("mlxkv.kv.tier")
DEFAULT_WRITE_INTERVAL_S = 2.0
#: Tier blocks (in tokens) one engine step brings back at most for a prompt still waiting to open, on a model whose
#: groups are all full attention: a long hit's page writes are spread over steps the running sequences decode in.
RESTORE_SLICE_TOKENS = 512


class TierBridge:
    """Connects a :class:`~mlxkv.kv.paged.PagedBackend` (duck-typed: ``manager``, ``storage``, ``specs``,
    ``block_size``) to a :class:`SecondaryTier`. Counts primary and secondary hit blocks apart."""

    def __init__(self, backend, tier: SecondaryTier):
        self.backend = backend
        self.tier = tier
        self.manager = backend.manager
        self.pool = backend.manager.pool
        self.storage = backend.storage
        self.block_size = backend.block_size
        self.active = self.pool.enable_caching
        self._windowed = not all(s.is_full for s in backend.specs)
        # the coordinator's rule: the first full-attention group anchors the windowed groups' blocks
        self._anchor_group = next((g for g, s in enumerate(backend.specs) if s.is_full), None)
        self.primary_hit_blocks = 0
        self.secondary_hit_blocks = 0
        self.prompt_blocks = 0
        self.writer: WriteBehind | None = None
        self.write_interval_s = DEFAULT_WRITE_INTERVAL_S
        self._next_sweep = 0.0
        self._cursor = 0  # pool events read so far
        self._pending: dict[Key, bytes | None] = {}  # cached blocks not on disk yet -> their parent hash
        if self.active:
            self.pool.add_evict_hook(self._on_evict)
        self.states: SnapshotTier | None = None  # models with recurrent layers: their snapshots travel too
        # under --distributed: rank 0 decides restores with the other ranks (mlxkv.distributed.tier.RankTier)
        self.ranks = None
        self.lookups = Lookups()  # prompts looked up by ready(), not opened yet
        if self.active and backend.manager.snapshots is not None:
            self.states = SnapshotTier(self, backend.recurrent_layers, backend.snapshot_probe)

    def enable_write_behind(self, interval_s: float = DEFAULT_WRITE_INTERVAL_S,
                            max_queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        """Write cached blocks to the disk store every ``interval_s`` seconds (needs a disk store)."""
        if interval_s <= 0:
            raise ValueError(f"write interval {interval_s}: expected > 0 seconds")
        if not self.active or self.tier.disk is None or self.writer is not None:
            return
        self.write_interval_s = interval_s
        self.writer = WriteBehind(self.tier, max_queue_bytes)
        self.tier.attach_writer(self.writer)
        self._next_sweep = time.monotonic() + interval_s

    def _layers(self, group: int) -> tuple[int, ...]:
        return tuple(self.backend.specs[group].layer_ids)

    # ---- evict → offload ---------------------------------------------------------------------------
    def _on_evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if not isinstance(h, bytes) or block.group_id >= len(self.backend.specs):
            return  # partial block, a snapshot's block (offloaded by SnapshotTier), or a process-local hash ("builtin"): not addressable across evictions
        layers = self._layers(block.group_id)
        if not all(self.storage.allocated(layer) for layer in layers):
            return
        if self.writer is not None and self.tier.on_disk((block.group_id, h)):
            return  # written behind already (or queued): nothing to copy
        priority = block.effective_priority(self.pool.clock())
        if priority < self.tier.min_priority:
            self.tier.counters.offered += 1
            self.tier.counters.dropped_low_priority += 1
            return  # dropped without copying its K/V off the pages
        parent = self.pool.resolve(block.parent)
        arrays, dtypes = [], []
        for layer in layers:
            for rows in self.storage.tier_rows(layer, mx.array([block.block_id], dtype=mx.int32)):  # (1, bs, H, D)
                a, d = to_host(mx.contiguous(rows[0]))  # (bs, kv_heads, D), token-major
                arrays.append(a)
                dtypes.append(d)
        self.tier.offload(TierBlock(
            block_hash=h, parent_hash=None if parent is None else parent.block_hash, group_id=block.group_id,
            layers=layers, token_ids=tuple(block.token_ids), extra_digest=extra_digest(block.extra_keys),
            priority=priority, arrays=arrays, dtypes=dtypes, tenant=tenant_digest(block.tenant),
        ))

    # ---- write-behind ----------------------------------------------------------------------------------
    def due_in(self) -> float | None:
        """Seconds until the next write-behind sweep is due; None when there is nothing to write."""
        if self.writer is None or (not self._pending and self.pool.events.last_seq == self._cursor):
            return None
        return max(0.0, self._next_sweep - time.monotonic())

    def _collect(self) -> None:
        """Add the blocks cached since the last read of the pool's events to the pending set."""
        batch = self.pool.events.read(self._cursor)
        self._cursor = batch.cursor
        if batch.dropped:  # the event ring wrapped: look at every cached block instead
            for b in self.pool.blocks:
                if b.cached and isinstance(b.block_hash, bytes):
                    parent = self.pool.resolve(b.parent)
                    self._pending.setdefault((b.group_id, b.block_hash), parent and parent.block_hash)
        for _, event in batch.events:
            if isinstance(event, BlockStored) and isinstance(event.block_hashes[0], bytes):
                for h in event.block_hashes:
                    self._pending.setdefault((event.group_id, h), event.parent_block_hash)

    def persist(self, force: bool = False) -> int:
        """The write-behind sweep (engine thread, between steps): when due (or ``force``), queue pending cached
        blocks worth keeping for the writer, as many as its queue has room for (the rest wait for the next
        sweep). Returns how many were queued."""
        now = time.monotonic()
        if self.writer is None or (not force and now < self._next_sweep):
            return 0
        self._next_sweep = now + self.write_interval_s
        self._collect()
        room = self.writer.room()
        now = self.pool.clock()
        picked: list[tuple[KVCacheBlock, bytes | None, int]] = []
        states: list[TierBlock] = []
        for key, parent_hash in list(self._pending.items()):
            if key[0] >= len(self.backend.specs):  # a snapshot's blocks
                del self._pending[key]
                tb = None if self.states is None or self.tier.on_disk(key) else self.states.copy_out(key)
                if tb is not None:
                    states.append(tb)
                continue
            found = self.pool.lookup(*key)
            block = found[0] if found else None
            layers = self._layers(key[0])
            if (block is None or self.tier.on_disk(key) or not all(self.storage.allocated(x) for x in layers)
                    or block.effective_priority(now) < self.tier.min_priority):
                del self._pending[key]  # evicted (the evict hook offered it), stored, or not worth keeping
                continue
            nbytes = sum(self.backend.layer_block_bytes[x] for x in layers)
            if picked and nbytes > room:
                break
            room -= nbytes
            picked.append((block, parent_hash, block.effective_priority(now)))
            del self._pending[key]
        queued = 0
        for tb in [*self._copy_out(picked), *states]:
            if self.writer.offer(tb, wait_s=1.0 if force else 0.0):
                queued += 1
            else:  # the queue stayed full: try again at the next sweep
                self._pending[(tb.group_id, tb.block_hash)] = tb.parent_hash
        return queued

    def _copy_out(self, picked: list[tuple[KVCacheBlock, bytes | None, int]]) -> list[TierBlock]:
        """Host copies of cached blocks (one gather per layer per group; evaluated here, on the engine thread)."""
        out: list[TierBlock] = []
        for g in sorted({b.group_id for b, _, _ in picked}):
            rows = [(b, p, prio) for b, p, prio in picked if b.group_id == g]
            ids = mx.array([b.block_id for b, _, _ in rows], dtype=mx.int32)
            layers = self._layers(g)
            per_layer: list[tuple[np.ndarray, str]] = []
            for layer in layers:
                for kv in self.storage.tier_rows(layer, ids):  # (n, bs, kv_heads, D) each
                    per_layer.append(to_host(kv))
            for i, (b, parent_hash, prio) in enumerate(rows):
                out.append(TierBlock(
                    block_hash=b.block_hash, parent_hash=parent_hash, group_id=g, layers=layers,
                    token_ids=tuple(b.token_ids), extra_digest=extra_digest(b.extra_keys), priority=prio,
                    arrays=[a[i] for a, _ in per_layer], dtypes=[d for _, d in per_layer],
                    tenant=tenant_digest(b.tenant)))  # the per-tenant quota holds for blocks written behind too
        return out

    def flush(self, timeout: float) -> dict:
        """Write every pending cached block, waiting at most ``timeout`` seconds, and stop the writer (shutdown).
        Returns ``{"written": blocks this flush wrote, "lost": blocks left unwritten, "on_disk": blocks the disk
        tier holds now, "seconds": time taken}``."""
        if self.writer is None:
            return {"written": 0, "lost": 0, "on_disk": 0, "seconds": 0.0}
        start = time.monotonic()
        deadline = start + timeout
        queued = 0
        self._collect()
        while self._pending and time.monotonic() < deadline:
            queued += self.persist(force=True)
        self.writer.flush(max(0.0, deadline - time.monotonic()))
        unwritten = self.writer.close()
        lost = unwritten + len(self._pending)
        self.tier.attach_writer(None)
        self.writer = None
        with self.tier.disk_lock:
            on_disk = len(self.tier.disk)
        result = {"written": queued - unwritten, "lost": lost, "on_disk": on_disk,
                  "seconds": round(time.monotonic() - start, 3)}
        if lost:
            log.warning("secondary KV tier: flush timed out after %.1f s; %d block(s) not written", timeout, lost)
        return result

    # ---- hit → restore -----------------------------------------------------------------------------
    def _valid(self, tb: TierBlock, group: int, tokens: tuple, extra: tuple) -> bool:
        if not tb.matches(tokens, extra_digest(extra)) or tb.layers != self._layers(group):
            return False
        for j, layer in enumerate(tb.layers):
            # (kv_heads, width, dtype) of K and V as the tier holds them; None before the layer's first write
            shapes = self.storage.tier_shapes(layer) if self.storage.allocated(layer) else [None, None]
            for a, d, shape in zip(tb.arrays[2 * j:2 * j + 2], tb.dtypes[2 * j:2 * j + 2], shapes):
                if a.shape[0] != self.block_size or (shape is not None and (
                        shape[:2] != a.shape[1:] or str(shape[2]).split(".")[-1] != d)):
                    return False
        return True

    def lookup(self, tokens: Sequence[int], salt: str | bytes | None = None, extra: tuple = (),
               spans: tuple = ()) -> PrefixLookup:
        """The prompt's prefix hit across the pool and the tier (:class:`PrefixLookup`): its blocks hashed and the
        pool searched once, then the tier blocks extending the hit planned, counted apart in host memory and on
        disk. Under ``--distributed`` and for models with recurrent layers the tier part is left to their own
        restore (ranks agree on it; snapshots decide the hit's end): ``length`` is then ``first``."""
        tokens = [int(t) for t in tokens]
        bs = self.block_size
        ctx = HashContext(salt, tuple(extra), tuple(spans))
        hashes = extend_block_hashes(self.manager.hash_fn, tokens, len(tokens), bs, ctx, [])
        found = PrefixLookup(tokens, ctx, hashes, max(0, len(tokens) - 1) // bs,
                             self.manager.tables.find(tokens, hashes, ctx), version=self.pool.cache_version)
        self._plan(found)
        return found

    def _plan(self, found: PrefixLookup) -> None:
        """Set ``found``'s tier part: the blocks a restore brings and where they are now."""
        found.length, found.wanted, found.host_blocks, found.disk_keys = found.first, [], 0, []
        if not self.active or found.first >= found.usable or self.ranks is not None or self.states is not None:
            return
        hashes, tier = found.hashes, self.tier
        found.length, found.wanted = plan_restore(self.backend.specs, self.block_size, found.first, found.usable,
                                                  lambda g, i: tier.contains((g, hashes[i])), self.pool.num_free_blocks)
        keys = [(g, hashes[i]) for i, g in found.wanted]
        found.disk_keys = [k for k in keys if tier.needs_read(k)]
        found.host_blocks = len(keys) - len(found.disk_keys)

    def lookup_for_open(self, tokens: Sequence[int], salt: str | bytes | None = None, extra: tuple = (),
                        spans: tuple = ()) -> PrefixLookup:
        """The lookup :meth:`ready` made for this prompt (taken: an open uses it once), else a new one."""
        ctx = HashContext(salt, tuple(extra), tuple(spans))
        found = self.lookups.pop(lookup_key([int(t) for t in tokens], ctx))
        return found if found is not None else self.lookup(tokens, salt, extra, spans)

    def hit_for_open(self, found: PrefixLookup):
        """``found``'s hit when the block manager's open may take it as it is (the pool's cache unchanged since it
        was found or since the restore that extended it); None: the open searches. Models with recurrent layers
        always search (their hit's end also depends on the snapshots)."""
        if self.manager.snapshots is not None or not found.holds(self.pool.cache_version):
            return None
        return found.hit

    def restore(self, tokens: Sequence[int], salt: str | bytes | None = None, extra: tuple = (),
                spans: tuple = (), lookup: PrefixLookup | None = None) -> int:
        """Bring back into the primary pool the tier blocks that extend the prompt's primary prefix hit
        (every layout: windowed groups get only their window, see restore_plan.py). Call before ``open`` with
        the same arguments; ``lookup``: this prompt's :class:`PrefixLookup` (default: a new one), whose primary
        hit and plan are taken as they are while the pool's cache is unchanged since (else the pool is searched
        again over its hashes). Returns by how many blocks the hit grew (0 when nothing was restored)."""
        found = lookup if lookup is not None else self.lookup(tokens, salt, extra, spans)
        if not found.holds(self.pool.cache_version):  # the pool's cache changed since: search again (same hashes)
            found.hit = self.manager.tables.find(found.tokens, found.hashes, found.ctx)
            found.version = self.pool.cache_version
            self._plan(found)
        elif len(found.wanted) > self.pool.num_free_blocks:
            self._plan(found)
        tokens, ctx, hit, first, usable = found.tokens, found.ctx, found.hit, found.first, found.usable
        ahead = min(found.restored, first)  # brought back by earlier slices (ready), still in the pool
        self.prompt_blocks += usable
        self.primary_hit_blocks += first - ahead
        self.secondary_hit_blocks += ahead
        if not self.active or first >= usable:
            return 0
        if self.ranks is not None:  # --distributed: every rank must hold its shard of a restored block
            return self.ranks.restore(tokens, ctx, hit, first, usable)
        if self.states is not None:  # recurrent layers: the hit also needs a snapshot (state_tier.py)
            return self.states.restore(tokens, ctx, first, usable)
        if not found.wanted:
            return 0
        placed: dict[tuple[int, int], KVCacheBlock] = {}
        if not self.restore_blocks(tokens, ctx, found.hashes, hit.blocks, found.held, list(found.wanted),
                                   placed=placed):
            return 0
        hit = self._restored_hit(found.length, placed)  # what a search of the pool finds now
        if hit is not None:
            found.hit, found.version = hit, self.pool.cache_version
        grew = found.length - first
        self.secondary_hit_blocks += grew
        return grew

    def _restored_hit(self, length: int, placed: dict[tuple[int, int], KVCacheBlock]) -> PrefixHit | None:
        """The hit of ``length`` blocks a complete restore leaves (``placed``: its blocks by ``(group, index)``),
        as the block manager's search would find it: every block of a full-attention group, a windowed group's
        window at the hit's end (the null block before it), and no partial block after it (nothing cached links
        to a restored block yet). None if a block it needs is not among them (the open then searches)."""
        bs, null = self.block_size, self.pool.null_block
        blocks = []
        for g, spec in enumerate(self.backend.specs):
            needed = spec.needed_blocks(length * bs, bs)
            if any((g, i) not in placed for i in needed):
                return None
            blocks.append([placed[(g, i)] if i in needed else null for i in range(length)])
        return PrefixHit(block_size=bs, num_full_blocks=length, blocks=blocks)

    def ready(self, tokens: Sequence[int], cache_request: CacheRequest) -> bool:
        """Whether opening ``tokens`` under ``cache_request`` runs its :meth:`restore` without reading a file on the
        calling thread and with no tier block left to bring back (models whose groups are all full attention; a
        windowed model's open restores its window). When not, this call brought one slice (:data:`RESTORE_SLICE_TOKENS`)
        back, or the disk blocks the hit takes are still being read by the tier's read-ahead thread: ask again at
        a later step (the caller keeps the request queued, so the sequences already decoding do not wait for the
        disk, nor for a long hit's page writes). The first call makes the prompt's :class:`PrefixLookup`; later ones
        and the open reuse it.

        Always ready under ``--distributed`` (ranks restore in lockstep) and for models with recurrent layers (their
        snapshot restore reads its own files)."""
        tier = self.tier
        if not self.active or self.ranks is not None or self.states is not None:
            return True
        tokens = [int(t) for t in tokens]
        ctx = HashContext(cache_request.salt, (), tuple(cache_request.spans))
        key = lookup_key(tokens, ctx)
        found = self.lookups.get(key)
        if found is None:
            found = self.lookup(tokens, ctx.salt, spans=ctx.spans)
            self.lookups.put(key, found)
        ahead = tier.ahead
        if ahead is not None:
            ahead.request(found.disk_keys)  # read in the hit's order: the first slice's blocks come first

        def staged(keys: list[Key]) -> bool:
            return ahead is None or not ahead.pending(keys)

        return not self._restore_slice(found, staged) and staged(found.disk_keys)

    def _restore_slice(self, found: PrefixLookup, staged: Callable[[list[Key]], bool]) -> bool:
        """Bring back the next :data:`RESTORE_SLICE_TOKENS` worth of ``found``'s tier blocks, if any are left and
        ``staged(keys)`` says their disk blocks are read (models whose groups are all full attention: any prefix of
        the hit is a hit); whether it did, so the prompt waits one more step. Slices come back while later blocks
        are still being read; the prompt opens with its whole hit in the pool, in a step of its own."""
        step = max(1, RESTORE_SLICE_TOKENS // self.block_size)
        if self._windowed:
            return False
        if not found.holds(self.pool.cache_version):  # e.g. a slice evicted since: look again, same hashes
            found.hit = self.manager.tables.find(found.tokens, found.hashes, found.ctx)
            found.version = self.pool.cache_version
            self._plan(found)
        first = found.first
        if found.length <= first:
            return False
        end = min(first + step, found.length)
        wanted = [(i, g) for i, g in found.wanted if i < end]
        if not staged([(g, found.hashes[i]) for i, g in wanted]):
            return False
        placed: dict[tuple[int, int], KVCacheBlock] = {}
        done = self.restore_blocks(found.tokens, found.ctx, found.hashes, found.hit.blocks, found.held, wanted,
                                   placed=placed)
        hit = self._restored_hit(end, placed) if done else None
        if hit is None:
            return False  # a block was missing: the open restores what it can, as without slices
        found.restored += end - first
        found.hit, found.version = hit, self.pool.cache_version
        self._plan(found)  # what is left, from the hit's new end
        return True

    def wait_reads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a disk read ahead to finish (an engine with nothing else to run)."""
        if self.tier.ahead is not None:
            self.tier.ahead.wait(timeout)

    def restore_blocks(self, tokens: list[int], ctx: HashContext, hashes: list, hit_blocks: list, held: list,
                       wanted: list[tuple[int, int]], after: Callable[[], bool] | None = None,
                       done: list | None = None, priorities: dict | None = None,
                       placed: dict | None = None) -> bool:
        """Bring the ``wanted`` ``(index, group)`` tier blocks into the pool, linked to the primary hit's
        ``hit_blocks`` (per group), with ``held`` kept from eviction meanwhile; then ``after()`` (the snapshot
        restore), still under that protection. Whether every block (and ``after``) came back. ``done`` gets
        ``(index, group, priority)`` of each block restored, in order; ``priorities`` (by ``(index, group)``)
        replaces the retention priority the tier kept (a follower takes rank 0's, mlxkv.distributed.tier).
        ``placed`` gets every block of the hit by ``(group, index)``: the primary hit's and the restored ones."""
        bs = self.block_size
        self.pool.touch(held, hit=False)  # allocations below must not evict the primary hit
        placed = {} if placed is None else placed
        placed.update({(g, i): b for g, chain in enumerate(hit_blocks) for i, b in enumerate(chain) if not b.is_null})
        anchor_group = self._anchor_group if self._windowed else None
        restored: list[KVCacheBlock] = []
        writes: list[tuple[int, TierBlock]] = []
        complete = True
        wanted.sort(key=lambda ig: (ig[0], ig[1] != anchor_group))  # per index, the anchoring block first
        try:
            for i, g in wanted:
                btoks = tuple(tokens[i * bs:(i + 1) * bs])
                bextra = ctx.block_extra_keys(i, bs)
                tb = self.tier.take((g, hashes[i]))
                if tb is None or not self._valid(tb, g, btoks, bextra):
                    if tb is not None:
                        self.tier.put_back(tb)
                    complete = False
                    break
                prev = placed.get((g, i - 1))
                anchor = placed.get((anchor_group, i)) if anchor_group is not None and anchor_group != g else None
                block = self.pool.get_new_blocks(1)[0]
                restored.append(block)
                writes.append((block.block_id, tb))
                self.pool.cache_full_block(
                    block, group_id=g, block_hash=hashes[i], parent_hash=hashes[i - 1] if i else None,
                    parent_ref=None if prev is None else prev.ref, token_ids=btoks, extra_keys=bextra,
                    anchor=None if anchor is None else anchor.ref)
                priority = tb.priority if priorities is None else priorities[(i, g)]
                self.pool.set_retention(block, priority, None, merge=False)
                placed[(g, i)] = block
                if done is not None:
                    done.append((i, g, priority))
            self._write(writes)  # before any model step reads these pages
            if complete and after is not None:
                complete = after()
        except BaseException:
            for block in restored:  # their pages may not hold the content: never let them be hit
                self.pool.uncache(block)
            raise
        finally:
            self.pool.free_blocks(list(reversed(restored)))  # tail first: the chain's end is evicted first
            self.pool.free_blocks(list(reversed(held)))
        return complete

    def _write(self, writes: list[tuple[int, TierBlock]]) -> None:
        """Write restored blocks into their pages: one write per layer for all of them."""
        by_layer: dict[int, tuple[list[int], list, list, tuple[str, str]]] = {}
        for block_id, tb in writes:
            for j, layer in enumerate(tb.layers):
                ids, ks, vs, _ = by_layer.setdefault(layer, ([], [], [], (tb.dtypes[2 * j], tb.dtypes[2 * j + 1])))
                ids.append(block_id)
                ks.append(tb.arrays[2 * j])  # (bs, kv_heads, D_k), host; dtypes checked equal by _valid
                vs.append(tb.arrays[2 * j + 1])
        for layer, (ids, ks, vs, (dk, dv)) in by_layer.items():
            slots = (mx.array(ids, dtype=mx.int32)[:, None] * self.block_size + mx.arange(self.block_size, dtype=mx.int32)).reshape(-1)
            k = to_mx(np.concatenate(ks), dk)  # (n*bs, kv_heads, D_k)
            v = to_mx(np.concatenate(vs), dv)  # (n*bs, kv_heads, D_v)
            self.storage.write_tier(layer, slots, k, v)
        if by_layer:
            mx.eval(self.storage.arrays())

    def stats(self) -> dict:
        """Primary and secondary hits apart, plus the tier's own stats."""
        p = self.prompt_blocks
        return {
            "prompt_blocks": p, "primary_hit_blocks": self.primary_hit_blocks,
            "secondary_hit_blocks": self.secondary_hit_blocks,
            "primary_hit_rate": self.primary_hit_blocks / p if p else 0.0,
            "secondary_hit_rate": self.secondary_hit_blocks / p if p else 0.0,
            "secondary": self.tier.stats(),
        }


def attach_tier(backend, *, memory_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0,
                model_path: str | None = None) -> TierBridge | None:
    """A TierBridge for ``backend`` with a host-memory store (``memory_bytes`` > 0) and/or a disk store
    (``disk_dir`` with ``disk_bytes`` > 0); None when neither is asked for. The offload threshold is the
    backend config's ``secondary_offload_min_priority``, the disk tier's per-tenant quota its
    ``secondary_tenant_share``; the model fingerprint comes from ``model_path``
    (config.json + safetensors metadata) or, without one, from a sample of the weights. With a disk store,
    cached blocks are written behind every ``secondary_write_interval_s`` seconds (0: only evicted blocks).

    Raises:
        ValueError: a disk tier with ``hash_algo='builtin'`` (its hashes differ between processes).
    """
    from mlxkv.kv.tier.disk_store import DiskStore
    from mlxkv.kv.tier.fingerprint import fingerprint_model, with_kv_quantization, with_shard
    from mlxkv.kv.tier.host_store import HostMemoryStore

    use_disk = disk_dir is not None and disk_bytes > 0
    if memory_bytes <= 0 and not use_disk:
        return None
    if use_disk and backend.config.hash_algo == "builtin":
        raise ValueError("a disk tier needs process-stable block hashes: use hash_algo='sha256' or 'xxhash'")
    memory = HostMemoryStore(memory_bytes) if memory_bytes > 0 else None
    disk = None
    if use_disk:
        share = backend.config.secondary_tenant_share
        fingerprint = fingerprint_model(backend.model, model_path)
        if backend.storage.quantized:  # the tier holds the quantized form: only these bits may load it
            fingerprint = with_kv_quantization(fingerprint, backend.storage.bits, backend.storage.group_size)
        if getattr(backend.config, "secondary_shard", ""):  # --distributed: this rank's shard of each block
            fingerprint = with_shard(fingerprint, backend.config.secondary_shard)
        disk = DiskStore(disk_dir, fingerprint, disk_bytes,
                         block_size=backend.block_size,
                         tenant_quota_bytes=None if share >= 1 else int(disk_bytes * share))
    tier = SecondaryTier(backend.config.secondary_offload_min_priority, memory=memory, disk=disk)
    bridge = TierBridge(backend, tier)
    interval = getattr(backend.config, "secondary_write_interval_s", DEFAULT_WRITE_INTERVAL_S)
    if disk is not None and interval > 0:
        bridge.enable_write_behind(interval)
    return bridge
