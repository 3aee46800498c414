"""Batched paged decode: one attention layer of B paged sequences, one ``paged_attention`` call for all.

:class:`PagedBatchView` is the paged twin of :class:`mlxkv.kv.batching.dense_views.KVBatchView`: ``offset`` is the
per-sequence offsets ``(B,)``; ``update_and_fetch`` writes the B new rows with one ``kv_write`` into their
slots; ``attend`` runs one ``paged_attention`` over the page arrays with the B block tables padded with the
null block and ``context_lens`` = the new offsets. What ``update_and_fetch`` returns (each sequence's rows
gathered and right-padded) is lazy and never computed on that path; a model that transforms it (MLA) gets
per-sequence dense attention on its own tensors, as the dense view does.

Where the kernel would be the pure-MLX reference (CPU), sequences that share whole prefix pages (a system
prompt served by the prefix cache) attend to them once, through a view of the pages when they are consecutive
(:mod:`mlxkv.kernels.page_views_ref`), instead of each gathering its own copy.

Each sequence must have been ``feed``-ed its decode token before the forward (slots come from the manager).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kernels import paged_attention, quantized_paged_attention, reference_on_views
from mlxkv.kernels.cascade import worth_cascading
from mlxkv.kernels.page_views_ref import runs_attention, shared_prefix_attention
from mlxkv.kernels.quantized_views_ref import quantized_shared_prefix_attention
from mlxkv.kv.batching.dense_views import BatchUnsupported, KVBatchView
from mlxkv.kv.layouts.dense_attention import attend as dense_attend
from mlxkv.kv.paged.layer_cache import MAX_VIEW_RUNS, PagedLayerCache
from mlxkv.kv.paged.step_context import BatchStep

#: Rows x kv heads x head_dim the batched gather would copy per layer from which sequences whose pages lie in a
#: few runs attend in place one by one instead (CPU, 8 sequences of 16K context: 0.50x -> see the README).
PER_SEQUENCE_VIEW_ELEMENTS = 1 << 22


class PagedBatchView(KVBatchView):
    """One paged attention layer of B sequences for one decode forward (then dropped).

    Args:
        caches: the B sequences' :class:`PagedLayerCache` of this layer (same layer, same group).
        step: the group's metadata for this step (block tables, slots), shared by the group's layers.
    """

    def __init__(self, caches: Sequence[PagedLayerCache], step: BatchStep):
        super().__init__(caches)
        first = self.caches[0]
        if any(c.layer != first.layer or c.group != first.group for c in self.caches):
            raise BatchUnsupported("paged caches of different layers or groups in one batch view")
        self.storage = first.seq.storage
        self.step = step

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        """None: the kernel applies each sequence's window / chunk itself. With ``return_array`` (models that
        mask their own scores, MLA): ``(B, 1, 1, Lmax)``, row b true over the rows sequence b will fetch."""
        if N != 1:
            raise BatchUnsupported(f"batch views run decode steps of one token, got {N}")
        if not return_array:
            return None
        lengths = mx.array([c.offset + 1 - c._first_returned(c.offset) for c in self.caches])  # (B,)
        width = max(lengths.tolist())
        return (mx.arange(width)[None] < lengths[:, None]).reshape(len(self.caches), 1, 1, width)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write row b of ``keys``/``values`` (B, n_kv, 1, D) at sequence b's slot (one write for all B);
        return the sequences' rows right-padded, (B, n_kv, Lmax, D) — lazy, unused by the kernel path."""
        caches = self.caches
        slots = self.step.decode_slots()  # (B,)
        for c in caches:
            c._returned = None
        self.storage.write(caches[0].layer, slots, keys[:, :, 0], values[:, :, 0])  # (B, n_kv, D) rows
        for c in caches:
            c.offset += 1
        spans = [(c._first_returned(c.offset - 1), c.offset) for c in caches]  # rows each cache would return
        self._fetched = spans  # (their rows are row b of _returned)
        self._lengths = [end - start for start, end in spans]
        self._returned = self._padded_rows(spans)  # (B, n_kv, Lmax, D) each
        return self._returned

    def _padded_rows(self, spans: list[tuple[int, int]]) -> tuple[mx.array, mx.array]:
        """Sequence b's positions ``spans[b]`` as row b of ``(B, n_kv, Lmax, D)`` keys and values (past its length:
        rows of other pages, finite, never attended). One gather per array whatever B, built lazily: the paged
        attention paths never compute it (building B per-sequence gathers cost ~2-3 ms a step on the CPU)."""
        pages, rows, width = self.step.row_pages(spans, self.storage.block_size)  # (B, P), (B, Lmax) or None

        def padded(p: mx.array) -> mx.array:  # (n_kv, NB, bs, D) -> (B, n_kv, Lmax, D)
            H, D = p.shape[0], p.shape[-1]
            g = mx.take(p, pages, axis=1)  # (n_kv, B, P, bs, D)
            g = g.reshape(H, len(self.caches), -1, D).transpose(1, 0, 2, 3)  # (B, n_kv, P * bs, D)
            return g[:, :, :width] if rows is None else mx.take_along_axis(g, rows[:, None, :, None], axis=2)

        layer = self.caches[0].layer
        if self.storage.quantized:  # each plane gathered alike: (packed, scales, biases) tuples
            k, v = self.storage.planes(layer)
            return tuple(padded(p) for p in k), tuple(padded(p) for p in v)
        kp, vp = self.storage.pages(layer)
        return padded(kp), padded(vp)

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """One ``paged_attention`` call for all B sequences when handed this step's own fetched K/V with no
        mask; else each sequence's dense attention over its slice. queries (B, n_q, 1, D) -> (B, n_q, 1, D_v)."""
        assert self._fetched is not None, "attend before update_and_fetch"
        self.attended = True
        own = self._returned is not None and keys is self._returned[0] and values is self._returned[1]
        if self.storage.quantized:
            return self._attend_quantized(queries, keys, values, scale, mask, sinks)
        first = self.caches[0]
        kp, vp = self.storage.pages(first.layer)  # (n_kv, NB, bs, D) each
        if own and mask is None and kp.shape == vp.shape and queries.shape[-1] == kp.shape[-1]:
            offsets = [c.offset for c in self.caches]
            on_views = self._shared_prefix(queries, kp, vp, offsets, scale, sinks)
            if on_views is None:
                on_views = self._per_sequence_runs(queries, scale, sinks)
            if on_views is not None:
                return on_views
            groups = None  # full-attention layers: shared prefixes worth it attend once (cascade)
            if first.window is None and first.chunk_size is None:
                groups = worth_cascading(self.step.prefix_groups(offsets, self.storage.block_size), offsets,
                                         self.storage.block_size)
            return paged_attention(
                queries, kp, vp, self.step.tables(), mx.array(offsets, dtype=mx.int32), scale=scale,
                window=first.window, chunk_size=first.chunk_size, sinks=sinks, max_context_len=max(offsets),
                prefix_groups=groups,
            )  # (B, n_q, 1, D)
        outs = []
        for b, n in enumerate(self._lengths):
            k, v = keys[b:b + 1, :, :n], values[b:b + 1, :, :n]  # the model's own tensors, sequence b's rows
            m = mask if mask is None or isinstance(mask, str) else mask[b:b + 1] if mask.shape[0] > 1 else mask
            m = m[..., :n] if isinstance(m, mx.array) else m
            outs.append(self.caches[b].attend(queries[b:b + 1], k, v, scale=scale, mask=m, sinks=sinks))
        return mx.concatenate(outs, axis=0)  # (B, n_q, 1, D_v)

    def _attend_quantized(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
                          sinks: mx.array | None) -> mx.array:
        """Quantized pages: where the kernel would be the reference (CPU), sequences sharing whole prefix pages attend
        to them once, in place (:mod:`mlxkv.kernels.quantized_views_ref`); otherwise every sequence's rows gathered
        right-padded (what ``update_and_fetch`` returned, or the model's own tensors) and attended at once with
        ``mx.quantized_matmul``, padding masked out. Where the kernel may run (Metal), this step's own rows go
        through ``quantized_paged_attention`` on the page planes instead."""
        own = self._returned is not None and keys is self._returned[0] and values is self._returned[1]
        first = self.caches[0]
        same_dim = keys[0].shape == values[0].shape and queries.shape[-1] * self.storage.bits == keys[0].shape[-1] * 32
        if own and mask is None and same_dim and not reference_on_views():  # the kernel may run (Metal)
            offsets = [c.offset for c in self.caches]
            return quantized_paged_attention(
                queries, *self.storage.planes(first.layer), self.step.tables(), mx.array(offsets, dtype=mx.int32),
                bits=self.storage.bits, group_size=self.storage.group_size, scale=scale, window=first.window,
                chunk_size=first.chunk_size, sinks=sinks, max_context_len=max(offsets),
            )  # (B, n_q, 1, D)
        if (own and mask is None and sinks is None and first.window is None and first.chunk_size is None
                and reference_on_views()):
            offsets = [c.offset for c in self.caches]
            groups = self.step.prefix_groups(offsets, self.storage.block_size)
            if groups:  # shared prefix pages attended once, in place (the padded gather never computed)
                return quantized_shared_prefix_attention(
                    queries, self.storage.k_rows[first.layer], self.storage.v_rows[first.layer], self.step.tables(),
                    self.step.host_tables(), offsets, groups, scale=scale, bits=self.storage.bits,
                    group_size=self.storage.group_size, block_size=self.storage.block_size)  # (B, n_q, 1, D)
        width = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
        lengths = mx.array(self._lengths, dtype=mx.int32)  # (B,)
        valid = (mx.arange(width, dtype=mx.int32)[None] < lengths[:, None])[:, None, None]  # (B, 1, 1, Lmax)
        if isinstance(mask, mx.array):
            valid = valid & mask if mask.dtype == mx.bool_ else mx.where(valid, mask, -mx.inf)
        storage = self.storage
        return dense_attend(queries, keys, values, scale, valid, sinks, bits=storage.bits,
                            group_size=storage.group_size)  # (B, n_q, 1, D_v)

    def _shared_prefix(self, queries: mx.array, kp: mx.array, vp: mx.array, offsets: list[int], scale: float,
                       sinks: mx.array | None) -> mx.array | None:
        """Where the kernel would be the pure-MLX reference: sequences sharing whole prefix pages attend to
        them once, as a view of the pages (:mod:`mlxkv.kernels.page_views_ref`); None when no group shares
        a page, or for windowed / chunked layers and sinks (the kernel path then runs)."""
        first = self.caches[0]
        if sinks is not None or first.window is not None or first.chunk_size is not None or not reference_on_views():
            return None
        groups = self.step.prefix_groups(offsets, self.storage.block_size)
        if not groups:
            return None
        return shared_prefix_attention(queries, kp, vp, self.step.tables(), self.step.host_tables(), offsets, groups,
                                       scale=scale)

    def _per_sequence_runs(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array | None:
        """Where the kernel would be the pure-MLX reference and its gather would copy many rows (at least
        ``PER_SEQUENCE_VIEW_ELEMENTS``): each sequence attends to its rows in place, run by run, when every
        sequence's rows lie in a few runs of consecutive pages (what a dense batch does: per-sequence SDPA
        on views). None otherwise (the kernel path then runs)."""
        first = self.caches[0]
        if sinks is not None or not reference_on_views():
            return None
        k_rows, v_rows = self.storage.k_rows[first.layer], self.storage.v_rows[first.layer]
        spans = self._fetched  # the rows each sequence attends to (update_and_fetch)
        if sum(end - start for start, end in spans) * k_rows.shape[1] * k_rows.shape[3] < PER_SEQUENCE_VIEW_ELEMENTS:
            return None  # small: one batched gather costs less than B sets of per-run operations
        runs = [c.seq.step.row_runs(c.group, start, end, MAX_VIEW_RUNS) for c, (start, end) in zip(self.caches, spans)]
        if any(r is None for r in runs):
            return None
        outs = [runs_attention(queries[b:b + 1], k_rows, v_rows, r, scale=scale) for b, r in enumerate(runs)]
        return mx.concatenate(outs, axis=0)  # (B, n_q, 1, D)

