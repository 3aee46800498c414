"""Attention of one paged sequence's layer (prefill chunks and unbatched decode): one backend per storage kind.

:class:`~mlxkv.kv.paged.layer_cache.PagedLayerCache` only writes and fetches; its ``attend`` hands the call to the
sequence's backend (:func:`attention_for` its storage), with what the cache knows of the call: whether the model
handed back the rows it fetched (:class:`~mlxkv.kv.layouts.fetched_rows.FetchedRows`) and whether those were a
zero-copy view of consecutive pages. Whether the kernel would be the pure-MLX reference (the CPU) is read once per
step (:attr:`~mlxkv.kv.paged.step_context.SequenceStep.on_views`); the rest is the call's own shape.

Full-precision pages (:class:`PageAttention`): a single-token decode step handed its own rows goes through
``paged_attention`` over the page arrays (so a gather is never computed), except where the kernel would be the
reference, which could only copy the rows first: there rows lying in one run (a view) or a few runs of
consecutive pages are attended run by run in place (``runs_attention``), for a decode step and for a causal
prefill chunk (a prompt's suffix after a prefix-cache hit lies in its own new pages, apart from the shared ones);
a prefill chunk over a view gets dense SDPA on the view. (On the CPU ``runs_attention`` of a decode step beats
MLX's SDPA on the same view: 4 heads over 4K rows ~0.6 vs ~1.2 ms per layer, 14 query / 2 kv heads ~1.3 vs ~3.3;
SDPA's fallback handles grouped queries poorly there.) Anything else — masks given as arrays, tensors the model
derived (MLA) — goes to dense SDPA on the given tensors. Under an overflow policy the kept pages are attended
(:meth:`PageAttention.attend_kept`).

Quantized pages (:class:`QuantizedPageAttention`): :func:`mlxkv.kv.layouts.dense_attention.quantized_attend` on
mlx-lm's ``(packed, scales, biases)`` tuples (``mx.quantized_matmul``), for every step, mask and layout — except
a decode step where the kernel may run (Metal), which goes through ``quantized_paged_attention`` on the planes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.kernels import paged_attention, quantized_paged_attention, reference_on_views
from mlxkv.kernels.page_views_ref import runs_attention
from mlxkv.kv.layouts.dense_attention import attend as dense_attend
from mlxkv.kv.overflow.mass import decode_mass

#: A decode step or causal prefill chunk on the reference path whose visible rows lie in at most this many runs
#: of consecutive pages attends to each run in place (:func:`mlxkv.kernels.page_views_ref.runs_attention`)
#: instead of gathering.
MAX_VIEW_RUNS = 4


def on_views(cache: Any) -> bool:
    """Whether the kernel would be the pure-MLX reference this step (read once per step, for every layer)."""
    step = cache.seq.step
    if step.on_views is None:
        step.on_views = reference_on_views()
    return step.on_views


def kernel_mask_ok(cache: Any, mask: Any, keys: mx.array) -> bool:
    """Whether the kernel's own visibility rule covers ``mask`` for a decode query: no mask, or (chunked layers)
    llama4's boolean chunk mask over exactly the returned rows — for one query at the newest position every
    returned row (current chunk, up to the query) is visible, which is the kernel's rule."""
    if mask is None:
        return True
    return (cache.chunk_size is not None and isinstance(mask, mx.array) and mask.dtype == mx.bool_
            and mask.shape[-1] == keys.shape[2] and mask.shape[-2] == 1)


