"""Which tier blocks a prompt's restore brings back, for every layout (pure Python).

A prefix hit of ``L`` full blocks needs, in every group, the blocks ``spec.needed_blocks(L * bs)`` names: all of
them for full attention, only the window for sliding-window and chunked groups (the blocks before it are never
read again). The primary pool already holds the first ``first`` blocks of each group (its own hit); the restore
looks for the longest ``L`` whose needed blocks past ``first`` are all in the tier (and fit the free blocks), so
the block manager's own hit search, run next over the pool, finds a hit of ``L`` blocks with the same
intersection over groups as for blocks that never left. Blocks outside the windows stay in the tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxkv.kv.blocks.specs import KVCacheGroupSpec


def plan_restore(specs: Sequence[KVCacheGroupSpec], block_size: int, first: int, usable: int,
                 in_tier: Callable[[int, int], bool], free_blocks: int) -> tuple[int, list[tuple[int, int]]]:
    """``(L, [(block index, group), ...])``: the longest hit length ``first < L <= usable`` (in blocks) whose
    needed blocks at index ``>= first`` are all ``in_tier(group, index)`` and number at most ``free_blocks``,
    and those blocks in index order; ``(first, [])`` when no longer hit can be restored."""
    cap = usable
    for g, spec in enumerate(specs):  # full attention needs every block: the first gap bounds the hit
        if spec.is_full:
            i = first
            while i < cap and in_tier(g, i):
                i += 1
            cap = i
    for length in range(cap, first, -1):
        wanted: list[tuple[int, int]] = []
        ok = True
        for g, spec in enumerate(specs):
            for i in spec.needed_blocks(length * block_size, block_size):
                if i < first:
                    continue
                if not in_tier(g, i):
                    ok = False
                    break
                wanted.append((i, g))
            if not ok:
                break
        if ok and len(wanted) <= free_blocks:
            return length, sorted(wanted)
    return first, []
