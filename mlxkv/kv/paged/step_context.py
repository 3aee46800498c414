"""Per-step metadata of paged sequences, built on the host before the model's forward and read by every layer.

A model step calls every layer's cache; the layers of one sequence (and, batched, of one group of B sequences)
need the same block tables, slot mappings, context lengths and page runs. :class:`SequenceStep` holds one
sequence's: built when its slots change (``feed`` and ``reserve`` build it before the forward; a forward that
allocates prompt slots itself builds it at its first layer). :class:`BatchStep` holds one group's for a batched
decode step: built once per group before the forward (:func:`mlxkv.kv.batching.make_batch_views`), everything
in it computed there from host lists — block tables, the new rows' slots, context lengths, the rows each sequence
attends, shared prefix groups and the cascade choice, the pages an overflow policy keeps.

Every table is checked on the host against the pool where it is built (:func:`check_host_tables`: ids inside the
pool, contexts inside their table), so a bad table is refused before the forward and the kernels need no device
read-back (``host_checked``). :data:`BUILDS` counts the builds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kernels.cascade import PrefixGroup, find_prefix_groups, worth_cascading
from mlxkv.kernels.geometry import check_host_tables
from mlxkv.kv.paged.page_arrays import page_runs

#: Builds of per-step metadata since start, by kind ("sequence", "batch").
BUILDS: Counter = Counter()


def _padded(rows: Sequence[Sequence[int]], width: int | None = None) -> mx.array:
    """Host id rows as int32 ``(B, width)``, right-padded with the null block."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    return mx.array([list(r) + [0] * (width - len(r)) for r in rows], dtype=mx.int32)  # (B, width)


