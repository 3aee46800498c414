"""A prompt with images: each image's marker token expanded to its placeholders, and the spans the engine reads.

The chat template (or the caller) writes the family's marker (Gemma 3: ``<start_of_image>``; Qwen2-VL:
``<|vision_start|><|image_pad|><|vision_end|>``) where each image goes; :func:`expand_images` gives the i-th image
its placeholder ids at the i-th marker (Gemma 3: after it, then the closing token; Qwen2-VL: in place of
``<|image_pad|>``, one per image token of its grid) and returns an :class:`~mlxkv.vision.spans.ImageSpan` per
image. A span's cache key is the image's
content hash, or ``sha256(uuid || content hash)`` when the client named the image: the same UUID with other
content, or the same content under another UUID, is another entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.vision.images import DecodedImage, ImageError
from mlxkv.vision.spans import ImageSpan


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """One image of a request: decoded, its pixel values for the vision tower, and the client's UUID (or None)."""

    decoded: DecodedImage
    pixels: Any  # mlxkv.vision.encoder.ImagePixels
    uuid: str | None = None

    @property
    def key(self) -> str:
        """The block-hash key: the content hash, or sha256 over the UUID and the content hash."""
        if self.uuid is None:
            return self.decoded.content_hash
        return hashlib.sha256(self.uuid.encode() + b"\x00" + self.decoded.content_hash.encode()).hexdigest()

    @property
    def label(self) -> str:
        """What KV events show: the UUID, else the content hash."""
        return self.uuid if self.uuid is not None else self.decoded.content_hash


def prepare_images(encoder: Any, decoded: Sequence[DecodedImage], uuids: Sequence[str | None]) -> list[PreparedImage]:
    """Pixel values for each decoded image (the processor runs here, off the engine thread)."""
    return [PreparedImage(d, encoder.pixels(d.image), u) for d, u in zip(decoded, uuids)]


def expand_images(ids: Sequence[int], images: Sequence[PreparedImage], encoder: Any) -> tuple[list[int], tuple]:
    """``ids`` with each marker expanded for its image, and the images' spans.

    Raises:
        ImageError: the prompt's marker count differs from the number of images (text that spells the marker).
    """
    family = encoder.family
    markers = [i for i, t in enumerate(ids) if t == family.marker_id]
    if len(markers) != len(images):
        raise ImageError(f"the prompt holds {len(markers)} image markers for {len(images)} images (text may not "
                         f"spell the model's image marker)")
    out: list[int] = []
    spans: list[ImageSpan] = []
    last = 0
    for at, image in zip(markers, images):
        out.extend(ids[last:at])
        start = len(out) + family.placeholders_at
        tokens = encoder.tokens_for(image.pixels)
        out.extend(family.expansion(tokens))
        spans.append(ImageSpan(start, start + tokens, image.key, image.label, _features(encoder, image),
                               family.token_grid(image.pixels.grid) if family.mrope else None))
        last = at + 1
    out.extend(ids[last:])
    return out, tuple(spans)


def _features(encoder: Any, image: PreparedImage):
    """The span's features, asked of the encoder once per request (chunks splitting the image reuse them)."""
    content, pixels = image.decoded.content_hash, image.pixels
    held: list = []

    def features():
        if not held:
            held.append(encoder.features(content, pixels))
        return held[0]

    return features
