"""The ``--kv-overflow`` policies on paged storage: whole pages of one sequence evicted past its budget.

One :class:`PageOverflow` per sequence and full-attention group (sliding-window and chunked layers are bounded
already). After each model step (``PagedSequence.commit``), when the sequence's kept tokens pass the budget, it
drops this sequence's reference to whole pages outside the protected ones — the pages holding the first ``sinks``
tokens and the page being written; h2o also the pages holding the last ``recent`` tokens — until the kept tokens
fit the budget:

- ``window``: the oldest unprotected pages (StreamingLLM in pages: the sinks' pages and the most recent pages).
- ``h2o``: the unprotected pages with the lowest accumulated attention mass (the mass summed over the page's
  rows, every KV head and every layer of the group, since one block table serves them all).
- ``offload``: h2o's pages, copied to this sequence's host store first (:mod:`mlxkv.kv.paged.page_offload`);
  after a step, the offloaded pages whose estimated share of its attention passed ``restore_threshold`` (at most
  ``restore_limit`` pages a step) get a new block, their exact K/V back and their table entry again, and the
  eviction makes room for them. A restored block is never cached (as every block written after an eviction).
  The host pages are freed when the sequence is released (ended, cancelled or preempted: a preempted sequence is
  prefilled again from its tokens and starts over); a fork shares them (:meth:`PageHostStore.clone`).

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

from mlxkv.kv.paged.page_offload import PageHostStore


def restore_limit(budget: int, block_size: int) -> int:
    """Pages the offload policy restores at most per step: the dense policy's ``budget // 8`` rows, in pages."""
    return max(1, budget // 8 // block_size)


class PageOverflow:
    """Per-sequence overflow state of one full-attention group of a paged sequence.

    Args:
        config: the :class:`mlxkv.config.KvOverflowConfig` (window, h2o or offload; checked by its
            ``check_pages``).
        group: the manager group; block_size: tokens per page.
        layers: the group's layers (offload copies their pages).
    """

    def __init__(self, config: Any, group: int, block_size: int, layers: list[int] | None = None):
        self.config = config
        self.group = group
        self.block_size = block_size
        self.policy, self.budget, self.sinks = config.policy, config.budget, config.sinks
        self.recent = config.recent_tokens if self.policy in ("h2o", "offload") else 0
        self.dropped: set[int] = set()  # block-table entries evicted (their positions are gone for good)
        self.evicted_at: int | None = None  # tokens held at the last eviction (the rewind limit)
        self.evicted = 0  # pages evicted so far
        self._mass: mx.array | None = None  # (pages,) float32 accumulated mass per table entry (h2o, offload)
        self.host = PageHostStore(layers or [], block_size) if self.policy == "offload" else None
        self.restored = 0  # pages brought back from the host store so far (offload)

    def clone(self) -> "PageOverflow":
        """An independent copy (a fork's child continues from the parent's statistics)."""
        twin = copy.copy(self)
        twin.dropped = set(self.dropped)
        twin.host = self.host.clone() if self.host is not None else None
        return twin

    @property
    def needs_mass(self) -> bool:
        """Whether attention must report each row's mass (h2o ranks pages by it)."""
        return self.policy in ("h2o", "offload")

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
        host = self.host.arrays() if self.host is not None else []
        return ([self._mass] if self._mass is not None else []) + host

    # -- eviction ---------------------------------------------------------------------------------------
    def plan(self, num_tokens: int, extra: int = 0) -> list[int]:
        """Table entries to drop so that at most ``budget`` of the first ``num_tokens`` tokens (plus ``extra``
        tokens about to be restored) stay attended (as many as the protected pages allow); empty while they fit."""
        bs = self.block_size
        excess = self.kept_tokens(num_tokens) + extra - self.budget
        if excess <= 0:
            return []
        front = -(-self.sinks // bs)  # pages holding a sink token
        end = min((num_tokens - 1) // bs, (num_tokens - self.recent) // bs)  # before the written / recent pages
        candidates = [i for i in range(front, end) if i not in self.dropped]
        if self.needs_mass and candidates:
            mass = np.zeros(end, np.float64)  # pages never attended yet (none, in practice) rank lowest
            if self._mass is not None:
                have = np.array(self._mass[:end])  # evaluates the lazy sums: once per eviction
                mass[: have.shape[0]] = have
            candidates.sort(key=lambda i: (mass[i], i))  # lowest mass first, then the oldest
        return sorted(candidates[: -(-excess // bs)])

    def evict(self, seq: Any, num_tokens: int) -> bool:
        """After a step of ``seq`` (a :class:`~mlxkv.kv.paged.PagedSequence`) holding ``num_tokens``: drop the
        pages :meth:`plan` names from its table through the manager (offload: copied to the host store first, and
        the pages this step's estimates picked restored); returns whether its table changed."""
        picks = self.host.picks(self.config.restore_threshold, restore_limit(self.budget, self.block_size)) \
            if self.host is not None else []
        entries = self.plan(num_tokens, extra=len(picks) * self.block_size)
        manager = seq.manager
        if entries:
            if self.host is not None:
                table = manager.block_tables(seq.seq_id)[self.group]
                self.host.offload(seq.storage, entries, [table[i] for i in entries])
            manager.drop_blocks(seq.seq_id, self.group, entries)
            self.dropped.update(entries)
            self.evicted += len(entries)
            self.evicted_at = num_tokens
        restored = self._restore(seq, picks, num_tokens) if picks else 0
        return bool(entries) or restored > 0

    def _restore(self, seq: Any, picks: list[tuple[int, float]], num_tokens: int) -> int:
        """Bring ``picks`` (``(entry, estimated mass)``) back from the host store while the budget and the pool
        allow; returns how many came back."""
        bs, n = self.block_size, 0
        for entry, mass in picks:
            if self.kept_tokens(num_tokens) + bs > self.budget:
                break  # the protected pages left no room
            block = seq.manager.restore_block(seq.seq_id, self.group, entry)
            if block is None:
                break  # the pool is full: the page stays on the host
            slots = mx.arange(block * bs, (block + 1) * bs, dtype=mx.int32)  # (bs,)
            for layer, (k, v) in self.host.take(entry).items():
                seq.storage.write(layer, slots, k, v)  # (bs, n_kv, D) rows into the new page
            self.dropped.discard(entry)
            # this step's estimate is the mass the page would have received: it ranks with the kept pages
            if self._mass is None or self._mass.shape[0] <= entry:
                have = 0 if self._mass is None else self._mass.shape[0]
                self._mass = mx.zeros((entry + 1,), mx.float32) if self._mass is None else \
                    mx.pad(self._mass, (0, entry + 1 - have))
            self._mass = self._mass.at[entry].add(mass)
            self.evicted_at = num_tokens
            n += 1
        self.restored += n
        return n

    def release(self) -> None:
        """The sequence ended or was preempted: free its host pages."""
        if self.host is not None:
            self.host.clear()
