"""Recurrent-state snapshots in the secondary tier: offloaded, written behind and restored with their blocks.

A snapshot (kv/blocks/snapshots.py) travels as a :class:`~mlxkv.kv.tier.format.TierBlock` of ``kind="state"``
keyed ``(snapshot group, hash of the block it follows)``, in the same stores, file format and HMAC seal as K/V
blocks. Its arrays are the recurrent caches' ``state`` arrays in layer order (``layers`` names each one's
layer); its identity is the whole prefix it follows, as in the pool: ``token_ids`` are the prefix's tokens and
``extra_digest`` digests every block's extra keys, so a restore checks exactly what a primary hit checks.

Restore (before ``open``): the deepest ``k`` blocks such that a snapshot after block ``k - 1`` is in the pool or
the tier and every attention block a hit of ``k`` blocks needs is in the pool or the tier (restore_plan.py);
the missing ones are brought back, so the block manager's hit search, run next, finds a hit of ``k`` blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kv.blocks import KVCacheBlock
from mlxkv.kv.blocks.hashing import HashContext, extend_block_hashes
from mlxkv.kv.blocks.snapshots import StateSnapshot, prefix_of
from mlxkv.kv.tier.format import TierBlock, extra_digest, to_host, to_mx
from mlxkv.kv.tier.host_store import Key
from mlxkv.kv.tier.restore_plan import plan_restore
from mlxkv.kv.tier.tenants import tenant_digest


def skeleton(value: Any) -> Any:
    """The structure of a cache state with its arrays left out (containers and other values kept): two
    snapshots of one model share it, and a record's arrays are put back into it in order."""
    if isinstance(value, mx.array):
        return "array"
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(skeleton(v) for v in value))
    return value


def _arrays(value: Any, out: list) -> None:
    if isinstance(value, mx.array):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _arrays(v, out)


def _fill(template: Any, arrays: Iterator) -> Any:
    if isinstance(template, mx.array):
        return next(arrays)
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(v, arrays) for v in template)
    return template


def flatten(payload: list, layers: Sequence[int]) -> tuple[tuple[int, ...], list, list[str]] | None:
    """``(layer of each array, host arrays, dtype names)`` of a captured payload (one state per layer in
    ``layers``); None when an array is not storable (an integer dtype, or over 4 dimensions)."""
    owners, arrays, dtypes = [], [], []
    for layer, state in zip(layers, payload):
        found: list = []
        _arrays(state, found)
        for a in found:
            if a.ndim < 1 or a.ndim > 4:
                return None
            try:
                h, d = to_host(a)
            except ValueError:  # an integer state: the format stores float arrays only
                return None
            owners.append(layer)
            arrays.append(h)
            dtypes.append(d)
    return tuple(owners), arrays, dtypes


def unflatten(tb: TierBlock, probe: list) -> list:
    """The payload of a ``kind="state"`` record: ``probe`` (a snapshot of the same model) with its arrays
    replaced, in order, by the record's."""
    return _fill(probe, iter([to_mx(a, d) for a, d in zip(tb.arrays, tb.dtypes)]))


