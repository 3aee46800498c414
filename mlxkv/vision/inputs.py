"""Images for one model, from whichever door: OpenAI ``image_url`` parts, Anthropic ``image`` blocks, files.

:class:`VisionInputs` is made once per served model (:meth:`VisionInputs.for_model`). ``take_*`` pull a request's
images out of its messages, leaving the family's marker text where each was (the chat template renders it like any
text); :meth:`VisionInputs.expand` turns the tokenized prompt and those images into the prompt with placeholders and
the engine's :class:`~mlxkv.vision.spans.ImageSpan` list. A text-only model, or a VLM without mlx-vlm installed,
refuses an image with one clear line and leaves text requests exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mlxkv.vision.images import (DecodedImage, ImageError, ImageLimits, check_count, check_uuids, decode_base64,
                                 decode_image, read_image_url)
from mlxkv.vision.support import TEXT_ONLY, VISION_EXTRA, VisionUnavailable, family_of, mlx_vlm_available


@dataclass(slots=True)
class RequestImages:
    """A request's images in prompt order and their UUIDs (``None``: keyed by content)."""

    decoded: list[DecodedImage] = field(default_factory=list)
    uuids: tuple[str | None, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.decoded)


class VisionInputs:
    """Image handling for one model: ``encoder`` is None when the model takes no images (``problem`` says why).

    Args:
        encoder: the model's :class:`~mlxkv.vision.encoder.ImageEncoder`, or None.
        problem: why images are refused (text-only model, mlx-vlm missing), when ``encoder`` is None.
        limits: bytes, pixels and count per request; folders ``file://`` URLs may read.
        marker: the text an image becomes in a message (the family's image marker token).
    """

    def __init__(self, encoder: Any = None, problem: str = TEXT_ONLY,
                 limits: ImageLimits = ImageLimits(), marker: str = ""):
        self.encoder = encoder
        self.problem = problem
        self.limits = limits
        self.marker = marker

    @classmethod
    def for_model(cls, path: Path, config: dict, tokenizer: Any, limits: ImageLimits = ImageLimits(),
                  cache_bytes: int | None = None, model: Any = None) -> "VisionInputs":
        """Image support for the model in ``path`` (config.json ``config``): loads its vision tower when it is a
        supported VLM and mlx-vlm is installed, else records why images are refused. ``model``: the loaded
        language model, given 3-D positions when the family has them (Qwen2-VL; required for it)."""
        try:
            family = family_of(config)
        except VisionUnavailable as exc:
            return cls(None, str(exc), limits)
        if not mlx_vlm_available():
            return cls(None, f"this model ({family.name}) reads images with mlx-vlm, which is not installed: "
                             f"{VISION_EXTRA}", limits)
        from mlxkv.vision.encoder import DEFAULT_FEATURE_CACHE_BYTES, ImageEncoder

        if family.mrope:
            if model is None:
                raise ValueError(f"{family.name} takes images only with its language model given 3-D positions: "
                                 "pass model=")
            from mlxkv.vision.mrope import install_mrope

            install_mrope(model, config)
        encoder = ImageEncoder(path, config, DEFAULT_FEATURE_CACHE_BYTES if cache_bytes is None else cache_bytes)
        return cls(encoder, "", limits, family.marker_text(tokenizer))

    @property
    def available(self) -> bool:
        return self.encoder is not None

    def _check(self) -> None:
        if self.encoder is None:
            raise VisionUnavailable(self.problem)

    def take_openai(self, messages: list[dict], uuids: Sequence[str | None] | None) -> RequestImages:
        """Decode the ``image_url`` parts of OpenAI chat messages (dicts, changed in place: each part becomes a
        text part holding the marker).

        Raises:
            ImageError: a bad image or UUID list; VisionUnavailable: images given to a model that takes none.
        """
        found: list[DecodedImage] = []
        for message in messages:
            parts = message.get("content")
            for i, part in enumerate(parts if isinstance(parts, list) else ()):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    self._check()
                    check_count(len(found) + 1, self.limits)
                    url = (part.get("image_url") or {}).get("url", "")
                    found.append(decode_image(read_image_url(url, self.limits), self.limits))
                    parts[i] = {"type": "text", "text": self.marker}
        if uuids is not None and not found:
            raise ImageError("multi_modal_uuids.image names images, but the request has none")
        return RequestImages(found, check_uuids(uuids, len(found)))

    def take_anthropic(self, messages: list[Any], uuids: Sequence[str | None] | None, text_block: Any
                       ) -> RequestImages:
        """Decode the base64 ``image`` blocks of Anthropic messages (replaced in place by ``text_block(marker)``).
        A text-only model keeps its blocks (the route refuses them as it refuses any image).

        Raises:
            ImageError: a bad image, source or UUID list; VisionUnavailable: mlx-vlm missing.
        """
        if self.encoder is None and "mlx-vlm" not in self.problem:  # text only: the route refuses image blocks
            if uuids is not None:
                raise VisionUnavailable(self.problem)
            return RequestImages()
        found: list[DecodedImage] = []
        for message in messages:
            blocks = message.content
            for i, block in enumerate(blocks if isinstance(blocks, list) else ()):
                if getattr(block, "type", None) == "image":
                    self._check()
                    check_count(len(found) + 1, self.limits)
                    found.append(decode_image(_anthropic_bytes(getattr(block, "source", None), self.limits),
                                              self.limits))
                    blocks[i] = text_block(self.marker)
        if uuids is not None and not found:
            raise ImageError("multi_modal_uuids.image names images, but the request has none")
        return RequestImages(found, check_uuids(uuids, len(found)))

    def expand(self, ids: Sequence[int], images: RequestImages) -> tuple[list[int], tuple]:
        """The prompt with each image's placeholders, and the images' spans (runs the image processor).

        Raises:
            ImageError: the marker count differs from the image count.
        """
        from mlxkv.vision.prompt import expand_images, prepare_images

        self._check()
        return expand_images(ids, prepare_images(self.encoder, images.decoded, images.uuids), self.encoder)

    def stats(self) -> dict[str, int]:
        """The encoder's feature-cache counters (empty without an encoder)."""
        return self.encoder.stats() if self.encoder is not None else {}


