"""Batch views: B sequences' own layer caches seen as one batched cache for one decode forward.

:mod:`~mlxkv.kv.batching.dense_views` wraps any mlx-lm-protocol cache (each sequence attends over its own
rows); :mod:`~mlxkv.kv.batching.paged_views` writes the B rows of a paged layer at once and hands its attention to the
group's backend (:mod:`~mlxkv.kv.batching.attention_backends`: one paged-attention call per layer over the B block
tables, or the in-place paths on the CPU); :mod:`~mlxkv.kv.batching.paged_batch` builds the step's metadata and
picks each paged layer's view. :func:`make_batch_views` picks between them.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlxkv.kv.batching.dense_views import (
    BatchUnsupported,
    check_attended,
    make_dense_batch_views,
)
from mlxkv.kv.batching.paged_batch import is_paged, make_paged_batch_views


def make_batch_views(seq_caches: Sequence[Sequence[Any]]) -> list:
    """Per-layer batch views over B sequences' caches (``seq_caches[b][layer]``): paged views when the
    sequences are paged, dense ones otherwise.

    Raises:
        BatchUnsupported: the sequences' layers cannot be batched (see the two view modules).
    """
    if is_paged(seq_caches):
        return make_paged_batch_views(seq_caches)
    return make_dense_batch_views(seq_caches)


__all__ = ["BatchUnsupported", "check_attended", "make_batch_views"]