class PageAttention:
    """Full-precision pages."""

    def attend(self, cache: Any, own: bool, view: bool, queries: mx.array, keys: Any, values: Any, scale: float,
               mask: Any, sinks: mx.array | None) -> mx.array:
        """``cache``'s attention (``own``: handed its fetched rows; ``view``: those were a view of the pages)."""
        ov = cache.overflow
        if ov is not None and (ov.needs_mass or ov.dropped):
            return self.attend_kept(cache, ov, own, view, queries, keys, values, scale, mask, sinks)
        return self.attend_pages(cache, own, view, queries, keys, values, scale, mask, sinks)

    def attend_pages(self, cache: Any, own: bool, view: bool, queries: mx.array, keys: Any, values: Any,
                     scale: float, mask: Any, sinks: mx.array | None) -> mx.array:
        """Attention over every page of the sequence."""
        storage = cache.seq.storage
        views = own and on_views(cache)
        decode = queries.shape[2] == 1
        k_rows, v_rows = storage.k_rows[cache.layer], storage.v_rows[cache.layer]
        # Every returned row visible to the query (decode), or causally to the chunk's queries (prefill).
        causal = kernel_mask_ok(cache, mask, keys) if decode else isinstance(mask, str) and mask == "causal"
        if (views and (decode or not view) and sinks is None and causal
                and k_rows.shape == v_rows.shape and queries.shape[-1] == k_rows.shape[-1]):
            runs = cache.seq.step.row_runs(cache.group, cache.offset - keys.shape[2], cache.offset, MAX_VIEW_RUNS)
            if runs is not None:  # a few runs of consecutive pages (a view: one): attend to each in place
                return runs_attention(queries, k_rows, v_rows, runs, scale=scale)  # (1, n_q, L, D)
        if views and view:  # a prefill chunk, or a decode step with sinks or a mask
            return dense_attend(queries, keys, values, scale, mask, sinks)  # zero-copy view of consecutive pages
        if (own and decode and kernel_mask_ok(cache, mask, keys) and queries.shape[0] == 1
                and k_rows.shape == v_rows.shape and queries.shape[-1] == k_rows.shape[-1]):
            return paged_attention(
                queries, *storage.pages(cache.layer), *cache.seq.step.decode_tables(cache.group, cache.offset),
                scale=scale, window=cache.window, chunk_size=cache.chunk_size, sinks=sinks,
                max_context_len=cache.offset, host_checked=True,
            )  # (1, n_q, 1, D)
        return dense_attend(queries, keys, values, scale, mask, sinks)

    def attend_kept(self, cache: Any, ov: Any, own: bool, view: bool, queries: mx.array, keys: Any, values: Any,
                    scale: float, mask: Any, sinks: mx.array | None) -> mx.array:
        """Attention under an overflow policy. Before any page was dropped the plain path runs (a budget above
        the context changes nothing); then the kept rows are attended: in place run by run on the reference
        path, through the kernel over the kept pages' table where it may run (h2o: with the mass it returns),
        else dense SDPA. h2o and offload add each kept page's attention mass, from the kernel or from
        ``decode_mass`` (a second score pass over the rows handed in); offload also estimates each offloaded page's
        share of this attention from its key proxy (:meth:`~mlxkv.kv.paged.page_offload.PageHostStore.estimate`)."""
        storage = cache.seq.storage
        bs = storage.block_size
        kept = cache._kept(cache.offset)
        if ov.host is not None and len(ov.host):
            ov.host.estimate(cache.layer, queries, keys, scale, mask, sinks)  # restored after the step, if picked
        entries = kept[0] if kept is not None else list(range(-(-cache.offset // bs)))
        k_rows, v_rows = storage.k_rows[cache.layer], storage.v_rows[cache.layer]
        same = k_rows.shape == v_rows.shape and queries.shape[-1] == k_rows.shape[-1]
        if kept is not None and own and queries.shape[2] == 1 and mask is None and not on_views(cache) and same:
            n = ov.kept_tokens(cache.offset)
            out = paged_attention(queries, *storage.pages(cache.layer), mx.array(kept[1], dtype=mx.int32)[None],
                                  mx.array([n], dtype=mx.int32), scale=scale, sinks=sinks, max_context_len=n,
                                  with_mass=ov.needs_mass, host_checked=True)  # (1, n_q, 1, D), kept pages only
            if not ov.needs_mass:
                return out
            out, mass = out  # mass (1, n_kv, P) over the kept pages' positions
            ov.add_mass(mass[0, :, :n], entries)
            return out
        if ov.needs_mass:
            ov.add_mass(decode_mass(queries, keys, scale, mask, sinks), entries)  # (n_kv, K) rows -> pages
        if kept is None:
            return self.attend_pages(cache, own, view, queries, keys, values, scale, mask, sinks)  # the plain path
        n = ov.kept_tokens(cache.offset)
        causal = mask is None if queries.shape[2] == 1 else isinstance(mask, str) and mask == "causal"
        if own and on_views(cache) and same and causal and sinks is None and len(kept[2]) <= MAX_VIEW_RUNS:
            runs, left = [], n  # the kept pages' rows in place, run by run
            for block, pages in kept[2]:
                rows = min(pages * bs, left)
                runs.append((block * bs, rows))
                left -= rows
            return runs_attention(queries, k_rows, v_rows, runs, scale=scale)  # (1, n_q, L, D)
        return dense_attend(queries, keys, values, scale, mask, sinks)


class QuantizedPageAttention:
    """Quantized pages (``--kv-bits``)."""

    def attend(self, cache: Any, own: bool, view: bool, queries: mx.array, keys: Any, values: Any, scale: float,
               mask: Any, sinks: mx.array | None) -> mx.array:
        """The quantized kernel where it may run (Metal), else ``mx.quantized_matmul``, any mask."""
        storage = cache.seq.storage
        if (own and queries.shape[2] == 1 and queries.shape[0] == 1 and kernel_mask_ok(cache, mask, keys[0])
                and not on_views(cache) and keys[0].shape == values[0].shape
                and queries.shape[-1] * storage.bits == keys[0].shape[-1] * 32):
            return quantized_paged_attention(
                queries, *storage.planes(cache.layer), *cache.seq.step.decode_tables(cache.group, cache.offset),
                bits=storage.bits, group_size=storage.group_size, scale=scale, window=cache.window,
                chunk_size=cache.chunk_size, sinks=sinks, max_context_len=cache.offset, host_checked=True,
            )  # (1, n_q, 1, D)
        return dense_attend(queries, keys, values, scale, mask, sinks, bits=storage.bits,
                            group_size=storage.group_size)


PAGES = PageAttention()
QUANTIZED_PAGES = QuantizedPageAttention()


def attention_for(storage: Any) -> PageAttention | QuantizedPageAttention:
    """The attention backend of ``storage``'s kind (one object per kind, shared by every sequence)."""
    return QUANTIZED_PAGES if storage.quantized else PAGES
