"""3-D rotary positions (M-RoPE) for Qwen2-VL and Qwen2.5-VL, with mlxkv's caches.

Their language model rotates each query and key by three positions (temporal, height, width), one per section of
the head's frequencies. A text token has the same position on all three axes; an image's tokens sit on the image's
grid of ``(t, h, w)`` tokens, starting where the image's first token would be as text, so the image spans
``max(t, h, w)`` positions, not ``t * h * w``: every token after it is shifted back by the difference (the
"rope delta" of mlx-vlm's ``get_rope_index``). A sequence's positions are therefore a function of its prompt's image
spans alone (:func:`rope_positions`), which is what lets them survive everything mlxkv does to a sequence: a prefix
hit skips the prefill of an image's tokens (and its vision tower) yet the text after it gets the same positions; a
prefill chunk may start or end inside an image; preempted sequences resume and ``n`` forks decode from the same
spans; rows of one batched decode step each have their own shift.

:func:`install_mrope` fits this onto the mlx-lm model that runs the language model (mlx-lm runs it with 1-D
positions, exact for text only): each attention layer's RoPE is replaced by :class:`MultimodalRope`, and the model's
forward first computes every row's positions from its caches' offsets and the image spans bound to its sequence
(:meth:`MRopePositions.bind`, by the engine's runner around each step); a sequence bound to no spans (text only)
gets the plain positions ``offset + i``. The rotation itself is mlx-vlm's (``MRoPERotaryEmbedding``, the
"chunked" Qwen2-VL layout), so positions and angles are those of mlx-vlm's own model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def rope_positions(media: Sequence[Any], start: int, length: int) -> np.ndarray:
    """The 3-D positions ``(3, length)`` int32 of prompt positions ``[start, start + length)`` of a sequence whose
    images are ``media`` (:class:`~mlxkv.vision.spans.ImageSpan` with a ``grid``; positions past the prompt continue
    after its last image)."""
    index = np.arange(start, start + length, dtype=np.int64)
    out = np.broadcast_to(index, (3, length)).copy()
    shift = 0  # positions the images before the current one saved
    for span in sorted((m for m in media if m.grid is not None), key=lambda m: m.start):
        t, h, w = span.grid
        inside = (index >= span.start) & (index < span.end)
        out[:, index >= span.end] -= t * h * w - max(t, h, w)
        if inside.any():
            j = index[inside] - span.start  # token index within the image, row-major over (t, h, w)
            base = span.start - shift
            out[:, inside] = base + np.stack([j // (h * w), (j // w) % h, j % w])
        shift += t * h * w - max(t, h, w)
    return out.astype(np.int32)


def _row_caches(cache: Any) -> list:
    """The layer-0 cache of each row of a forward: a batch view's sequences, else the one sequence's cache."""
    first = cache[0]
    return list(first.caches) if hasattr(first, "caches") else [first]


class MRopePositions:
    """The image spans bound to each sequence, and the positions of the forward running now.

    Sequences are known by their first layer's cache (what the model's forward is given, alone or inside a batch
    view). Bindings last for the step that makes them (:meth:`bind`): nothing stale outlives a sequence.
    """

    def __init__(self) -> None:
        self._bound: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.current: mx.array | None = None  # (3, B, L) during a forward

    @contextmanager
    def bind(self, rows: Iterable[tuple[Any, Sequence[Any]]]) -> Iterator[None]:
        """Bind each ``(sequence caches, image spans)`` of ``rows`` for the duration of the block (spans without a
        grid, or none: plain positions)."""
        keys = []
        with self._lock:
            for caches, media in rows:
                if caches and any(m.grid is not None for m in media):
                    self._bound[id(caches[0])] = tuple(media)
                    keys.append(id(caches[0]))
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self._bound.pop(key, None)

    def of_forward(self, cache: Any, batch: int, length: int) -> mx.array:
        """The positions ``(3, batch, length)`` of a forward of ``length`` tokens per row over ``cache``."""
        if not cache:
            return mx.array(np.broadcast_to(np.arange(length, dtype=np.int32), (3, batch, length)))
        rows = _row_caches(cache)
        if len(rows) != batch:  # a shape the engine never makes: one offset for every row
            rows = rows[:1] * batch
        with self._lock:
            media = [self._bound.get(id(r), ()) for r in rows]
        return mx.array(np.stack([rope_positions(m, int(getattr(r, "offset", 0)), length)
                                  for r, m in zip(rows, media)], axis=1))


class MultimodalRope(nn.Module):
    """An attention layer's RoPE (called as mlx-lm's ``rope(x, offset=...)``) rotating by the 3-D positions of the
    forward running now (:attr:`MRopePositions.current`), with mlx-vlm's M-RoPE rotation."""

    def __init__(self, rotary: Any, positions: MRopePositions):
        super().__init__()
        self.rotary = rotary
        self.positions = positions

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        # x: (B, heads, L, head_dim)
        pos = self.positions.current
        if pos is None or pos.shape[1:] != (x.shape[0], x.shape[2]):
            base = mx.array(offset).reshape(-1, 1) if isinstance(offset, mx.array) else offset
            pos = mx.broadcast_to(mx.arange(x.shape[2])[None] + base, (3, x.shape[0], x.shape[2]))
        rotated, _ = self.rotary.apply_rotary(x, x, pos)  # the second output is never evaluated
        return rotated


def install_mrope(model: Any, config: dict) -> MRopePositions:
    """Give mlx-lm's Qwen2-VL language model (``model``, config.json ``config``) 3-D positions; returns the table the
    engine binds sequences' image spans in (``model.mrope_positions``). Installing twice keeps the first."""
    found = getattr(model, "mrope_positions", None)
    if found is not None:
        return found
    from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

    text = config.get("text_config") or config
    head_dim = int(text["hidden_size"]) // int(text["num_attention_heads"])
    positions = MRopePositions()
    for layer in model.layers:
        rotary = MRoPERotaryEmbedding(head_dim, max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
                                      base=float(text.get("rope_theta", 1000000.0)),
                                      rope_scaling=text.get("rope_scaling"), style="chunked")
        layer.self_attn.rope = MultimodalRope(rotary, positions)
    base = type(model)
    model.__class__ = type(f"MRope{base.__name__}", (base,), {"__call__": _forward_with_positions})
    object.__setattr__(model, "mrope_positions", positions)
    return positions


def _forward_with_positions(self: Any, inputs: mx.array, cache: Any = None, input_embeddings: Any = None, **kwargs):
    """The model's forward with each row's 3-D positions computed first (from its caches and bound spans)."""
    positions = self.mrope_positions
    batch, length = (input_embeddings.shape[:2] if input_embeddings is not None else inputs.shape[:2])
    positions.current = positions.of_forward(cache, batch, length)
    try:
        return super(type(self), self).__call__(inputs, cache=cache, input_embeddings=input_embeddings, **kwargs)
    finally:
        positions.current = None


def bound_rows(model: Any, rows: Iterable[tuple[Any, Sequence[Any]]]) -> AbstractContextManager:
    """:meth:`MRopePositions.bind` on ``model``'s table; a no-op context for a model without M-RoPE."""
    positions = getattr(model, "mrope_positions", None)
    return nullcontext() if positions is None else positions.bind(rows)
