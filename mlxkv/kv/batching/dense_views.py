"""Batch views: B sequences' own layer caches seen as one batched cache for one decode forward.

A decode step feeds B sequences one token each, at different lengths. Instead of merging their caches into a
padded batch cache (and copying every K/V row each step), each layer gets a view that:

* reports ``offset`` as an ``mx.array`` of per-sequence offsets, shape (B,) (mlx-lm's RoPE takes per-batch
  offsets, as its ``BatchKVCache`` relies on);
* in ``update_and_fetch`` appends each sequence's new row into that sequence's own cache;
* in ``attend`` (reached through mlxkv's attention hook) runs each sequence's attention over its own K/V,
  through the wrapped cache's ``attend`` when it has one, else mlx-lm's ``scaled_dot_product_attention``.

Only mlx-lm's cache protocol is used on the wrapped caches, so any layout works, including sliding-window
caches (which return their window). Recurrent-state layers (``ArraysCache``-like: indexed state arrays) get
a view that stacks the states along the batch axis and splits them back.

Paged sequences get :mod:`mlxkv.kv.batching.paged_views` instead (:func:`mlxkv.kv.batching.make_batch_views`).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_map

from mlxkv.kv.layouts.fetched_rows import FetchedRows


class BatchUnsupported(RuntimeError):
    """The caches (or this step) cannot be run as one batched forward; decode the sequences one by one."""


class KVBatchView:
    """One attention layer of B sequences; created for a single decode forward, then dropped.

    Args:
        caches: the B sequences' caches of this layer (each speaks mlx-lm's KV cache protocol).
    """

    def __init__(self, caches: Sequence[Any]):
        self.caches = list(caches)
        self.offset = mx.array([c.offset for c in self.caches], dtype=mx.int32)  # (B,)
        self.attended = False  # set by attend: proves the attention hook routed this layer to us
        self._fetched: list | None = None  # per sequence: what its cache returned (set once the caches are written)
        self.fetched = FetchedRows()  # the padded (B, ...) pair handed back to the model
        self._lengths: list[int] = []  # keys each sequence's cache returned this step

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        """The decode mask: ``None`` when every sequence sees all of its fetched keys (the usual case).

        Raises:
            BatchUnsupported: a prefill-sized step, or sequences whose own masks differ (e.g. a window narrower
                than its rotating buffer on some sequences only); raised before any cache is written.
        """
        if N != 1:
            raise BatchUnsupported(f"batch views run decode steps of one token, got {N}")

        def ask(c: Any, arr: bool) -> Any:
            return c.make_mask(N, return_array=arr, window_size=window_size)

        masks = [ask(c, return_array) if hasattr(c, "make_mask") else None for c in self.caches]
        if all(m is None for m in masks):
            return None
        # Some sequences need an array (e.g. past their window): ask the others for theirs explicitly, so every
        # row's mask spans exactly the keys its cache will return.
        masks = [m if m is not None or not hasattr(c, "make_mask") else ask(c, True)
                 for m, c in zip(masks, self.caches)]
        if any(m is None or isinstance(m, str) for m in masks):
            raise BatchUnsupported("sequences need different kinds of decode masks")
        rows = [m.reshape(-1) for m in masks]  # B x (L_i,)
        width = max(r.shape[0] for r in rows)
        padded = [mx.pad(r, (0, width - r.shape[0]), constant_values=False) for r in rows]  # B x (Lmax,)
        return mx.stack(padded).reshape(len(rows), 1, 1, width)  # (B, 1, 1, Lmax)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append row b of ``keys``/``values`` (B, n_kv, 1, D) to sequence b's cache.

        Returns the fetched K/V right-padded to the longest sequence, (B, n_kv, Lmax, D) (pytrees for quantized
        caches). MLX evaluates lazily: when the model hands them straight to ``attend`` (the usual case) the
        padding is never computed.
        """
        fetched = []
        for b, cache in enumerate(self.caches):
            k, v = (tree_map(lambda x, b=b: x[b : b + 1], t) for t in (keys, values))  # (1, n_kv, 1, D)
            fetched.append(cache.update_and_fetch(k, v))  # (1, n_kv, L_b, D) each
        self._fetched = fetched
        self._lengths = [_length(k) for k, _ in fetched]
        width = max(self._lengths)
        stacked = []
        for part in (0, 1):
            per_seq = [tree_map(lambda x, n=width - n_b: _pad_rows(x, n), f[part])
                       for f, n_b in zip(fetched, self._lengths)]
            stacked.append(tree_map(lambda *xs: mx.concatenate(xs, axis=0), *per_seq))  # (B, n_kv, Lmax, D)
        return self.fetched.record(stacked[0], stacked[1])

    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Each sequence's attention over its own K/V; queries (B, n_q, 1, D) -> (B, n_q, 1, D_v)."""
        from mlx_lm.models.base import scaled_dot_product_attention

        assert self._fetched is not None, "attend before update_and_fetch"
        self.attended = True
        own = self.fetched.handed_back(keys, values)
        outs = []
        for b, cache in enumerate(self.caches):
            n = self._lengths[b]
            if own:
                k, v = self._fetched[b]
            else:  # the model transformed what we returned (e.g. latent attention): slice its rows
                k, v = (tree_map(lambda x, b=b, n=n: x[b : b + 1, ..., :n, :], t) for t in (keys, values))
            m = _row_mask(mask, b, n)
            q = queries[b : b + 1]  # (1, n_q, 1, D)
            if hasattr(cache, "attend"):
                outs.append(cache.attend(q, k, v, scale=scale, mask=m, sinks=sinks))
            else:
                outs.append(scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=m, sinks=sinks))
        return mx.concatenate(outs, axis=0)  # (B, n_q, 1, D_v)


