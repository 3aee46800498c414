"""The ``--kv-overflow`` policies on paged storage: whole pages of one sequence evicted past its budget.

One :class:`PageOverflow` per sequence and full-attention group (sliding-window and chunked layers are bounded
already). After each model step (``PagedSequence.commit``), when the sequence's kept tokens pass the budget, it
drops this sequence's reference to whole pages outside the protected ones — the pages holding the first ``sinks``
tokens and the page being written; h2o also the pages holding the last ``recent`` tokens — until the kept tokens
fit the budget:

- ``window``: the oldest unprotected pages (StreamingLLM in pages: the sinks' pages and the most recent pages).
- ``h2o``: the unprotected pages with the lowest accumulated attention mass (the mass summed over the page's
  rows, every KV head and every layer of the group, since one block table serves them all).

Kept pages keep their tokens' positions: keys are paged after RoPE and the layers' offset stays the true position,
while attention reads the *kept* pages only (:meth:`kept_pages`: the block table without the dropped entries, so
context lengths and masks count kept tokens). Dropping a page only removes this sequence's reference
(:meth:`mlxkv.kv.blocks.KVCacheManager.drop_blocks`): a block shared with a fork or held by the prefix cache
stays for them, and pages written after the first eviction attended to a reduced context, so the manager never
caches them for this sequence.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np


class PageOverflow:
    """Per-sequence overflow state of one full-attention group of a paged sequence.

    Args:
        config: the :class:`mlxkv.config.KvOverflowConfig` (window or h2o; checked by its
            ``check_pages``).
        group: the manager group; block_size: tokens per page.
    """

    def __init__(self, config: Any, group: int, block_size: int):
        self.config = config
        self.group = group
        self.block_size = block_size
        self.policy, self.budget, self.sinks = config.policy, config.budget, config.sinks
        self.recent = config.recent_tokens if self.policy == "h2o" else 0
        self.dropped: set[int] = set()  # block-table entries evicted (their positions are gone for good)
        self.evicted_at: int | None = None  # tokens held at the last eviction (the rewind limit)
        self.evicted = 0  # pages evicted so far
        self._mass: mx.array | None = None  # (pages,) float32 accumulated mass per table entry (h2o)

    def clone(self) -> "PageOverflow":
        """An independent copy (a fork's child continues from the parent's statistics)."""
        twin = copy.copy(self)
        twin.dropped = set(self.dropped)
        return twin

    @property
    def needs_mass(self) -> bool:
        """Whether attention must report each row's mass (h2o ranks pages by it)."""
        return self.policy == "h2o"

    def kept_tokens(self, num_tokens: int) -> int:
        """Tokens the sequence still attends of its first ``num_tokens`` (dropped pages are always full)."""
        return num_tokens - len(self.dropped) * self.block_size

    def kept_pages(self, table: list[int], num_tokens: int) -> tuple[list[int], list[int]]:
        """The table entries of positions ``[0, num_tokens)`` that are kept: ``(entry indices, block ids)``."""
        n = -(-num_tokens // self.block_size)
        idx = [i for i in range(n) if i not in self.dropped]
        return idx, [table[i] for i in idx]

    # -- statistics -------------------------------------------------------------------------------------
    def add_mass(self, row_mass: mx.array, entries: list[int]) -> None:
        """Add one layer's ``(n_kv, K)`` row mass over the kept rows (:func:`mlxkv.kv.overflow.mass.decode_mass`),
        ``K`` rows laid out page by page over table ``entries`` (the last page may be partial). Lazy."""
        bs = self.block_size
        rows = row_mass.sum(axis=0)  # (K,)
        pad = len(entries) * bs - rows.shape[0]
        pages = mx.pad(rows, (0, pad)).reshape(len(entries), bs).sum(axis=1)  # (P,)
        size = entries[-1] + 1
        if self._mass is None:
            self._mass = mx.zeros((size,), dtype=mx.float32)
        elif self._mass.shape[0] < size:
            self._mass = mx.pad(self._mass, (0, size - self._mass.shape[0]))
        self._mass = self._mass.at[mx.array(entries, dtype=mx.int32)].add(pages)

    def arrays(self) -> list[mx.array]:
        """The lazy statistics, to evaluate along with a step."""
        return [self._mass] if self._mass is not None else []

    # -- eviction ---------------------------------------------------------------------------------------
    def plan(self, num_tokens: int) -> list[int]:
        """Table entries to drop so that at most ``budget`` of the first ``num_tokens`` tokens stay attended (as
        many as the protected pages allow); empty while they fit."""
        bs = self.block_size
        excess = self.kept_tokens(num_tokens) - self.budget
        if excess <= 0:
            return []
        front = -(-self.sinks // bs)  # pages holding a sink token
        end = min((num_tokens - 1) // bs, (num_tokens - self.recent) // bs)  # before the written / recent pages
        candidates = [i for i in range(front, end) if i not in self.dropped]
        if self.policy == "h2o" and candidates:
            mass = np.zeros(end, np.float64)  # pages never attended yet (none, in practice) rank lowest
            if self._mass is not None:
                have = np.array(self._mass[:end])  # evaluates the lazy sums: once per eviction
                mass[: have.shape[0]] = have
            candidates.sort(key=lambda i: (mass[i], i))  # lowest mass first, then the oldest
        return sorted(candidates[: -(-excess // bs)])

    def evict(self, manager: Any, seq_id: int, num_tokens: int) -> list[int]:
        """Drop the pages :meth:`plan` names from ``seq_id``'s table (through the manager); returns them."""
        entries = self.plan(num_tokens)
        if entries:
            manager.drop_blocks(seq_id, self.group, entries)
            self.dropped.update(entries)
            self.evicted += len(entries)
            self.evicted_at = num_tokens
        return entries
