"""Per-step metadata of paged sequences, built once per model step and read by every layer.

A model step calls every layer's cache; the layers of one sequence (and, batched, of one group of B sequences)
need the same block tables, slot mappings, context lengths and page runs. :class:`SequenceStep` holds one
sequence's, :class:`BatchStep` one group's for a batched decode step; each is computed by the first layer that
asks and shared by the rest. A sequence starts a new step whenever its slots change (feed, commit, trim), so
nothing read here is stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kernels.cascade import PrefixGroup, find_prefix_groups
from mlxkv.kv.paged.page_arrays import page_runs


class SequenceStep:
    """One sequence's metadata for one step.

    Args:
        manager: the block manager; seq_id: the sequence's id there; block_size: tokens per block.
    """

    def __init__(self, manager: Any, seq_id: int, block_size: int):
        self.manager = manager
        self.seq_id = seq_id
        self.block_size = block_size
        # (start, end, per group the slots as ints, per group the same as int32 (T,) arrays once asked for)
        self._slots: tuple[int, int, list[list[int]], list[mx.array | None]] | None = None
        self._tables: list[mx.array] | None = None  # per group, int32 (n_blocks,)
        self._host_tables: list[list[int]] | None = None  # per group, the same ids as Python ints
        self._runs: dict[tuple, tuple] = {}  # page_range results

    def _mapping(self, start: int, end: int) -> tuple:
        if self._slots is None or self._slots[:2] != (start, end):
            mapping = self.manager.slot_mapping(self.seq_id, start, end)
            self._slots = (start, end, mapping, [None] * len(mapping))
        return self._slots

    def slots(self, group: int, start: int, end: int) -> mx.array:
        """Flat slots (int32 ``(end - start,)``) of allocated positions ``[start, end)`` in ``group``."""
        arrays = self._mapping(start, end)[3]
        if arrays[group] is None:
            arrays[group] = mx.array(self._slots[2][group], dtype=mx.int32)
        return arrays[group]

    def host_slots(self, group: int, start: int, end: int) -> list[int]:
        """The slots of :meth:`slots` as Python ints (do not modify)."""
        return self._mapping(start, end)[2][group]

    def host_table(self, group: int) -> list[int]:
        """The block table of ``group`` as a list of ids (do not modify)."""
        if self._host_tables is None:
            self._host_tables = self.manager.block_tables(self.seq_id)
        return self._host_tables[group]

    def table(self, group: int) -> mx.array:
        """The block table of ``group`` as int32 ``(n_blocks,)`` (null block 0 where a window released one)."""
        if self._tables is None:
            self.host_table(group)
            self._tables = [mx.array(t, dtype=mx.int32) for t in self._host_tables]
        return self._tables[group]

    def page_range(self, group: int, first: int, end: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Table entries ``[first, end)`` of ``group`` and their runs of consecutive ids
        (:func:`mlxkv.kv.paged.page_arrays.page_runs`)."""
        key = (group, first, end)
        if key not in self._runs:
            ids = self.host_table(group)[first:end]
            self._runs[key] = (ids, page_runs(ids))
        return self._runs[key]

    def row_runs(self, group: int, start: int, end: int, limit: int) -> list[tuple[int, int]] | None:
        """Positions ``[start, end)`` of ``group`` as ranges ``(first row, rows)`` of the stored page rows
        (:mod:`mlxkv.kv.paged.page_arrays`), consecutive pages merged; None past ``limit`` ranges or over a
        released (null) page."""
        bs = self.block_size
        first_block = start // bs
        _, runs = self.page_range(group, first_block, -(-end // bs))
        if len(runs) > limit or any(b == 0 for b, _ in runs):
            return None
        out, base = [], first_block * bs  # base: position of the run's first page's first row
        for block, n in runs:
            lo, hi = max(start, base), min(end, base + n * bs)
            out.append((block * bs + lo - base, hi - lo))
            base += n * bs
        return out


class BatchStep:
    """One manager group's metadata for a batched decode step of B sequences: their padded block tables, the
    slots of their new rows, prefix groups and row pages (each computed once for the group's layers).

    Args:
        caches: the B sequences' paged layer caches of the group's first layer (their offsets before the step).
    """

    def __init__(self, caches: Sequence[Any]):
        self.caches = list(caches)
        self._tables: mx.array | None = None
        self._slots: mx.array | None = None
        self._groups: list[PrefixGroup] | None = None
        self._row_pages: tuple[mx.array, mx.array | None, int] | None = None

    def decode_slots(self) -> mx.array:
        """The slot of each sequence's new row, int32 ``(B,)`` (at the offsets the step started from)."""
        if self._slots is None:
            host = [s for c in self.caches for s in c.seq.host_slots(c.group, c.offset, c.offset + 1)]
            self._slots = mx.array(host, dtype=mx.int32)  # (B,)
        return self._slots

    def host_tables(self) -> list[list[int]]:
        """The B block tables as lists of ids."""
        return [c.seq.step.host_table(c.group) for c in self.caches]

    def tables(self) -> mx.array:
        """The B block tables, int32 ``(B, width)``, padded with the null block."""
        if self._tables is None:
            rows = [c.seq.step.table(c.group) for c in self.caches]  # B x (n_b,)
            width = max(r.shape[0] for r in rows)
            self._tables = mx.stack([mx.pad(r, (0, width - r.shape[0])) for r in rows])  # (B, width) int32
        return self._tables

    def prefix_groups(self, lens: list[int], block_size: int) -> list[PrefixGroup]:
        """Groups of sequences sharing whole prefix pages this step."""
        if self._groups is None:
            self._groups = find_prefix_groups(self.host_tables(), lens, block_size, min_group=2, min_shared_pages=1)
        return self._groups

    def row_pages(self, spans: list[tuple[int, int]], block_size: int) -> tuple[mx.array, mx.array | None, int]:
        """For positions ``spans[b]`` of sequence b: the pages holding them, int32 ``(B, P)`` (null-padded), the
        row of each position within those pages' rows, int32 ``(B, Lmax)`` (None when every span starts a page),
        and ``Lmax``."""
        if self._row_pages is None:
            firsts = [start // block_size for start, _ in spans]
            n = max(-(-end // block_size) - f for (_, end), f in zip(spans, firsts))
            ids = []
            for c, f in zip(self.caches, firsts):
                row = c.seq.step.host_table(c.group)[f:f + n]
                ids.append(row + [0] * (n - len(row)))
            shifts = [start - f * block_size for (start, _), f in zip(spans, firsts)]
            width = max(end - start for start, end in spans)
            rows = None
            if any(shifts):
                rows = mx.minimum(mx.arange(width)[None] + mx.array(shifts)[:, None], n * block_size - 1)  # (B, Lmax)
            self._row_pages = (mx.array(ids, dtype=mx.int32), rows, width)
        return self._row_pages
