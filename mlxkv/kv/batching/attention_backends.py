"""Batched paged decode attention: one backend per storage kind, its path chosen once per step.

:func:`backend_for` builds, for one manager group of one batched decode step, the backend of its storage kind —
full-precision pages, quantized pages, or pages under an overflow policy — from the group's
:class:`~mlxkv.kv.paged.step_context.BatchStep` (built on the host before the forward). The backend chooses its
path there, once for every layer of the group:

- full-precision pages: where the kernel would be the pure-MLX reference (the CPU), sequences sharing whole prefix
  pages attend to them once as views of the pages (``SHARED_PREFIX``); else, when the batched gather would copy
  many rows and every sequence's rows lie in a few runs of consecutive pages, each sequence attends its runs in
  place (``SEQUENCE_RUNS``); else one ``paged_attention`` over the B tables, shared prefixes worth it through the
  cascade (``KERNEL``);
- quantized pages: the quantized kernel where it may run (``QUANTIZED_KERNEL``, Metal), else shared prefix pages once
  in place (``QUANTIZED_SHARED_PREFIX``), else every sequence's rows gathered and attended with
  ``mx.quantized_matmul`` (``QUANTIZED_DENSE``);
- pages under an overflow policy: one ``paged_attention`` over the kept pages' tables, with the attention mass
  the ranking policies add (``KEPT_PAGES``).

The batch views (:mod:`~mlxkv.kv.batching.paged_views`, :mod:`~mlxkv.kv.batching.overflow_views`) only write and
fetch; their ``attend`` hands the call to the backend. What the step cannot decide is checked per call: whether
the model handed back the rows the view fetched (:class:`~mlxkv.kv.layouts.fetched_rows.FetchedRows`), its mask and
its sinks; a call the chosen path cannot serve gets each sequence's attention over the model's own tensors.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import mlx.core as mx

from mlxkv.kernels import paged_attention, quantized_paged_attention, reference_on_views
from mlxkv.kernels.page_views_ref import runs_attention, shared_prefix_attention
from mlxkv.kernels.quantized_views_ref import quantized_shared_prefix_attention
from mlxkv.kv.layouts.dense_attention import attend as dense_attend
from mlxkv.kv.overflow.mass import decode_mass
from mlxkv.kv.paged.sequence_attention import MAX_VIEW_RUNS
from mlxkv.kv.paged.step_context import BatchStep

#: Rows x kv heads x head_dim the batched gather would copy per layer from which sequences whose pages lie in a
#: few runs attend in place one by one instead (CPU, 8 sequences of 16K context: 0.50x -> see the README).
PER_SEQUENCE_VIEW_ELEMENTS = 1 << 22


class DecodePath(Enum):
    """How one group's layers attend in one batched decode step (see the module docstring)."""

    KERNEL = "kernel"
    SHARED_PREFIX = "shared prefix views"
    SEQUENCE_RUNS = "sequence runs"
    QUANTIZED_KERNEL = "quantized kernel"
    QUANTIZED_SHARED_PREFIX = "quantized shared prefix"
    QUANTIZED_DENSE = "quantized dense"
    KEPT_PAGES = "kept pages"


def _valid_rows(lengths: list[int], width: int) -> mx.array:
    """Row b true over its first ``lengths[b]`` of ``width`` keys: ``(B, 1, 1, width)``."""
    lens = mx.array(lengths, dtype=mx.int32)  # (B,)
    return (mx.arange(width, dtype=mx.int32)[None] < lens[:, None])[:, None, None]