class SequenceStep:
    """One sequence's metadata for one step, from the manager's host lists.

    Args:
        manager: the block manager; seq_id: the sequence's id there.
        block_size: tokens per block; num_blocks: the pages the storage holds (every table id must be below).

    Raises:
        ValueError: a block table with an id outside the pool.
    """

    def __init__(self, manager: Any, seq_id: int, block_size: int, num_blocks: int):
        BUILDS["sequence"] += 1
        self.manager = manager
        self.seq_id = seq_id
        self.block_size = block_size
        self.host_tables: list[list[int]] = manager.block_tables(seq_id)  # per group (do not modify)
        check_host_tables(self.host_tables, [0] * len(self.host_tables), num_blocks, block_size)
        # (start, end, per group the slots as ints, per group the same as int32 (T,) arrays once asked for)
        self._slots: tuple[int, int, list[list[int]], list[mx.array | None]] | None = None
        self._tables: dict[int, mx.array] = {}  # group -> int32 (n_blocks,)
        self._decode: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}  # (group, context) -> kernel arrays
        self._runs: dict[tuple, tuple] = {}  # page_range results
        #: whether the kernel would be the pure-MLX reference this step (read by the first layer that attends,
        #: :func:`mlxkv.kv.paged.sequence_attention.on_views`)
        self.on_views: bool | None = None

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
        return self.host_tables[group]

    def table(self, group: int) -> mx.array:
        """The block table of ``group`` as int32 ``(n_blocks,)`` (null block 0 where a window released one)."""
        if group not in self._tables:
            self._tables[group] = mx.array(self.host_tables[group], dtype=mx.int32)
        return self._tables[group]

    def decode_tables(self, group: int, context_len: int) -> tuple[mx.array, mx.array]:
        """The kernel's ``block_tables`` int32 ``(1, n_blocks)`` and ``context_lens`` int32 ``(1,)`` for a decode
        step of ``context_len`` tokens in ``group``, checked on the host (shared by the group's layers).

        Raises:
            ValueError: ``context_len`` outside the table.
        """
        key = (group, context_len)
        if key not in self._decode:
            table = self.host_tables[group]  # its ids were checked when this step was built
            if not 0 <= context_len <= len(table) * self.block_size:
                raise ValueError(f"context length {context_len} is outside [0, {len(table) * self.block_size}] "
                                 f"(the table holds {len(table)} blocks of {self.block_size})")
            self._decode[key] = (self.table(group)[None], mx.array([context_len], dtype=mx.int32))
        return self._decode[key]

    def page_range(self, group: int, first: int, end: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Table entries ``[first, end)`` of ``group`` and their runs of consecutive ids
        (:func:`mlxkv.kv.paged.page_arrays.page_runs`)."""
        key = (group, first, end)
        if key not in self._runs:
            ids = self.host_tables[group][first:end]
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
    """One manager group's metadata for a batched decode step of B sequences (one new token each), built on the
    host before the forward and read by the group's layers.

    Args:
        caches: the B sequences' paged layer caches of the group's first layer (their offsets before the step);
            each sequence has been fed its decode token (or its slot is allocated here, before the forward).

    Attributes (host lists unless said otherwise):
        offsets: each sequence's tokens before the step; context_lens: after it (``offsets + 1``).
        host_tables: the B block tables; tables / lens: the same as int32 ``(B, width)`` (null-padded) and ``(B,)``.
        slots: the new rows' flat slots, int32 ``(B,)``.
        spans: the positions ``[start, end)`` each sequence attends (its window / chunk); lengths: their sizes.
        prefix_groups: sequences sharing whole prefix pages (full-attention groups; else empty); cascade: those
            worth attending once (:func:`~mlxkv.kernels.cascade.worth_cascading`).
        kept: under an overflow policy (any sequence), per sequence ``(table entries, block ids)`` of its kept
            pages (a sequence without a policy: its whole table); kept_lens: the kept tokens; kept_tables:
            int32 ``(B, P)``. None without a policy.
        row_pages: ``(pages (B, P) int32, rows (B, Lmax) int32 or None, Lmax)`` for the padded gather of
            ``spans`` (:meth:`~mlxkv.kv.batching.paged_views.PagedBatchView.update_and_fetch`).

    Raises:
        ValueError: a table with an id outside the pool or a context longer than its table (before the forward).
    """

    def __init__(self, caches: Sequence[Any]):
        BUILDS["batch"] += 1
        self.caches = list(caches)
        first = self.caches[0]
        self.storage = first.seq.storage
        self.window, self.chunk_size = first.window, first.chunk_size
        bs = self.block_size = self.storage.block_size
        self.offsets = [c.offset for c in self.caches]
        self.context_lens = [o + 1 for o in self.offsets]
        # slots first: allocating a pending slot changes the tables
        host_slots = [c.seq.host_slots(c.group, o, o + 1)[0] for c, o in zip(self.caches, self.offsets)]
        self.host_tables = [c.seq.step.host_table(c.group) for c in self.caches]
        check_host_tables(self.host_tables, self.context_lens, self.storage.num_blocks, bs)
        self.slots = mx.array(host_slots, dtype=mx.int32)  # (B,)
        self.tables = _padded(self.host_tables)  # (B, width)
        self.lens = mx.array(self.context_lens, dtype=mx.int32)  # (B,)
        self.spans = [(c._first_returned(o), o + 1) for c, o in zip(self.caches, self.offsets)]
        self.lengths = [end - start for start, end in self.spans]
        self.prefix_groups: list[PrefixGroup] = []
        if self.window is None and self.chunk_size is None:
            self.prefix_groups = find_prefix_groups(self.host_tables, self.context_lens, bs, min_group=2,
                                                    min_shared_pages=1)
        self.cascade = worth_cascading(self.prefix_groups, self.context_lens, bs)
        self.kept: list[tuple[list[int], list[int]]] | None = None
        self.kept_lens: list[int] = []
        self.kept_tables: mx.array | None = None
        if any(c.overflow is not None for c in self.caches):
            self._keep()
        self.row_pages = self._row_pages()

    def _keep(self) -> None:
        """The pages each sequence attends under its overflow policy (after this step's row)."""
        bs = self.block_size
        self.kept = []
        for c, table, n in zip(self.caches, self.host_tables, self.context_lens):
            ov = c.overflow
            if ov is None:
                pages = -(-n // bs)
                self.kept.append((list(range(pages)), list(table[:pages])))
            else:
                self.kept.append(ov.kept_pages(table, n))
        self.kept_lens = [n if c.overflow is None else c.overflow.kept_tokens(n)
                          for c, n in zip(self.caches, self.context_lens)]
        self.kept_tables = _padded([ids for _, ids in self.kept])  # (B, P)

    def _row_pages(self) -> tuple[mx.array, mx.array | None, int]:
        """For positions ``spans[b]`` of sequence b: the pages holding them, int32 ``(B, P)`` (null-padded), the
        row of each position within those pages' rows, int32 ``(B, Lmax)`` (None when every span starts a page),
        and ``Lmax``."""
        bs = self.block_size
        firsts = [start // bs for start, _ in self.spans]
        n = max(-(-end // bs) - f for (_, end), f in zip(self.spans, firsts))
        ids = [table[f:f + n] for table, f in zip(self.host_tables, firsts)]
        shifts = [start - f * bs for (start, _), f in zip(self.spans, firsts)]
        width = max(self.lengths)
        rows = None
        if any(shifts):
            rows = mx.minimum(mx.arange(width)[None] + mx.array(shifts)[:, None], n * bs - 1)  # (B, Lmax)
        return _padded(ids, n), rows, width

    def row_runs(self, limit: int) -> list[list[tuple[int, int]]] | None:
        """Each sequence's ``spans[b]`` as runs of stored page rows (:meth:`SequenceStep.row_runs`); None when
        some sequence's rows lie in more than ``limit`` runs or over a released page."""
        runs = [c.seq.step.row_runs(c.group, start, end, limit) for c, (start, end) in zip(self.caches, self.spans)]
        return None if any(r is None for r in runs) else runs
