"""Batched decode over latent pages: one absorbed-MLA layer of B paged sequences in one latent attention.

:class:`LatentBatchView` is :class:`~mlxkv.kv.batching.paged_views.PagedBatchView` for
:class:`~mlxkv.kv.paged.latent_pages.LatentPagedCache` layers: ``update_and_fetch`` writes the B new latent and
rope-key rows with one write into their slots and returns each sequence's rows right-padded, ``(B, 1, Lmax, R)`` and
``(B, 1, Lmax, dr)`` (one gather of the pages for all B). ``latent_attend`` then runs
:func:`~mlxkv.mla.latent.latent_attention` once over the batch with a per-row length mask: a padded row's score
is the float32 floor, so its softmax weight is exactly 0 (a fully padded split-KV chunk gets LSE weight 0) and
each row's output is that sequence's own absorbed attention.

The view only speaks latent attention, so it asks :class:`~mlxkv.mla.MLAAttention` for the absorbed path
(``absorbed_only``) whatever the cost model would pick for a step of tiny contexts.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.kv.batching.paged_views import PagedBatchView
from mlxkv.mla.latent import latent_attention


class LatentBatchView(PagedBatchView):
    """One latent-page layer of B sequences for one decode forward (then dropped)."""

    #: MLAAttention takes the absorbed path for this cache (materialising would need K/V attention).
    absorbed_only = True

    def latent_attend(self, q_lat: mx.array, q_pe: mx.array, latent: mx.array, k_pe: mx.array, scale: float,
                      mask: Any = None, chunk: int | None = None) -> mx.array:
        """Absorbed decode attention of all B sequences: ``q_lat (B, H, 1, R)``, ``q_pe (B, H, 1, dr)`` over the
        padded rows ``update_and_fetch`` returned; ``mask`` is None or this view's own boolean length mask
        (:meth:`make_mask` with ``return_array``). Returns ``(B, H, 1, R)``."""
        assert self._fetched is not None, "latent_attend before update_and_fetch"
        assert mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_), \
            f"a latent batch view takes no mask or its own boolean length mask, got {mask!r}"
        self.attended = True
        width = latent.shape[2]
        lengths = mx.array(self._lengths, dtype=mx.int32)  # (B,)
        visible = (mx.arange(width)[None] < lengths[:, None]).reshape(len(self.caches), 1, 1, width)  # (B, 1, 1, Lmax)
        if mask is not None:
            visible = mx.logical_and(visible, mask)
        return latent_attention(q_lat, q_pe, latent, k_pe, scale, visible, chunk)  # (B, H, 1, R)

    def attend(self, *args: Any, **kwargs: Any) -> mx.array:
        """Latent layers have no K/V to attend: their attention is :meth:`latent_attend`."""
        raise TypeError("a latent batch view is read by MLAAttention through latent_attend, not attend")
