"""PagedLayerCache: one sequence's view of one attention layer's pages, in mlx-lm's cache protocol.

``update_and_fetch`` writes the new rows into their page slots (``kv_write``) and returns the rows the new
queries may attend: full attention all rows, a sliding window of W the last ``W - 1`` before the new ones,
chunked attention the rows from the current chunk's start (what the dense layouts return for the same
positions, so masks and logits match). When those rows' pages are consecutive in the pool (a fresh pool hands
a sequence consecutive blocks) they come back as a zero-copy *view* in a dense cache's exact layout; otherwise
as *lazy* gathers of the pages.

``attend`` hands the call to the sequence's attention backend (one per storage kind,
:mod:`mlxkv.kv.paged.sequence_attention`), which chooses between the paged kernel, page runs attended in place,
dense SDPA on a view, and dense SDPA on the tensors the model handed over.

Quantized pages (:mod:`mlxkv.kv.paged.quantized_pages`): ``update_and_fetch`` returns mlx-lm's quantized
``(packed, scales, biases)`` tuples (views of consecutive pages, else gathers of the planes).

On the reference path a write whose slots are known on the host and form one or two in-page runs (every decode
row) is a static slice update of the stored rows, exactly a dense cache's append.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.kernels.kv_write_ref import slot_runs
from mlxkv.kv.blocks import KVCacheGroupSpec
from mlxkv.kv.layouts.base import RewindError
from mlxkv.kv.layouts.fetched_rows import FetchedRows
from mlxkv.kv.layouts.masks import standard_mask, visible
from mlxkv.kv.paged.page_arrays import is_view, page_runs
from mlxkv.kv.paged.paged_sequence import PagedSequence

#: A write whose slots form at most this many in-page runs uses static slice updates instead of a scatter
#: (a decode row is one run; a prefill chunk needs one per page and a scatter is then fewer operations).
MAX_SLICE_RUNS = 2


class PagedLayerCache:
    """Paged cache of one layer of one sequence (full, sliding window or chunked, from ``spec``).

    Args:
        seq: the sequence (manager bridge, shared by its layers).
        layer: model layer index (selects the page arrays).
        group: manager group index of this layer; spec: that group's spec.
    """

    def __init__(self, seq: PagedSequence, layer: int, group: int, spec: KVCacheGroupSpec):
        self.seq = seq
        self.layer = layer
        self.group = group
        self.spec = spec
        self.offset = seq.num_cached
        self.fetched = FetchedRows()  # this step's fetched K/V, their positions, whether a view of the pages

    # -- geometry ----------------------------------------------------------------------------------
    @property
    def window(self) -> int | None:
        return self.spec.attention.window

    @property
    def chunk_size(self) -> int | None:
        return self.spec.attention.chunk_size

    @property
    def start_position(self) -> int:
        """First position returned for the next tokens (llama4 reads it to build its chunk mask)."""
        return self._first_returned(self.offset)

    def _first_returned(self, offset: int) -> int:
        """First key position ``update_and_fetch`` returns for new tokens starting at ``offset``: the first one
        the query at ``offset`` still attends."""
        return self.spec.attention.first_needed(offset)

    def maybe_trim_front(self) -> None:
        """llama4 calls this before each forward; the manager releases blocks leaving the chunk."""

    # -- protocol ----------------------------------------------------------------------------------
    def _pages(self, start: int, end: int) -> tuple[list[int], list[tuple[int, int]], int]:
        """Page ids of positions ``[start, end)``, their runs of consecutive ids, and ``start``'s row in the first
        page (memoised per step by the sequence)."""
        bs = self.seq.storage.block_size
        first_block = start // bs
        ids, runs = self.seq.step.page_range(self.group, first_block, -(-end // bs))
        return ids, runs, start - first_block * bs

    @property
    def overflow(self) -> Any:
        """This layer's group's :class:`~mlxkv.kv.paged.page_overflow.PageOverflow` (``--kv-overflow``), or None."""
        return self.seq.overflow.get(self.group) if self.seq.overflow else None

    def _kept(self, end: int) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
        """Under an overflow policy that dropped pages: the kept table entries of positions ``[0, end)``, their
        block ids and runs; None while every page is kept."""
        ov = self.overflow
        if ov is None or not ov.dropped:
            return None
        entries, ids = ov.kept_pages(self.seq.step.host_table(self.group), end)
        return entries, ids, page_runs(ids)

    def _fetch(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Positions ``[start, end)`` as ``(1, n_kv, end - start, D)`` (a view when the pages are consecutive);
        under an overflow policy the kept rows of ``[0, end)`` (full attention: ``start`` is 0)."""
        kept = self._kept(end)
        if kept is not None:
            return self.seq.storage.gather(self.layer, kept[1], 0, self.overflow.kept_tokens(end), kept[2])
        ids, runs, first = self._pages(start, end)
        return self.seq.storage.gather(self.layer, ids, first, end - start, runs)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``(1, n_kv, N, D)`` rows at ``offset``; return the attendable rows ``(1, n_kv, K, D)`` (lazy)."""
        self.fetched.clear()  # no view of the old pages may outlive this write
        if keys.shape[0] != 1:
            raise ValueError(f"a paged layer cache holds one sequence; got a batch of {keys.shape[0]}")
        o, N = self.offset, keys.shape[2]
        storage = self.seq.storage
        runs = None  # more rows than MAX_SLICE_RUNS pages hold cannot be that few runs: skip the host scan
        if N <= MAX_SLICE_RUNS * storage.block_size:
            runs = slot_runs(self.seq.host_slots(self.group, o, o + N), storage.block_size)
        if runs is not None and len(runs) <= MAX_SLICE_RUNS:
            storage.write_runs(self.layer, runs, keys, values)  # (1, n_kv, N, D): static slice updates
        else:
            slots = self.seq.slots(self.group, o, o + N)  # (N,)
            storage.write(self.layer, slots, keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))
        self.offset = o + N
        start = self._first_returned(o)
        kept = self._kept(o + N)
        view = is_view(kept[2] if kept is not None else self._pages(start, o + N)[1])
        return self.fetched.record(*self._fetch(start, o + N), span=(start, o + N), view=view)

    def refetch(self) -> tuple[mx.array, mx.array]:
        """What the last ``update_and_fetch`` returned, read again from the current page arrays.

        For a forward in which other sequences then wrote the same layer (batched prefill): a view of the arrays
        as they were keeps that version alive, and MLX then copies the whole page array at each later write
        instead of updating it in place."""
        f = self.fetched
        return f.record(*self._fetch(*f.span), span=f.span, view=f.view)

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """The sequence's attention backend (:mod:`mlxkv.kv.paged.sequence_attention`), told whether it was handed
        this step's fetched rows and whether they were a view of the pages; the record is consumed (the next
        write then updates the pages in place)."""
        fetched = self.fetched
        own, view = fetched.handed_back(keys, values), fetched.view
        fetched.clear()
        return self.seq.attention.attend(self, own, view, queries, keys, values, scale, mask, sinks)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for ``N`` new queries over the rows ``update_and_fetch`` will return (as the dense layouts)."""
        o, window, chunk = self.offset, self.window, self.chunk_size
        kept = self._kept(o)
        if kept is not None:  # every kept row is older than the new queries: causal over [kept][new]
            if window_size is not None:
                raise ValueError("an overflow policy serves full-attention layers only (no window_size)")
            if not return_array:
                return None if N == 1 else "causal"
            K = self.overflow.kept_tokens(o) + N
            return mx.arange(K - N, K)[:, None] >= mx.arange(K)[None]  # (N, K)
        if window is None and chunk is None:
            return standard_mask(N, o, return_array, window_size)
        start = self._first_returned(o)
        q, k = mx.arange(o, o + N), mx.arange(start, o + N)
        if window is not None:
            w = window if window_size is None else min(window_size, window)
            if not return_array and (o + N - 1) - start < w:
                return None if N == 1 else "causal"
            return visible(q, k, w)
        C = chunk
        if not return_array and window_size is None and (o + N - 1) // C * C == start:
            return None if N == 1 else "causal"
        return visible(q, k, window_size) & ((q[:, None] // C) == (k[None] // C))  # (N, K)

    def size(self) -> int:
        ov = self.overflow
        dropped = len(ov.dropped) * self.seq.storage.block_size if ov is not None else 0
        return self.offset - self._first_returned(self.offset) - dropped

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def rewindable(self) -> int:
        ov = self.overflow
        if ov is not None and ov.evicted_at is not None:
            return max(0, self.offset - ov.evicted_at)  # the dropped pages cannot come back
        return self.offset

    def rewind_to(self, position: int) -> None:
        """Move the write position back to ``position``, keeping the slots allocated after it (and the prompt
        tokens they belong to): a forward that failed before its commit is retried over the same slots, and its
        rows are written again. Unlike :meth:`trim`, the manager is not told."""
        if not 0 <= position <= self.offset:
            raise ValueError(f"rewind_to({position}) outside [0, {self.offset}]")
        self.fetched.clear()
        self.offset = position

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens through the manager (emptied blocks go back to the pool); returns the
        number removed (less when a window's released block was evicted meanwhile)."""
        target = self.offset - min(max(int(n), 0), self.offset)
        if self.offset - target > self.rewindable():
            raise RewindError(f"cannot rewind {self.offset - target} tokens: an overflow policy evicted pages "
                              f"{self.rewindable()} tokens back")
        self.fetched.clear()
        if self.seq.num_tokens > target:
            self.seq.trim_to(target)
        new = min(self.offset, max(target, self.seq.num_tokens))
        removed, self.offset = self.offset - new, new
        return removed

    @property
    def nbytes(self) -> int:
        """This sequence's share of this layer's pages: its blocks x bytes per block of the layer."""
        return self.seq.blocks_held(self.group) * self.seq.layer_block_bytes[self.layer]

    def arrays(self) -> list[mx.array]:
        """The layer's page arrays (for ``mx.eval`` between prefill chunks)."""
        s = self.seq.storage
        stored = [a for a in (s.k_rows[self.layer], s.v_rows[self.layer]) if a is not None]
        return [p for a in stored for p in a] if s.quantized else stored  # quantized: three planes apiece

    @property
    def state(self) -> tuple:
        """``(keys, values)``: the rows the last token attended, gathered densely (read-only: no
        ``from_state``; the offset is ``self.offset``)."""
        if self.offset == 0 or not self.seq.storage.allocated(self.layer):
            return (None, None)
        return self._fetch(self._first_returned(self.offset - 1), self.offset)
