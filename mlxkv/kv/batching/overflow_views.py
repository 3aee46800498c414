"""Batched paged decode of a full-attention layer where some sequences run an overflow policy (``--kv-overflow
window|h2o|offload`` on paged storage, :mod:`mlxkv.kv.paged.page_overflow`).

Each sequence attends its *kept* pages only: its block table without the entries its policy dropped, and a context
length counting kept tokens (a sequence without a policy: its whole table). The B new rows are written into their
slots at once; one ``paged_attention`` call then covers every sequence over those compacted tables, and returns the
attention mass per kept position (``with_mass``) that sequences under ``h2o`` or ``offload`` add to their pages (a
model that transforms the keys gets dense attention and :func:`mlxkv.kv.overflow.mass.decode_mass` instead; offload
also scores its offloaded pages' key proxy against the kept rows, which then computes them). What
``update_and_fetch`` returns (each sequence's kept rows, right-padded) is lazy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kernels import paged_attention
from mlxkv.kv.batching.dense_views import BatchUnsupported, KVBatchView
from mlxkv.kv.layouts.dense_attention import attend as dense_attend
from mlxkv.kv.overflow.mass import decode_mass
from mlxkv.kv.paged.step_context import BatchStep


class OverflowBatchView(KVBatchView):
    """One full-attention paged layer of B sequences, some under an overflow policy, for one decode forward.

    Args:
        caches: the B sequences' :class:`~mlxkv.kv.paged.PagedLayerCache` of this layer (same layer and group).
        step: the group's metadata for this step (the new rows' slots), shared by the group's layers.
    """

    def __init__(self, caches: Sequence[Any], step: BatchStep):
        super().__init__(caches)
        first = self.caches[0]
        if first.window is not None or first.chunk_size is not None or first.seq.storage.quantized:
            raise BatchUnsupported("overflow policies run on full-attention, full-precision pages")
        self.storage = first.seq.storage
        self.step = step
        self._kept: list[tuple[list[int], list[int]]] = []  # per sequence: kept table entries and block ids

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
        caches, bs = self.caches, self.storage.block_size
        slots = self.step.decode_slots()  # (B,)
        for c in caches:
            c._returned = None
        self.storage.write(caches[0].layer, slots, keys[:, :, 0], values[:, :, 0])  # (B, n_kv, D) rows
        self._kept = []
        for c in caches:
            c.offset += 1
            table = c.seq.step.host_table(c.group)
            ov = c.overflow
            if ov is None:
                n = -(-c.offset // bs)
                self._kept.append((list(range(n)), list(table[:n])))
            else:
                self._kept.append(ov.kept_pages(table, c.offset))
        self._lengths = [c.offset if c.overflow is None else c.overflow.kept_tokens(c.offset) for c in caches]
        width = max(len(ids) for _, ids in self._kept)
        self._tables = mx.array([ids + [0] * (width - len(ids)) for _, ids in self._kept], dtype=mx.int32)  # (B, P)
        self._fetched = [(0, n) for n in self._lengths]
        kp, vp = self.storage.pages(caches[0].layer)  # (n_kv, NB, bs, D)
        Lmax = max(self._lengths)

        def padded(p: mx.array) -> mx.array:  # (n_kv, NB, bs, D) -> (B, n_kv, Lmax, D)
            g = mx.take(p, self._tables, axis=1)  # (n_kv, B, P, bs, D)
            return g.reshape(p.shape[0], len(caches), -1, p.shape[-1]).transpose(1, 0, 2, 3)[:, :, :Lmax]

        self._returned = (padded(kp), padded(vp))
        return self._returned

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """One ``paged_attention`` over the kept pages' tables, its mass added to the h2o sequences' pages (the
        model's own tensors, masked to each sequence's kept rows, when it transformed them).
        ``queries (B, n_q, 1, D)`` -> ``(B, n_q, 1, D_v)``."""
        assert self._fetched is not None, "attend before update_and_fetch"
        self.attended = True
        own = self._returned is not None and keys is self._returned[0] and values is self._returned[1]
        ranked = [b for b, c in enumerate(self.caches) if c.overflow is not None and c.overflow.needs_mass]
        for b in ranked:  # offload: each offloaded page's estimated share of this attention (page_offload.py)
            host = self.caches[b].overflow.host
            if host is not None and len(host):
                host.estimate(self.caches[b].layer, queries[b:b + 1], keys[b:b + 1, :, :self._lengths[b]], scale,
                              None, sinks)
        kp, vp = self.storage.pages(self.caches[0].layer)
        if own and mask is None and kp.shape == vp.shape and queries.shape[-1] == kp.shape[-1]:
            out = paged_attention(queries, kp, vp, self._tables, mx.array(self._lengths, dtype=mx.int32),
                                  scale=scale, sinks=sinks, max_context_len=max(self._lengths),
                                  with_mass=bool(ranked))  # (B, n_q, 1, D)
            if not ranked:
                return out
            out, mass = out  # mass (B, n_kv, P): each sequence's, by position over its kept pages
            for b in ranked:
                self.caches[b].overflow.add_mass(mass[b, :, :self._lengths[b]], self._kept[b][0])
            return out
        for b in ranked:  # the model's own tensors: a second score pass over each sequence's rows
            n = self._lengths[b]
            self.caches[b].overflow.add_mass(decode_mass(queries[b:b + 1], keys[b:b + 1, :, :n], scale, None, sinks),
                                             self._kept[b][0])  # (n_kv, n) -> its kept pages
        width = keys.shape[2]
        lengths = mx.array(self._lengths, dtype=mx.int32)  # (B,)
        valid = (mx.arange(width, dtype=mx.int32)[None] < lengths[:, None])[:, None, None]  # (B, 1, 1, Lmax)
        return dense_attend(queries, keys, values, scale, valid, sinks)  # (B, n_q, 1, D_v)
