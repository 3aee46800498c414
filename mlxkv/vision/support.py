"""Which models read images, and whether the optional ``vision`` extra (mlx-vlm) is installed.

A family says how its prompts mark an image (the token the chat template writes where an image goes, and the
placeholder tokens that stand for it) and how its projector's output becomes input-embedding rows. mlxkv runs the
language model through mlx-lm, so a family's prompt positions must be plain 1-D positions: Gemma 3 qualifies;
Qwen2-VL's 3-D (M-RoPE) positions after an image depend on the image's grid and are not supported yet.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

#: How a user installs image support.
VISION_EXTRA = 'pip install "mlxkv[vision]"'
#: Why a text-only model refuses an image.
TEXT_ONLY = "this model reads text only: it takes no images"


class VisionUnavailable(ValueError):
    """Image input cannot be served; the message is one line for the user."""


def mlx_vlm_available() -> bool:
    """Whether mlx-vlm can be imported."""
    return importlib.util.find_spec("mlx_vlm") is not None


def require_mlx_vlm() -> None:
    """Raise :class:`VisionUnavailable` naming the extra when mlx-vlm is missing."""
    if not mlx_vlm_available():
        raise VisionUnavailable(f"image input needs mlx-vlm: {VISION_EXTRA}")


@dataclass(frozen=True, slots=True)
class VisionFamily:
    """A VLM family's prompt layout for images.

    Attributes:
        name: the config's ``model_type``.
        marker_id: the token the chat template writes where an image goes (Gemma 3: ``<start_of_image>``).
        marker: its text (what an image content part becomes in a message's text).
        image_id: the placeholder token repeated ``tokens_per_image`` times after the marker.
        end_id: the token closing the image (Gemma 3: ``<end_of_image>``).
        tokens_per_image: placeholders per image.
        hidden_size: the language model's width.
    """

    name: str
    marker_id: int
    image_id: int
    end_id: int
    tokens_per_image: int
    hidden_size: int
    marker: str = ""

    def expansion(self) -> list[int]:
        """What follows each marker: the placeholders, then the end token."""
        return [self.image_id] * self.tokens_per_image + [self.end_id]

    def project(self, projector: Any, hidden: Any) -> Any:
        """Vision-tower output ``(1, patches, vision hidden)`` -> input-embedding rows ``(1, tokens, hidden)``.

        Gemma 3's language model multiplies its input embeddings by ``sqrt(hidden)``; image features enter divided
        by it first (as mlx-vlm's ``prepare_inputs_for_multimodal`` does).
        """
        return projector(hidden) / math.sqrt(self.hidden_size)


def family_of(config: dict) -> VisionFamily:
    """The image layout of the model with ``config`` (its config.json).

    Raises:
        VisionUnavailable: the model reads text only, or its family is not supported.
    """
    kind = config.get("model_type")
    if "vision_config" not in config:
        raise VisionUnavailable(f"{TEXT_ONLY} ({kind})")
    if kind == "gemma3":
        text = config.get("text_config", {})
        return VisionFamily(name=kind, marker_id=int(config.get("boi_token_index", 255999)),
                            image_id=int(config.get("image_token_index", 262144)),
                            end_id=int(config.get("eoi_token_index", 256000)),
                            tokens_per_image=int(config.get("mm_tokens_per_image", text.get("mm_tokens_per_image", 256))),
                            hidden_size=int(text["hidden_size"]))
    raise VisionUnavailable(f"image input is not supported for model_type {kind!r} (supported: gemma3)")


def takes_images(config: dict) -> bool:
    """Whether the model's config describes a supported vision-language model."""
    try:
        family_of(config)
    except VisionUnavailable:
        return False
    return True