class PagesAttention:
    """Full-precision pages of one group for one batched decode step.

    Args:
        step: the group's metadata (host-built, checked).
    """

    def __init__(self, step: BatchStep):
        self.step = step
        self.storage = step.storage
        self.full = step.window is None and step.chunk_size is None
        self.runs: list[list[tuple[int, int]]] | None = None
        self.path = self._choose()

    def _choose(self) -> DecodePath:
        step = self.step
        if not reference_on_views():
            return DecodePath.KERNEL
        if self.full and step.prefix_groups:
            return DecodePath.SHARED_PREFIX
        k_rows = self.storage.k_rows[step.caches[0].layer]
        if (k_rows is not None and sum(step.lengths) * k_rows.shape[1] * k_rows.shape[3] >= PER_SEQUENCE_VIEW_ELEMENTS):
            self.runs = step.row_runs(MAX_VIEW_RUNS)  # large: B sets of per-run operations beat one batched gather
            if self.runs is not None:
                return DecodePath.SEQUENCE_RUNS
        return DecodePath.KERNEL

    def attend(self, view: Any, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None) -> mx.array:
        """``queries (B, n_q, 1, D)`` -> ``(B, n_q, 1, D_v)`` for the view's layer."""
        layer = view.caches[0].layer
        kp, vp = self.storage.pages(layer)  # (n_kv, NB, bs, D) each
        if not (view.fetched.handed_back(keys, values) and mask is None and kp.shape == vp.shape
                and queries.shape[-1] == kp.shape[-1]):
            return per_sequence(view, queries, keys, values, scale, mask, sinks)
        step = self.step
        if sinks is None and self.path is DecodePath.SHARED_PREFIX:  # shared prefix pages once, as views
            return shared_prefix_attention(queries, kp, vp, step.tables, step.host_tables, step.context_lens,
                                           step.prefix_groups, scale=scale)  # (B, n_q, 1, D)
        if sinks is None and self.path is DecodePath.SEQUENCE_RUNS:  # each sequence's page runs in place
            k_rows, v_rows = self.storage.k_rows[layer], self.storage.v_rows[layer]
            outs = [runs_attention(queries[b:b + 1], k_rows, v_rows, r, scale=scale) for b, r in enumerate(self.runs)]
            return mx.concatenate(outs, axis=0)  # (B, n_q, 1, D)
        return paged_attention(
            queries, kp, vp, step.tables, step.lens, scale=scale, window=step.window, chunk_size=step.chunk_size,
            sinks=sinks, max_context_len=max(step.context_lens), prefix_groups=step.cascade if self.full else None,
            host_checked=True,
        )  # (B, n_q, 1, D)


class QuantizedPagesAttention(PagesAttention):
    """Quantized pages (``--kv-bits``) of one group for one batched decode step."""

    def _choose(self) -> DecodePath:
        if not reference_on_views():
            return DecodePath.QUANTIZED_KERNEL
        if self.full and self.step.prefix_groups:
            return DecodePath.QUANTIZED_SHARED_PREFIX
        return DecodePath.QUANTIZED_DENSE

    def attend(self, view: Any, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None) -> mx.array:
        """The chosen path for this step's own rows with no mask; otherwise every sequence's rows right-padded (what
        ``update_and_fetch`` returned, or the model's own tensors) attended at once with ``mx.quantized_matmul``,
        padding masked out."""
        step, storage, layer = self.step, self.storage, view.caches[0].layer
        own = view.fetched.handed_back(keys, values) and mask is None
        same_dim = keys[0].shape == values[0].shape and queries.shape[-1] * storage.bits == keys[0].shape[-1] * 32
        if own and same_dim and self.path is DecodePath.QUANTIZED_KERNEL:
            return quantized_paged_attention(
                queries, *storage.planes(layer), step.tables, step.lens, bits=storage.bits,
                group_size=storage.group_size, scale=scale, window=step.window, chunk_size=step.chunk_size,
                sinks=sinks, max_context_len=max(step.context_lens), host_checked=True,
            )  # (B, n_q, 1, D)
        if own and sinks is None and self.path is DecodePath.QUANTIZED_SHARED_PREFIX:
            return quantized_shared_prefix_attention(
                queries, storage.k_rows[layer], storage.v_rows[layer], step.tables, step.host_tables,
                step.context_lens, step.prefix_groups, scale=scale, bits=storage.bits,
                group_size=storage.group_size, block_size=storage.block_size)  # (B, n_q, 1, D)
        width = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
        valid = _valid_rows(step.lengths, width)  # (B, 1, 1, Lmax)
        if isinstance(mask, mx.array):
            valid = valid & mask if mask.dtype == mx.bool_ else mx.where(valid, mask, -mx.inf)
        return dense_attend(queries, keys, values, scale, valid, sinks, bits=storage.bits,
                            group_size=storage.group_size)  # (B, n_q, 1, D_v)


