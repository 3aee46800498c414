"""Batched paged decode of a full-attention layer where some sequences run an overflow policy (``--kv-overflow
window|h2o|offload`` on paged storage, :mod:`mlxkv.kv.paged.page_overflow`).

Each sequence attends its *kept* pages only: its block table without the entries its policy dropped, and a context
length counting kept tokens (a sequence without a policy: its whole table), computed on the host before the forward
(:attr:`~mlxkv.kv.paged.step_context.BatchStep.kept`). The B new rows are written into their slots at once; the
group's backend (:class:`~mlxkv.kv.batching.attention_backends.KeptPagesAttention`) then runs one
``paged_attention`` call over every sequence's compacted table, with the attention mass per kept position that
sequences under ``h2o`` or ``offload`` add to their pages. What ``update_and_fetch`` returns (each sequence's kept
rows, right-padded) is lazy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kv.batching.dense_views import BatchUnsupported
from mlxkv.kv.batching.paged_views import PagedBatchView
from mlxkv.kv.paged.step_context import BatchStep


class OverflowBatchView(PagedBatchView):
    """One full-attention paged layer of B sequences, some under an overflow policy, for one decode forward.

    Args:
        caches: the B sequences' :class:`~mlxkv.kv.paged.PagedLayerCache` of this layer (same layer and group).
        step: the group's metadata for this step (slots, kept pages), shared by the group's layers.
        backend: the group's :class:`~mlxkv.kv.batching.attention_backends.KeptPagesAttention`.
    """

    def __init__(self, caches: Sequence[Any], step: BatchStep, backend: Any):
        super().__init__(caches, step, backend)
        first = self.caches[0]
        if first.window is not None or first.chunk_size is not None or first.seq.storage.quantized:
            raise BatchUnsupported("overflow policies run on full-attention, full-precision pages")

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        """None: every kept row is visible to the one new query."""
        if N != 1:
            raise BatchUnsupported(f"batch views run decode steps of one token, got {N}")
        if return_array or window_size is not None:
            raise BatchUnsupported("a model masking its own scores over kept pages")
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write row b of ``keys``/``values`` ``(B, n_kv, 1, D)`` at sequence b's slot; return every sequence's kept
        rows right-padded, ``(B, n_kv, Lmax, D)`` (lazy)."""
        self._write(keys, values)
        lengths = self.step.kept_lens
        self._fetched = [(0, n) for n in lengths]
        self._lengths = lengths
        kp, vp = self.storage.pages(self.caches[0].layer)  # (n_kv, NB, bs, D)
        tables, Lmax, B = self.step.kept_tables, max(lengths), len(self.caches)

        def padded(p: mx.array) -> mx.array:  # (n_kv, NB, bs, D) -> (B, n_kv, Lmax, D)
            g = mx.take(p, tables, axis=1)  # (n_kv, B, P, bs, D)
            return g.reshape(p.shape[0], B, -1, p.shape[-1]).transpose(1, 0, 2, 3)[:, :, :Lmax]

        return self.fetched.record(padded(kp), padded(vp), span=self._fetched)
