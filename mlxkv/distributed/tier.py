"""The secondary KV tier (host memory, disk) under ``mlxkv serve --distributed``: decided on rank 0, one shard per rank.

Every rank keeps its own tier of its own shard of each block (its KV heads, or its layers): its own host store and
its own disk folder, ``<--kv-disk-cache>/rank-<r>-of-<n>-<mode>`` (:func:`rank_tier_config`), whose fingerprint
names that shard (:func:`mlxkv.kv.tier.fingerprint.with_shard`), so a folder written under another split is never
read as this one.

What goes to the tier needs no decision of its own: blocks reach it when the pool evicts them (and through the
write-behind of cached blocks), and every rank's pool, applying rank 0's changes, evicts the same blocks in the
same order. Each rank's stores then keep or drop them by their own caps, and a rank's disk may lack blocks
another has (a crash between two write-behind sweeps, a folder removed between restarts, pipeline ranks whose
blocks differ in size). So a restore is agreed before it counts (:class:`RankTier`):

1. rank 0 finds the blocks that would extend the prompt's primary hit and that it holds, and sends their keys
   (a :class:`~mlxkv.distributed.steps.TierHave` step);
2. every rank answers, for each key, whether its own tier holds its shard (one ``all_sum`` of 0/1 flags);
3. rank 0 restores only the longest hit every rank holds (``plan_restore`` over the blocks all ranks hold) and
   records what it restored (a :class:`~mlxkv.distributed.changes.TierRestore` change, with the retention priority
   of each block); each follower restores exactly that, before the ``Open`` it precedes, so block ids and prefix
   hits stay the same on every rank.

A follower missing its shard thus only shortens the hit (down to none), never gives a wrong answer. This is the
simplest correct order: the agreement costs one collective, and only when rank 0 holds a candidate block. What
the agreement cannot see (a file removed or failing verification between the answer and the replay) makes the
replay fail; the follower then ends the launch with a clear error, as any divergence does (and so does rank 0
when its own restore raises midway: its allocations may have evicted blocks the other ranks still hold). Agreeing on flags
rather than restoring and undoing keeps every rank's pool changes in the order rank 0 made them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from mlxkv.distributed.changes import TierRestore
from mlxkv.distributed.steps import TierHave
from mlxkv.distributed.watchdog import fatal
from mlxkv.kv.blocks.hashing import HashContext, extend_block_hashes
from mlxkv.kv.tier.fingerprint import parse_shard_name, shard_name
from mlxkv.kv.tier.restore_plan import plan_restore

log = logging.getLogger("mlxkv.distributed")


def rank_tier_config(kv: Any, mode: str, rank: int, size: int) -> Any:
    """``kv`` (a :class:`~mlxkv.config.KvCacheConfig`) for rank ``rank`` of ``size`` under ``--distributed mode``:
    its disk tier (if any) in its own subfolder, fingerprinted as its shard. Per-rank folders of another split
    found beside it are named in one log line and left alone."""
    if not kv.secondary_enabled:
        return kv
    shard = shard_name(mode, rank, size)
    if kv.secondary_disk_dir is None:
        return dataclasses.replace(kv, secondary_shard=shard)
    root = Path(kv.secondary_disk_dir)
    if rank == 0 and root.is_dir():
        other = sorted(p.name for p in root.iterdir() if p.is_dir() and parse_shard_name(p.name)
                       and parse_shard_name(p.name)[1:] != (size, mode))
        if other:
            log.warning("KV tier: %s holds the tier of another --distributed split (%s): not read by this launch of "
                        "%d %s-parallel ranks", root, ", ".join(other), size, mode)
    return dataclasses.replace(kv, secondary_shard=shard, secondary_disk_dir=str(root / shard))


class RankTier:
    """The distributed side of one rank's :class:`~mlxkv.kv.tier.bridge.TierBridge` (module docstring).

    Args:
        bridge: this rank's tier bridge (installed as ``bridge.ranks``).
        plans: rank 0's :class:`~mlxkv.distributed.leader.Plans` (it decides); None on a follower (it applies rank
            0's restores).
    """

    def __init__(self, bridge: Any, plans: Any = None):
        if bridge.states is not None:
            raise ValueError("the secondary KV tier with --distributed does not cover models with recurrent layers "
                             "(their state snapshots are not sharded): drop --host-cache-size / --kv-disk-cache")
        self.bridge = bridge
        self.plans = plans
        self.agreements = 0  # tier_have steps run
        self.refused_blocks = 0  # blocks rank 0 held that another rank did not (rank 0 only)
        bridge.ranks = self

    @property
    def decides(self) -> bool:
        return self.plans is not None

    def _hashes(self, tokens: list[int], ctx: HashContext, usable: int) -> list:
        b = self.bridge
        return extend_block_hashes(b.manager.hash_fn, tokens, usable * b.block_size, b.block_size, ctx, [])

    # ---- rank 0 ------------------------------------------------------------------------------------------
    def restore(self, tokens: list[int], ctx: HashContext, hit: Any, first: int, usable: int) -> int:
        """Rank 0: the tier blocks every rank holds that extend the prompt's primary hit, restored and recorded
        for the followers; by how many blocks the hit grew. A follower restores nothing here (rank 0's
        :class:`~mlxkv.distributed.changes.TierRestore` brings it)."""
        plans = self.plans
        if plans is None or plans.stopped or plans.changes.paused_now:
            return 0  # a follower, the last stop, or a batch probe (each rank probes alone): no tier
        b = self.bridge
        specs = b.backend.specs
        hashes = self._hashes(tokens, ctx, usable)
        cap = usable  # full attention needs every block: rank 0's first gap bounds the hit already
        for g, spec in enumerate(specs):
            if spec.is_full:
                i = first
                while i < cap and b.tier.contains((g, hashes[i])):
                    i += 1
                cap = i
        mine = [(g, i) for g in range(len(specs)) for i in range(first, cap) if b.tier.contains((g, hashes[i]))]
        if not mine:
            return 0
        everyone = self.agree([(g, hashes[i]) for g, i in mine])
        held_by_all = {gi for gi, ok in zip(mine, everyone) if ok}
        self.refused_blocks += len(mine) - len(held_by_all)
        length, wanted = plan_restore(specs, b.block_size, first, usable, lambda g, i: (g, i) in held_by_all,
                                      b.pool.num_free_blocks)
        if not wanted:
            return 0
        held = [x for chain in hit.blocks for x in chain if not x.is_null]
        done: list[tuple[int, int, int]] = []
        try:
            complete = b.restore_blocks(tokens, ctx, hashes, hit.blocks, held, wanted, done=done)
        except Exception as exc:  # noqa: BLE001 - its allocations may have evicted blocks the others still hold
            fatal(0, f"a KV tier restore failed ({type(exc).__name__}: {exc}); the ranks' pools would diverge")
        grew = length - first if complete else 0
        if done:  # applied by every follower before the open that follows
            plans.changes.record(TierRestore(list(tokens), (ctx.salt, ctx.extra, ctx.spans), first, usable, done,
                                             grew))
        b.secondary_hit_blocks += grew
        return grew

    def agree(self, keys: list) -> list[bool]:
        """Rank 0: for each ``(group, hash)`` key, whether every rank's tier holds its shard (one collective)."""
        self.plans.send(TierHave(keys))
        self.agreements += 1
        return self.plans.channel.agree([self.bridge.tier.contains(k) for k in keys])

    # ---- followers ---------------------------------------------------------------------------------------
    def have(self, channel: Any, keys: list) -> None:
        """A follower's answer to rank 0's ``tier_have`` step."""
        self.agreements += 1
        channel.agree([self.bridge.tier.contains(tuple(k)) for k in keys])

    def replay(self, change: TierRestore) -> None:
        """A follower: restore exactly the blocks rank 0 restored (``change``).

        Raises:
            RuntimeError: this rank's pool has another primary hit, or its tier lost a block it had agreed to
                (the follower then stops the launch).
        """
        b = self.bridge
        tokens, first, usable, done = change.tokens, change.first, change.usable, change.restored
        ctx = HashContext(*change.hash_context)
        hit = b.manager.find_prefix_hit(tokens, ctx.salt, ctx.extra, ctx.spans)
        if hit.num_full_blocks != first:
            raise RuntimeError(f"prefix hit of {hit.num_full_blocks} blocks differs from rank 0's {first} before a "
                               "tier restore: the ranks diverged")
        hashes = self._hashes(tokens, ctx, usable)
        held = [x for chain in hit.blocks for x in chain if not x.is_null]
        got: list[tuple[int, int, int]] = []
        ok = b.restore_blocks(tokens, ctx, hashes, hit.blocks, held, [(i, g) for i, g, _ in done], done=got,
                              priorities={(i, g): p for i, g, p in done})
        if not ok or len(got) != len(done):
            i, g, _ = done[len(got)]
            raise RuntimeError(f"this rank's KV tier lost its shard of block {i} (group {g}, {hashes[i].hex()[:12]}) "
                               "after agreeing to restore it (a file removed or failing verification meanwhile)")
        b.secondary_hit_blocks += change.grew

    def figures(self) -> list[int]:
        """This rank's tier figures for the per-rank stats: host blocks, disk blocks, blocks restored."""
        tier = self.bridge.tier
        memory = 0 if tier.memory is None else len(tier.memory)
        with tier.disk_lock:
            disk = 0 if tier.disk is None else len(tier.disk)
        return [memory, disk, self.bridge.secondary_hit_blocks]


def rank_tier(pool: Any, plans: Any = None) -> RankTier | None:
    """Install :class:`RankTier` on ``pool``'s tier (paged with ``--host-cache-size`` / ``--kv-disk-cache``);
    None without a tier."""
    bridge = pool.paged.tier if pool.is_paged else None
    return None if bridge is None else RankTier(bridge, plans)


def report_flush(rank: int, flushed: dict | None) -> None:
    """A follower's line after its tier flush at stop (rank 0 prints its own)."""
    if not flushed:
        return
    try:  # mlx.launch relays the ranks' output: signalled, it may have exited already (a broken pipe)
        sys.stderr.write(f"mlxkv serve: rank {rank}: KV tier saved: {flushed['on_disk']} block(s) on disk "
                         f"({flushed['written']} written at stop, {flushed['seconds']:.2f} s)"
                         + (f", {flushed['lost']} not written" if flushed["lost"] else "") + "\n")
        sys.stderr.flush()
    except OSError:
        pass
