"""Batched prefill views: the prompt chunks of B sequences, of different lengths, in one forward.

Each layer gets a :class:`PrefillBatchView` that

* reports ``offset`` as the per-sequence offsets ``(B,)`` (RoPE places row ``b``'s token ``i`` at
  ``offset_b + i``);
* in ``update_and_fetch`` writes only each sequence's real rows (``lengths[b]`` of them) into its own cache;
* in ``attend`` runs each sequence's causal attention over its own cache (``cache.attend``: on paged storage the
  in-place page-run and view paths) and pads the outputs back to ``Lmax`` rows; absorbed MLA on latent pages
  comes to ``latent_attend`` instead, the same per sequence over its latent rows.

The padded rows' outputs are computed and dropped; nothing of them reaches a cache. Only full-attention KV
layers qualify (no window, chunk, recurrent state or quantized K/V: their masks or states would need more than
a causal rule per row); anything else raises :class:`BatchUnsupported` before any cache is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from mlxkv.kv.batching.dense_views import BatchUnsupported, KVBatchView, _pad_rows
from mlxkv.kv.layouts.standard import KVCache
from mlxkv.kv.paged.layer_cache import PagedLayerCache
from mlxkv.mla.latent import latent_attention


def _full_attention(cache: Any) -> bool:
    """A KV cache whose every row is visible to later positions, with dense K/V (exact types only)."""
    if isinstance(cache, PagedLayerCache):
        return cache.spec.is_full and not cache.seq.storage.quantized and not cache.seq.overflow
    return type(cache) in (KVCache, mlx_cache.KVCache)


class PrefillBatchView(KVBatchView):
    """One full-attention layer of B sequences for one batched prefill forward (then dropped).

    Args:
        caches: the B sequences' caches of this layer.
        lengths: real (unpadded) tokens of each sequence's chunk, each >= 1.

    Raises:
        BatchUnsupported: a cache is not a full-attention dense-K/V cache.
    """

    def __init__(self, caches: Sequence[Any], lengths: Sequence[int]):
        if len(caches) != len(lengths):
            raise ValueError(f"{len(caches)} caches but {len(lengths)} lengths")
        bad = [type(c).__name__ for c in caches if not _full_attention(c)]
        if bad:
            raise BatchUnsupported(f"batched prefill needs full-attention KV caches, got {bad[0]}")
        super().__init__(caches)
        self.lengths = list(lengths)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> None:
        """``None``: each sequence's causal mask is applied in :meth:`attend` (rows differ in length).

        Raises:
            BatchUnsupported: a windowed mask was asked for, or ``N`` is not the padded chunk length.
        """
        if window_size is not None:
            raise BatchUnsupported("batched prefill does not build windowed masks")
        if N != max(self.lengths):
            raise BatchUnsupported(f"batched prefill of {max(self.lengths)} padded rows got {N} queries")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write row b's first ``lengths[b]`` of ``keys``/``values`` ``(B, n_kv, Lmax, D)`` into cache b.

        Returns each cache's rows right-padded to the longest, ``(B, n_kv, Kmax, D)`` (lazy: when the model hands
        them straight to :meth:`attend`, the usual case, the padding is never computed).
        """
        if isinstance(keys, (tuple, list)):
            raise BatchUnsupported("batched prefill does not take quantized K/V")
        fetched = [cache.update_and_fetch(keys[b : b + 1, :, :n], values[b : b + 1, :, :n])  # (1, n_kv, K_b, D)
                   for b, (cache, n) in enumerate(zip(self.caches, self.lengths))]
        # Paged sequences share one page array per layer: read every one's rows from the array all the writes made
        # (views of the intermediate arrays would make each write copy the whole array instead of updating it).
        fetched = [cache.refetch() if hasattr(cache, "refetch") else f for cache, f in zip(self.caches, fetched)]
        self._fetched = fetched
        self._lengths = [k.shape[-2] for k, _ in fetched]
        width = max(self._lengths)
        return self.fetched.record(*(
            mx.concatenate([_pad_rows(f[part], width - n) for f, n in zip(fetched, self._lengths)], axis=0)
            for part in (0, 1)))  # (B, n_kv, Kmax, D) each

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Each sequence's causal attention over its own rows; queries ``(B, n_q, Lmax, D)`` -> ``(B, n_q, Lmax,
        D_v)`` (padded query rows get zeros). ``mask`` (what :meth:`make_mask` returned) is not used."""
        from mlx_lm.models.base import scaled_dot_product_attention

        assert self._fetched is not None, "attend before update_and_fetch"
        self.attended = True
        own = self.fetched.handed_back(keys, values)
        width = queries.shape[2]
        outs = []
        for b, (cache, n) in enumerate(zip(self.caches, self.lengths)):
            if own:
                k, v = self._fetched[b]
            else:  # the model transformed what we returned: slice its rows
                k, v = (x[b : b + 1, ..., : self._lengths[b], :] for x in (keys, values))
            q = queries[b : b + 1, :, :n]  # (1, n_q, n, D)
            row_mask = "causal" if n > 1 else None  # the chunk's rows are the last n of the cache's rows
            if hasattr(cache, "attend"):
                out = cache.attend(q, k, v, scale=scale, mask=row_mask, sinks=sinks)
            else:
                out = scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=row_mask, sinks=sinks)
            outs.append(_pad_rows(out, width - n))  # (1, n_q, Lmax, D_v)
        return mx.concatenate(outs, axis=0)  # (B, n_q, Lmax, D_v)


    #: absorbed MLA (:class:`~mlxkv.mla.MLAAttention`) takes its latent path here: the materialised one would
    #: attend the padded K/V without each row's causal mask.
    absorbed_only = True

    def latent_attend(self, q_lat: mx.array, q_pe: mx.array, latent: mx.array, k_pe: mx.array, scale: float,
                      mask: Any = None, chunk: int | None = None) -> mx.array:
        """Absorbed MLA: each sequence's causal latent attention over its own latent / rope-key rows; ``q_lat``
        ``(B, H, Lmax, R)`` -> ``(B, H, Lmax, R)`` (padded query rows get zeros). ``mask`` is not used (see
        :meth:`attend`); ``chunk``: split-KV chunk or None."""
        assert self._fetched is not None, "latent_attend before update_and_fetch"
        self.attended = True
        own = self.fetched.handed_back(latent, k_pe)
        width = q_lat.shape[2]
        outs = []
        for b, n in enumerate(self.lengths):
            if own:
                lat, pe = self._fetched[b]  # (1, 1, K_b, R), (1, 1, K_b, dr)
            else:
                lat, pe = (x[b : b + 1, ..., : self._lengths[b], :] for x in (latent, k_pe))
            out = latent_attention(q_lat[b : b + 1, :, :n], q_pe[b : b + 1, :, :n], lat, pe, scale,
                                   "causal" if n > 1 else None, chunk)  # (1, H, n, R)
            outs.append(_pad_rows(out, width - n))  # (1, H, Lmax, R)
        return mx.concatenate(outs, axis=0)  # (B, H, Lmax, R)


def make_prefill_views(seq_caches: Sequence[Sequence[Any]], lengths: Sequence[int]) -> list[PrefillBatchView]:
    """Per-layer :class:`PrefillBatchView` over B sequences' caches (``seq_caches[b][layer]``), chunk lengths
    ``lengths``.

    Raises:
        BatchUnsupported: some layer is not a full-attention KV cache, or the sequences' layer counts differ.
    """
    if len({len(c) for c in seq_caches}) != 1:
        raise BatchUnsupported("sequences have different numbers of layer caches")
    return [PrefillBatchView(layer, lengths) for layer in zip(*seq_caches)]


def cache_arrays(caches: Sequence[Any]) -> list[mx.array]:
    """The arrays holding the layer caches' state, to evaluate after a prefill chunk."""
    out = []
    for c in caches:
        tree = c.arrays() if hasattr(c, "arrays") else c.state
        out.extend(x for _, x in tree_flatten(tree) if isinstance(x, mx.array))
    return out