def _anthropic_bytes(source: Any, limits: ImageLimits) -> bytes:
    """An Anthropic image source's bytes: ``base64`` data; a ``url`` source is a data URL or an allowed file."""
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        return decode_base64(source["data"])
    if kind == "url" and isinstance(source.get("url"), str):
        return read_image_url(source["url"], limits)
    raise ImageError("an image block needs source {\"type\": \"base64\", \"media_type\": ..., \"data\": ...}")


def images_from_files(paths: Sequence[str], loaded: Any, limits: ImageLimits = ImageLimits(),
                      vision: VisionInputs | None = None) -> tuple[VisionInputs, RequestImages]:
    """The images in files ``paths`` (``mlxkv generate --image``, chat's ``/image``) for the loaded model
    (:class:`mlxkv.models.LoadedModel`), and its image support (``vision`` when given, else loaded now).

    Raises:
        ImageError: a file that cannot be read or is not an image; VisionUnavailable: a model that takes none.
    """
    if vision is None:
        vision = VisionInputs(None, TEXT_ONLY, limits) if loaded.is_gguf else \
            VisionInputs.for_model(loaded.path, loaded.config, loaded.tokenizer, limits, model=loaded.model)
    vision._check()
    check_count(len(paths), limits)
    decoded = []
    for name in paths:
        try:
            data = Path(name).expanduser().read_bytes()
        except OSError:
            raise ImageError(f"cannot read the image file {name}") from None
        decoded.append(decode_image(data, limits))
    return vision, RequestImages(decoded, (None,) * len(decoded))
