"""Images inside a prompt, as the engine sees them: token spans with a cache key and their embeddings on demand.

Pure Python and MLX (no mlx-vlm): the engine imports this whether or not the ``vision`` extra is installed.

An image occupies ``[start, end)`` of the prompt with its placeholder token ids, so block hashes line up with the
tokens; its ``key`` enters the extra keys of every block overlapping the span (:class:`mlxkv.kv.blocks.hashing.
HashContext` spans), and through the chained hash every block after it: the same image at the same place hits,
another image (or another UUID) never does. ``features()`` gives the rows that replace the placeholders' embeddings;
it is called on the engine thread only when a prefill chunk overlaps the span, so a prefix hit covering the image
never runs the vision tower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True, slots=True, eq=False)
class ImageSpan:
    """One image in a prompt.

    Attributes:
        start, end: the placeholder tokens' positions ``[start, end)``.
        key: the block-hash key: ``sha256(pixels)`` hex, or ``sha256(uuid || pixels)`` hex when the client named it.
        label: what KV events show for it: the client's UUID, else the content hash.
        features: ``() -> (end - start, hidden)`` rows, already scaled as the language model's input embeddings
            expect (engine thread; the encoder caches them per content hash).
        grid: the image's tokens as a ``(t, h, w)`` grid, ``t * h * w == end - start``, for a language model with
            3-D positions (M-RoPE, :mod:`mlxkv.vision.mrope`); None for plain 1-D positions.
    """

    start: int
    end: int
    key: str
    label: str
    features: Callable[[], mx.array]
    grid: tuple[int, int, int] | None = None

    @property
    def hash_key(self) -> tuple:
        """The span's entry in a block's extra keys (the label rides along for KV events)."""
        return ("image", self.key, self.label)


def hash_spans(media: Sequence[ImageSpan]) -> tuple[tuple[int, int, tuple], ...]:
    """``(start, end, key)`` spans for :class:`~mlxkv.kv.blocks.cache_request.CacheRequest`."""
    return tuple((m.start, m.end, m.hash_key) for m in media)


def image_tokens_before(media: Sequence[ImageSpan], position: int) -> int:
    """How many image placeholder tokens lie before ``position``."""
    return sum(max(0, min(m.end, position) - m.start) for m in media)


def overlapping(media: Sequence[ImageSpan], start: int, end: int) -> list[ImageSpan]:
    """The images with a token in ``[start, end)``."""
    return [m for m in media if m.start < end and m.end > start]


def chunk_embeddings(model: Any, tokens: mx.array, start: int, media: Sequence[ImageSpan]) -> mx.array | None:
    """The input embeddings of prompt tokens ``tokens`` ``(L,)`` at positions ``[start, start + L)``: the model's
    token embeddings with each image placeholder's row replaced by its image's features; ``None`` when no image
    overlaps the chunk (the model embeds the tokens itself)."""
    end = start + tokens.shape[0]
    images = overlapping(media, start, end)
    if not images:
        return None
    rows = embed_tokens(model)(tokens)  # (L, hidden)
    for image in images:
        lo, hi = max(image.start, start), min(image.end, end)
        feats = image.features()[lo - image.start : hi - image.start].astype(rows.dtype)  # (hi - lo, hidden)
        rows = mx.concatenate([rows[: lo - start], feats, rows[hi - start :]], axis=0)
    return rows[None]  # (1, L, hidden)


def embed_tokens(model: Any) -> Any:
    """The token embedding layer of an mlx-lm model (the language model of a VLM checkpoint)."""
    inner = getattr(model, "language_model", model)
    inner = getattr(inner, "model", inner)
    return inner.embed_tokens
