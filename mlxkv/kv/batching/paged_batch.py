"""Which batch view each layer of B paged sequences gets: plain pages, latent pages, pages under an overflow
policy, or the dense view of a recurrent-state layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxkv.kv.batching.attention_backends import backend_for
from mlxkv.kv.batching.dense_views import (
    BatchUnsupported,
    StateBatchView,
    _is_state_cache,
)
from mlxkv.kv.batching.latent_views import LatentBatchView
from mlxkv.kv.batching.overflow_views import OverflowBatchView
from mlxkv.kv.batching.paged_views import PagedBatchView
from mlxkv.kv.paged.latent_pages import LatentPagedCache
from mlxkv.kv.paged.layer_cache import PagedLayerCache
from mlxkv.kv.paged.step_context import BatchStep


def is_paged(seq_caches: Sequence[Sequence[Any]]) -> bool:
    """Whether these sequences' caches are paged (then :func:`make_paged_batch_views` applies)."""
    return bool(seq_caches) and any(isinstance(c, PagedLayerCache) for c in seq_caches[0])


def make_paged_batch_views(seq_caches: Sequence[Sequence[Any]]) -> list:
    """Per-layer views over B paged sequences (``seq_caches[b][layer]``), built with the step's metadata: one
    :class:`~mlxkv.kv.paged.step_context.BatchStep` per manager group (block tables, slots, context lengths,
    prefix groups, kept pages: built and checked on the host here, before the forward) and one attention backend
    per group and storage kind, its path chosen now (:mod:`mlxkv.kv.batching.attention_backends`). Paged layers get
    :class:`PagedBatchView` (:class:`LatentBatchView` for latent pages, :class:`OverflowBatchView` under an overflow
    policy), recurrent-state layers the dense state view.

    Raises:
        BatchUnsupported: sequences with different layer structures, or from different pools.
        ValueError: a block table or context length that disagrees with the pool (nothing was written).
    """
    if len({len(c) for c in seq_caches}) != 1:
        raise BatchUnsupported("sequences have different numbers of layer caches")
    steps: dict[int, BatchStep] = {}
    backends: dict[tuple[int, bool], Any] = {}
    views = []
    for layer in zip(*seq_caches):
        if all(isinstance(c, PagedLayerCache) for c in layer):
            if len({id(c.seq.storage) for c in layer}) != 1:
                raise BatchUnsupported("paged sequences from different pools")
            g = layer[0].group
            if g not in steps:
                steps[g] = BatchStep(layer)
            if isinstance(layer[0], LatentPagedCache):  # latent attention is the one path
                views.append(LatentBatchView(layer, steps[g], None))
                continue
            kept = any(c.overflow is not None for c in layer)  # kept pages' tables, attention mass
            if (g, kept) not in backends:
                backends[g, kept] = backend_for(steps[g], kept)
            view = OverflowBatchView if kept else PagedBatchView
            views.append(view(layer, steps[g], backends[g, kept]))
        elif all(_is_state_cache(c) for c in layer):
            views.append(StateBatchView(layer))
        else:
            raise BatchUnsupported(f"no batch view for {sorted({type(c).__name__ for c in layer})}")
    return views