class SnapshotTier:
    """The snapshot side of a :class:`~mlxkv.kv.tier.bridge.TierBridge` (``bridge``: its manager, pool, tier).

    Args:
        bridge: the bridge; layers: the model's recurrent layers; probe: one snapshot's payload, whose layout
            (layers, shapes, dtypes) a restored record must have.
    """

    def __init__(self, bridge, layers: Sequence[int], probe: list):
        self.bridge = bridge
        self.index = bridge.manager.snapshots
        self.group_id = self.index.group_id
        self.layers = list(layers)
        self.probe = probe
        self.skeleton = skeleton(probe)
        flat = flatten(probe, self.layers)
        self.layout = None if flat is None else (flat[0], tuple((a.shape, d) for a, d in zip(flat[1], flat[2])))
        if self.layout is not None:
            self.index.on_evict = self._on_evict

    # ---- out of the pool ---------------------------------------------------------------------------------
    def record(self, snap: StateSnapshot, priority: int) -> TierBlock | None:
        """The tier record of a live snapshot (None: its state is not storable)."""
        flat = None if skeleton(snap.payload) != self.skeleton else flatten(snap.payload, self.layers)
        if flat is None:
            return None
        owners, arrays, dtypes = flat
        first = snap.blocks[0]
        return TierBlock(block_hash=snap.key, parent_hash=None, group_id=self.group_id, layers=owners,
                         token_ids=tuple(snap.prefix[0]), extra_digest=extra_digest(snap.prefix[1]),
                         priority=priority, arrays=arrays, dtypes=dtypes, tenant=tenant_digest(first.tenant),
                         kind="state", span=self.bridge.block_size)

    def _on_evict(self, snap: StateSnapshot, block: KVCacheBlock) -> None:
        """The index's hook: a snapshot is being evicted from the pool; offer it to the tier."""
        tier = self.bridge.tier
        if not isinstance(snap.key, bytes):
            return  # a process-local hash: not addressable across evictions
        if self.bridge.writer is not None and tier.on_disk((self.group_id, snap.key)):
            return  # written behind already
        priority = block.effective_priority(self.bridge.pool.clock())
        if priority < tier.min_priority:
            tier.counters.offered += 1
            tier.counters.dropped_low_priority += 1
            return
        tb = self.record(snap, priority)
        if tb is not None:
            tier.offload(tb)

    def copy_out(self, key: Key) -> TierBlock | None:
        """The record of the live snapshot ``key`` for the write-behind sweep (None: gone, or below the tier's
        priority threshold)."""
        snap = self.index.live(key[1])
        if snap is None:
            return None
        priority = snap.blocks[0].effective_priority(self.bridge.pool.clock())
        return None if priority < self.bridge.tier.min_priority else self.record(snap, priority)

    # ---- back into the pool --------------------------------------------------------------------------
    def restore(self, tokens: list[int], ctx: HashContext, first: int, usable: int) -> int:
        """Extend a primary hit of ``first`` blocks (snapshot included) from the tier (module docstring).
        Returns by how many blocks the hit grew."""
        b = self.bridge
        bs, pool, tier, mgr = b.block_size, b.pool, b.tier, b.manager
        hashes = extend_block_hashes(mgr.hash_fn, tokens, len(tokens), bs, ctx, [])
        attn = mgr.tables.coordinator.find_prefix_hit(tokens, hashes, ctx, max_tokens=len(tokens) - 1)
        a_first = attn.num_full_blocks  # attention blocks in the pool, whether or not a snapshot exists there

        def in_tier(g: int, i: int) -> bool:
            return tier.contains((g, hashes[i]))

        for k in range(usable, first, -1):
            primary = self.index.find(hashes[k - 1], lambda k=k: prefix_of(tokens, ctx, k, bs))
            if primary is None and (self.layout is None or not tier.contains((self.group_id, hashes[k - 1]))):
                continue
            need = 0 if primary is not None else self.index.blocks_per_snapshot
            wanted: list[tuple[int, int]] = []
            if k > a_first:
                length, wanted = plan_restore(b.backend.specs, bs, a_first, k, in_tier, pool.num_free_blocks - need)
                if length != k:
                    continue
            if len(wanted) + need <= pool.num_free_blocks:
                break
        else:
            return 0
        held = [blk for chain in attn.blocks for blk in chain if not blk.is_null]
        held += primary.blocks if primary is not None else []

        def bring_snapshot() -> bool:
            return primary is not None or self._take(tokens, ctx, hashes, k)

        if not b.restore_blocks(tokens, ctx, hashes, attn.blocks, held, wanted, after=bring_snapshot):
            return 0
        b.secondary_hit_blocks += k - first
        return k - first

    def _take(self, tokens: list[int], ctx: HashContext, hashes: list, k: int) -> bool:
        """Put the tier's snapshot after block ``k - 1`` into the pool; False when missing, not matching, or
        without room."""
        tier, bs = self.bridge.tier, self.bridge.block_size
        key = (self.group_id, hashes[k - 1])
        tb = tier.take(key)
        if tb is None:
            return False
        prefix = prefix_of(tokens, ctx, k, bs)
        if (tb.kind != "state" or tb.layout() != self.layout or tb.block_size != bs
                or not tb.matches(prefix[0], extra_digest(prefix[1]))):
            tier.put_back(tb)
            return False
        payload = unflatten(tb, self.probe)
        mx.eval(payload)
        return self.index.put(hashes[k - 1], k, prefix, tuple(tokens[(k - 1) * bs:k * bs]),
                              ctx.block_extra_keys(0, bs), (tb.priority, None), payload)
