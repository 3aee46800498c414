"""PrefixLookup: one prompt's prefix hit across the primary pool and the secondary tier, computed once.

The scheduler asks whether a queued prompt is ready to open (:meth:`~mlxkv.kv.tier.bridge.TierBridge.ready`): that
hashes the prompt's blocks and searches the pool once, and says how far the hit goes with the tier and where its
blocks are — ``first`` blocks in the pool, ``host_blocks`` in host memory, ``disk_keys`` to read from disk (read
ahead by the tier's thread while other sequences decode, then brought back into the pool a slice per step). The
lookup is kept (:class:`Lookups`) and, when the prompt opens, carried to the restore (which extends its hit with
the blocks it brings back) and to the block manager's open: the prompt is hashed once, and its hit is searched
again only where the pool's cache changed in between (other sequences cached or evicted blocks meanwhile;
``BlockPool.cache_version`` tells).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlxkv.kv.blocks.hashing import HashContext
from mlxkv.kv.tier.host_store import Key

#: Lookups kept for prompts not opened yet; the oldest goes first past it (a cancelled request leaves one behind).
MAX_LOOKUPS = 64
#: Seconds a kept lookup stays usable (its disk reads are staged about as long: read_ahead.STAGED_TTL_S).
LOOKUP_TTL_S = 60.0


@dataclass
class PrefixLookup:
    """A prompt's prefix hit as one search found it (block counts over every group; indices are block indices).

    Attributes:
        tokens, ctx: the prompt and its hash context (salt, extra keys, spans).
        hashes: chained hashes of every full block of the prompt.
        usable: blocks a hit may cover (the last prompt token is always recomputed).
        hit: the primary pool's :class:`~mlxkv.kv.blocks.coordinator.PrefixHit` (``first`` full blocks; after a
            restore, the hit it extended).
        length: blocks the hit covers with the tier's blocks restored (``first`` when the tier adds none).
        wanted: the ``(index, group)`` tier blocks that restore brings back, in index order.
        host_blocks: how many of them are in host memory (or queued for disk); ``disk_keys``: the rest, read from
            disk.
    """

    tokens: list[int]
    ctx: HashContext
    hashes: list
    usable: int
    hit: Any
    length: int = 0
    wanted: list[tuple[int, int]] = field(default_factory=list)
    host_blocks: int = 0
    disk_keys: list[Key] = field(default_factory=list)
    version: int = 0  # the pool's cache_version when ``hit`` was found
    restored: int = 0  # blocks of ``hit`` that slices brought back from the tier before the open
    made_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.length = max(self.length, self.first)

    @property
    def first(self) -> int:
        """Full blocks the primary pool held."""
        return self.hit.num_full_blocks

    @property
    def held(self) -> list:
        """The primary hit's blocks (the null block left out)."""
        return [b for chain in self.hit.blocks for b in chain if not b.is_null]

    def holds(self, cache_version: int) -> bool:
        """Whether ``hit`` is still what a search would find: nothing cached or uncached in the pool since."""
        return cache_version == self.version


def lookup_key(tokens: list[int], ctx: HashContext) -> tuple:
    """What a kept lookup is found by: the prompt and everything hashed with it."""
    return (ctx.salt, ctx.extra, ctx.spans, tuple(tokens))


class Lookups:
    """The lookups made for prompts not opened yet, by prompt and hash context (bounded: :data:`MAX_LOOKUPS`)."""

    def __init__(self, max_entries: int = MAX_LOOKUPS, ttl_s: float = LOOKUP_TTL_S):
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._kept: OrderedDict[tuple, PrefixLookup] = OrderedDict()

    def get(self, key: tuple) -> PrefixLookup | None:
        found = self._kept.get(key)
        if found is not None and time.monotonic() - found.made_at > self.ttl_s:
            del self._kept[key]
            return None
        return found

    def put(self, key: tuple, lookup: PrefixLookup) -> None:
        self._kept[key] = lookup
        self._kept.move_to_end(key)
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)

    def pop(self, key: tuple) -> PrefixLookup | None:
        found = self.get(key)
        self._kept.pop(key, None)
        return found

    def __len__(self) -> int:
        return len(self._kept)
