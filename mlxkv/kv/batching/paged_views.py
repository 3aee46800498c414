"""Batched paged decode: one attention layer of B paged sequences, written and fetched as one.

:class:`PagedBatchView` is the paged twin of :class:`mlxkv.kv.batching.dense_views.KVBatchView`: ``offset`` is the
per-sequence offsets ``(B,)``; ``update_and_fetch`` writes the B new rows with one ``kv_write`` into their
slots and returns each sequence's rows gathered and right-padded (lazy: never computed on the paged paths);
``attend`` hands the call to the group's attention backend (:mod:`mlxkv.kv.batching.attention_backends`), whose
path was chosen once for the step from the group's host-built metadata
(:class:`~mlxkv.kv.paged.step_context.BatchStep`: block tables, slots, context lengths, prefix groups).

Each sequence must have been ``feed``-ed its decode token before the forward (slots come from the manager).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kv.batching.dense_views import BatchUnsupported, KVBatchView
from mlxkv.kv.paged.layer_cache import PagedLayerCache
from mlxkv.kv.paged.step_context import BatchStep


class PagedBatchView(KVBatchView):
    """One paged attention layer of B sequences for one decode forward (then dropped).

    Args:
        caches: the B sequences' :class:`PagedLayerCache` of this layer (same layer, same group).
        step: the group's metadata for this step, shared by the group's layers.
        backend: the group's attention backend for this step
            (:func:`~mlxkv.kv.batching.attention_backends.backend_for`).
    """

    def __init__(self, caches: Sequence[PagedLayerCache], step: BatchStep, backend: Any):
        super().__init__(caches)
        first = self.caches[0]
        if any(c.layer != first.layer or c.group != first.group for c in self.caches):
            raise BatchUnsupported("paged caches of different layers or groups in one batch view")
        self.storage = first.seq.storage
        self.step = step
        self.backend = backend

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        """None: the kernel applies each sequence's window / chunk itself. With ``return_array`` (models that
        mask their own scores, MLA): ``(B, 1, 1, Lmax)``, row b true over the rows sequence b will fetch."""
        if N != 1:
            raise BatchUnsupported(f"batch views run decode steps of one token, got {N}")
        if not return_array:
            return None
        width = max(self.step.lengths)
        lengths = mx.array(self.step.lengths)  # (B,)
        return (mx.arange(width)[None] < lengths[:, None]).reshape(len(self.caches), 1, 1, width)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write row b of ``keys``/``values`` (B, n_kv, 1, D) at sequence b's slot (one write for all B);
        return the sequences' rows right-padded, (B, n_kv, Lmax, D) — lazy, unused by the paged paths."""
        self._write(keys, values)
        return self.fetched.record(*self._padded_rows(), span=self.step.spans)  # (B, n_kv, Lmax, D) each

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """The B new rows into their slots; each cache's offset advances by one."""
        for c in self.caches:
            c.fetched.clear()  # no view of the old pages may outlive this write
        self.storage.write(self.caches[0].layer, self.step.slots, keys[:, :, 0], values[:, :, 0])  # (B, n_kv, D)
        for c in self.caches:
            c.offset += 1
        self._fetched = self.step.spans  # the rows each sequence attends (row b of what is returned)
        self._lengths = self.step.lengths

    def _padded_rows(self) -> tuple[mx.array, mx.array]:
        """Sequence b's positions ``step.spans[b]`` as row b of ``(B, n_kv, Lmax, D)`` keys and values (past its
        length: rows of other pages, finite, never attended). One gather per array whatever B, built lazily: the
        paged attention paths never compute it (building B per-sequence gathers cost ~2-3 ms a step on the CPU)."""
        pages, rows, width = self.step.row_pages  # (B, P), (B, Lmax) or None

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
        """The group's backend on its chosen path (each sequence's attention over its slice of the model's own
        tensors when it transformed them or masks its own scores). queries (B, n_q, 1, D) -> (B, n_q, 1, D_v)."""
        assert self._fetched is not None, "attend before update_and_fetch"
        self.attended = True
        return self.backend.attend(self, queries, keys, values, scale, mask, sinks)