class KeptPagesAttention:
    """Full-attention pages of one group where some sequences run an overflow policy: each attends its kept pages
    (:attr:`~mlxkv.kv.paged.step_context.BatchStep.kept`), and h2o / offload add the attention mass to them."""

    path = DecodePath.KEPT_PAGES

    def __init__(self, step: BatchStep):
        self.step = step
        self.storage = step.storage

    def attend(self, view: Any, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
               sinks: mx.array | None) -> mx.array:
        """One ``paged_attention`` over the kept pages' tables, its mass added to the ranking policies' pages (the
        model's own tensors, masked to each sequence's kept rows, when it transformed them)."""
        step, caches = self.step, view.caches
        lengths = step.kept_lens
        ranked = [b for b, c in enumerate(caches) if c.overflow is not None and c.overflow.needs_mass]
        for b in ranked:  # offload: each offloaded page's estimated share of this attention (page_offload.py)
            host = caches[b].overflow.host
            if host is not None and len(host):
                host.estimate(caches[b].layer, queries[b:b + 1], keys[b:b + 1, :, :lengths[b]], scale, None, sinks)
        kp, vp = self.storage.pages(caches[0].layer)
        if (view.fetched.handed_back(keys, values) and mask is None and kp.shape == vp.shape
                and queries.shape[-1] == kp.shape[-1]):
            out = paged_attention(queries, kp, vp, step.kept_tables, mx.array(lengths, dtype=mx.int32),
                                  scale=scale, sinks=sinks, max_context_len=max(lengths), with_mass=bool(ranked),
                                  host_checked=True)  # (B, n_q, 1, D)
            if not ranked:
                return out
            out, mass = out  # mass (B, n_kv, P): each sequence's, by position over its kept pages
            for b in ranked:
                caches[b].overflow.add_mass(mass[b, :, :lengths[b]], step.kept[b][0])
            return out
        for b in ranked:  # the model's own tensors: a second score pass over each sequence's rows
            n = lengths[b]
            caches[b].overflow.add_mass(decode_mass(queries[b:b + 1], keys[b:b + 1, :, :n], scale, None, sinks),
                                        step.kept[b][0])  # (n_kv, n) -> its kept pages
        return dense_attend(queries, keys, values, scale, _valid_rows(lengths, keys.shape[2]), sinks)


def per_sequence(view: Any, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any,
                 sinks: mx.array | None) -> mx.array:
    """Each sequence's own cache attending its slice of the model's tensors (a model that transformed the fetched
    rows, or masks its own scores). ``queries (B, n_q, 1, D)`` -> ``(B, n_q, 1, D_v)``."""
    outs = []
    for b, n in enumerate(view.step.lengths):
        k, v = keys[b:b + 1, :, :n], values[b:b + 1, :, :n]  # the model's own tensors, sequence b's rows
        m = mask if mask is None or isinstance(mask, str) else mask[b:b + 1] if mask.shape[0] > 1 else mask
        m = m[..., :n] if isinstance(m, mx.array) else m
        outs.append(view.caches[b].attend(queries[b:b + 1], k, v, scale=scale, mask=m, sinks=sinks))
    return mx.concatenate(outs, axis=0)  # (B, n_q, 1, D_v)


def backend_for(step: BatchStep, kept: bool) -> PagesAttention | QuantizedPagesAttention | KeptPagesAttention:
    """The backend of ``step``'s storage kind (``kept``: the layer's sequences run an overflow policy), its path
    chosen now."""
    if kept:
        return KeptPagesAttention(step)
    return QuantizedPagesAttention(step) if step.storage.quantized else PagesAttention(step)