def _pad_rows(x: mx.array, n: int) -> mx.array:
    """``x`` (..., L, D) with ``n`` zero rows appended along L."""
    return mx.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, n), (0, 0)]) if n else x


def _length(fetched_keys: Any) -> int:
    leaf = fetched_keys[0] if isinstance(fetched_keys, (tuple, list)) else fetched_keys
    return leaf.shape[-2]


def _row_mask(mask: Any, b: int, n: int) -> Any:
    """Sequence b's slice of a batch mask (None, "causal", or an array broadcastable to (B, h, 1, Lmax))."""
    if mask is None or isinstance(mask, str):
        return mask
    if mask.ndim == 4 and mask.shape[0] > 1:
        mask = mask[b : b + 1]
    return mask[..., :n]


class StateBatchView:
    """One recurrent-state layer (``ArraysCache``-like) of B sequences: states stacked along the batch axis.

    Reading ``view[i]`` stacks the sequences' state ``i`` (B, ...); writing ``view[i] = x`` splits x back into
    the sequences' caches. Sequences without state yet get zeros, as mlx-lm's batch merge does.
    """

    def __init__(self, caches: Sequence[Any]):
        self.caches = list(caches)
        self.lengths = None  # no right padding in decode: every row holds one real token
        self.left_padding = None

    def __getitem__(self, i: int) -> mx.array | None:
        states = [c[i] for c in self.caches]
        if all(s is None for s in states):
            return None
        like = next(s for s in states if s is not None)
        rows = [s if s is not None else mx.zeros((1, *like.shape[1:]), like.dtype) for s in states]
        return mx.concatenate(rows, axis=0)  # (B, ...)

    def __setitem__(self, i: int, value: mx.array) -> None:
        assert value.shape[0] == len(self.caches), f"state batch {value.shape[0]} != {len(self.caches)}"
        for b, cache in enumerate(self.caches):
            cache[i] = value[b : b + 1]

    def advance(self, n: int) -> None:
        for cache in self.caches:
            if hasattr(cache, "advance"):
                cache.advance(n)

    def make_mask(self, N: int, **_: Any) -> None:
        if N != 1:
            raise BatchUnsupported(f"batch views run decode steps of one token, got {N}")
        return None


def _is_state_cache(cache: Any) -> bool:
    return hasattr(cache, "__getitem__") and hasattr(cache, "__setitem__") and not hasattr(cache, "update_and_fetch")


def make_dense_batch_views(seq_caches: Sequence[Sequence[Any]]) -> list:
    """Per-layer batch views over B sequences' own (dense) caches (``seq_caches[b][layer]``).

    Raises:
        BatchUnsupported: a layer's cache is neither a KV cache nor an indexed state cache, or the sequences'
            layer kinds differ.
    """
    n_layers = {len(c) for c in seq_caches}
    if len(n_layers) != 1:
        raise BatchUnsupported("sequences have different numbers of layer caches")
    views = []
    for layer in zip(*seq_caches):
        kinds = {type(c) for c in layer}
        if len(kinds) != 1:
            raise BatchUnsupported(f"layer caches of different types: {sorted(k.__name__ for k in kinds)}")
        if all(hasattr(c, "update_and_fetch") for c in layer):
            views.append(KVBatchView(layer))
        elif all(_is_state_cache(c) for c in layer):
            views.append(StateBatchView(layer))
        else:
            raise BatchUnsupported(f"no batch view for {type(layer[0]).__name__}")
    return views


def check_attended(views: Sequence[Any]) -> None:
    """Assert every KV view that fetched was also attended (else the attention hook is not routing to us).

    Raises:
        BatchUnsupported: some layer's attention bypassed its view; the forward's output is not valid.
    """
    for i, view in enumerate(views):
        if isinstance(view, KVBatchView) and view._fetched is not None and not view.attended:
            raise BatchUnsupported(
                f"layer {i}: attention did not go through cache.attend (mlxkv's attention hook is not installed)"
            )
