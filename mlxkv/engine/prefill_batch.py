"""Batched prefill: the prompt chunks of B sequences, of different lengths, in one forward.

Requests admitted together (concurrent clients of a server) each prefill a short suffix after a prefix-cache hit.
One forward per request pays the model's fixed per-operation cost B times (on MLX's CPU backend ~6 ms for a
4-layer model and a 10-token chunk, before any attention); here the projections, norms and MLPs run once over a
``(B, Lmax)`` batch right-padded with each row's last token, each layer through a batched prefill view
(:mod:`mlxkv.kv.batching.prefill_views`: each sequence writes only its real rows and attends over its own cache).
Only full-attention KV layers qualify; anything else raises ``BatchUnsupported`` before any cache is written, and
the scheduler prefills the sequences one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.kv import cache_arrays, check_attended, make_prefill_views


def prefill_inputs(chunks: Sequence[Sequence[int]]) -> mx.array:
    """The chunks as one ``(B, Lmax)`` uint32 batch, each row right-padded with its own last token."""
    width = max(len(c) for c in chunks)
    return mx.array([list(c) + [c[-1]] * (width - len(c)) for c in chunks], dtype=mx.uint32)  # (B, Lmax)


def last_rows(logits: mx.array, lengths: Sequence[int]) -> mx.array:
    """Each row's logits at its last real position: ``(B, Lmax, vocab)`` -> ``(B, vocab)``."""
    rows = mx.arange(len(lengths))
    return logits[rows, mx.array(lengths, dtype=mx.int32) - 1]  # (B, vocab)


def forward_together(model: Any, seq_caches: Sequence[Sequence[Any]], rows: Sequence[Sequence[int]]) -> mx.array:
    """Row ``rows[b]`` into sequence b's caches, all in one forward; every position's logits ``(B, Lmax, vocab)``
    (lazy; row b's first ``len(rows[b])`` are real).

    Raises:
        BatchUnsupported: the layers cannot be batched (raised before any cache is written).
    """
    return forward_inputs(model, seq_caches, prefill_inputs(rows), [len(r) for r in rows])


def forward_inputs(model: Any, seq_caches: Sequence[Sequence[Any]], inputs: mx.array,
                   lengths: Sequence[int]) -> mx.array:
    """:func:`forward_together` of rows given as one right-padded ``(B, Lmax)`` batch (row b's first ``lengths[b]``
    are real; its tokens may be lazy, e.g. a decode step's in-flight token); every position's logits
    ``(B, Lmax, vocab)`` (lazy).

    Raises:
        BatchUnsupported: the layers cannot be batched (raised before any cache is written).
    """
    views = make_prefill_views(seq_caches, lengths)
    logits = model(inputs, cache=views)  # (B, Lmax, vocab)
    check_attended(views)
    return logits


def prefill_together(model: Any, seq_caches: Sequence[Sequence[Any]], chunks: Sequence[Sequence[int]]) -> mx.array:
    """Prefill chunk ``chunks[b]`` into sequence b's caches ``seq_caches[b]``, all in one forward.

    Returns:
        The logits at each chunk's last token, ``(B, vocab)``, evaluated together with the caches.

    Raises:
        BatchUnsupported: the layers cannot be batched (some caches may have been written: trim them back before
            running the chunks one by one).
    """
    lengths = [len(c) for c in chunks]
    views = make_prefill_views(seq_caches, lengths)
    logits = model(prefill_inputs(chunks), cache=views)  # (B, Lmax, vocab)
    check_attended(views)
    last = last_rows(logits, lengths)  # (B, vocab)
    mx.eval([a for caches in seq_caches for a in cache_arrays(caches)], last)
    return last
