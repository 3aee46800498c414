"""LatentPagedCache: one absorbed-MLA layer of one sequence, its latents and rope keys in pages of the block pool.

Absorbed MLA (``MLXKV_MLA_ABSORBED=1``, :mod:`mlxkv.mla`) caches per token the normalised KV latent
(``kv_lora_rank`` values) and the rotated rope key (``qk_rope_head_dim`` values), shared by every head. In the
paged pool they take the place of a layer's K and V pages, as one "head" each: the latent in the K pages
``(1, num_blocks, block_size, kv_lora_rank)``, the rope key in the V pages ``(1, num_blocks, block_size, rope_dim)``
(:class:`~mlxkv.kv.paged.page_arrays.PagedStorage` allocates each from its first write, so widths may differ).
Everything that works on block ids works unchanged: block tables, prefix caching by the chained block hashes,
fork (shared blocks, copy-on-write tail), preemption and resume, the secondary tier (it stores the page rows of
every layer, whatever their width), and ``--kv-cache-budget`` (a block's bytes are probed from a latent cache).

Attention never reads K/V: :class:`~mlxkv.mla.MLAAttention` hands the absorbed queries to
:meth:`LatentPagedCache.latent_attend` (one sequence: prefill chunks and unbatched decode, over the rows
``update_and_fetch`` returned — a zero-copy view when the pages are consecutive) or to the batched decode view's
(:class:`~mlxkv.kv.batching.latent_views.LatentBatchView`, which batching picks for these layers), both through
:func:`~mlxkv.mla.latent.latent_attention`, the dense absorbed path's own core (split-KV included).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.kv.paged.layer_cache import PagedLayerCache
from mlxkv.mla.latent import latent_attention


class LatentPagedCache(PagedLayerCache):
    """Paged latent + rope-key cache of one absorbed-MLA layer (full attention: every row is returned).

    ``update_and_fetch(latent (1, 1, N, R), k_pe (1, 1, N, dr))`` writes the rows and returns all live rows
    ``(1, 1, offset, R)``, ``(1, 1, offset, dr)``, as :class:`~mlxkv.kv.layouts.latent_cache.LatentCache` does.
    """

    def update_and_fetch(self, latent: mx.array, k_pe: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new latent / rope-key rows at ``offset``; return every live row of both (lazy)."""
        assert latent.ndim == 4 and latent.shape[1] == 1, f"latent must be (1, 1, N, R), got {latent.shape}"
        assert k_pe.shape[:3] == latent.shape[:3], f"k_pe {k_pe.shape} does not match latent {latent.shape}"
        return super().update_and_fetch(latent, k_pe)

    def latent_attend(self, q_lat: mx.array, q_pe: mx.array, latent: mx.array, k_pe: mx.array, scale: float,
                      mask: Any = None, chunk: int | None = None) -> mx.array:
        """Absorbed attention of ``q_lat (1, H, L, R)`` / ``q_pe (1, H, L, dr)`` over ``latent`` / ``k_pe`` (the rows
        ``update_and_fetch`` returned); ``chunk``: split-KV chunk or None. Returns ``(1, H, L, R)``."""
        self.fetched.clear()  # drop this step's view of the pages: the next write then updates them in place
        return latent_attention(q_lat, q_pe, latent, k_pe, scale, mask, chunk)

    def attend(self, *args: Any, **kwargs: Any) -> mx.array:
        """Latent layers have no K/V to attend: their attention is :meth:`latent_attend`."""
        raise TypeError("a latent page cache is read by MLAAttention through latent_attend, not attend")

