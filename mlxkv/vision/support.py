"""Which models read images, and whether the optional ``vision`` extra (mlx-vlm) is installed.

A family says how its prompts mark an image (the token the chat template writes where an image goes, and the
placeholder tokens that stand for it) and how its projector's output becomes input-embedding rows. mlxkv runs the
language model through mlx-lm. Gemma 3 has a fixed number of tokens per image and plain 1-D positions; Qwen2-VL and
Qwen2.5-VL keep each image's aspect ratio (tokens per image vary with its size) and place its tokens on a 3-D
(temporal, height, width) grid of rotary positions (M-RoPE, :mod:`mlxkv.vision.mrope`).
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
        marker_id: the token found in the tokenized prompt where an image goes (Gemma 3: ``<start_of_image>``, kept,
            the placeholders follow it; Qwen2-VL: ``<|image_pad|>``, replaced by the image's placeholders).
        image_id: the placeholder token, repeated once per image token.
        end_id: the token closing the image after its placeholders (Gemma 3: ``<end_of_image>``), or None (Qwen2-VL:
            the chat text already holds ``<|vision_end|>``).
        tokens_per_image: placeholders per image (0: each image's own, from its grid).
        hidden_size: the language model's width.
        mrope: the language model takes 3-D (M-RoPE) positions (Qwen2-VL, Qwen2.5-VL).
        merge_size: vision patches merged per image token along each side (M-RoPE families).
        marker_ids: the tokens an image becomes in a message's text (their text is :meth:`marker_text`).
    """

    name: str
    marker_id: int
    image_id: int
    end_id: int | None
    tokens_per_image: int
    hidden_size: int
    mrope: bool = False
    merge_size: int = 1
    marker_ids: tuple[int, ...] = ()

    @property
    def keeps_marker(self) -> bool:
        """The marker stays in the prompt, its image's placeholders after it (else they replace it)."""
        return self.marker_id != self.image_id

    def marker_text(self, tokenizer: Any) -> str:
        """The text an image becomes in a message (Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``)."""
        return "".join(tokenizer.convert_ids_to_tokens(list(self.marker_ids or (self.marker_id,))))

    def token_grid(self, grid: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        """An image's grid of tokens ``(t, h, w)`` from the processor's grid of patches (None: no grid)."""
        if grid is None:
            return None
        t, h, w = grid
        return (t, h // self.merge_size, w // self.merge_size)

    def tokens_for(self, grid: tuple[int, int, int] | None) -> int:
        """How many placeholder tokens an image with the processor's patch ``grid`` takes."""
        if self.tokens_per_image:
            return self.tokens_per_image
        t, h, w = self.token_grid(grid)
        return t * h * w

    def expansion(self, tokens: int) -> list[int]:
        """What an image's marker becomes: the marker (if kept), the placeholders, the end token (if any)."""
        head = [self.marker_id] if self.keeps_marker else []
        return head + [self.image_id] * tokens + ([self.end_id] if self.end_id is not None else [])

    @property
    def placeholders_at(self) -> int:
        """Where the placeholders start in :meth:`expansion`."""
        return 1 if self.keeps_marker else 0

    def project(self, projector: Any, hidden: Any) -> Any:
        """Vision-tower output ``(1, patches, vision hidden)`` -> input-embedding rows ``(1, tokens, hidden)``.

        Gemma 3's language model multiplies its input embeddings by ``sqrt(hidden)``; image features enter divided
        by it first (as mlx-vlm's ``prepare_inputs_for_multimodal`` does). (M-RoPE families: the vision tower's
        patch merger gives the rows itself.)
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
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        try:
            image_id = int(config.get("image_token_id", 151655))
            start_id = int(config.get("vision_start_token_id", 151652))
            end_id = int(config.get("vision_end_token_id", start_id + 1))
            text = config.get("text_config") or config
            return VisionFamily(name=kind, marker_id=image_id, image_id=image_id, end_id=None, tokens_per_image=0,
                                hidden_size=int(text["hidden_size"]), mrope=True,
                                merge_size=int(config["vision_config"].get("spatial_merge_size", 2)),
                                marker_ids=(start_id, image_id, end_id))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise VisionUnavailable(f"config.json's image settings for {kind} are malformed (token ids, hidden_size, "
                                    "vision_config.spatial_merge_size)") from None
    raise VisionUnavailable(f"image input is not supported for model_type {kind!r} (supported: gemma3, qwen2_vl, "
                            "qwen2_5_vl)")


def takes_images(config: dict) -> bool:
    """Whether the model's config describes a supported vision-language model."""
    try:
        family_of(config)
    except VisionUnavailable:
        return False
    return True
