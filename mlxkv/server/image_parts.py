"""Images in OpenAI-style chat messages (``image_url`` parts), taken out for the model's image support: shared by
``/v1/chat/completions`` and ``/v1/responses`` (whose ``input_image`` parts arrive as ``image_url`` parts)."""

from __future__ import annotations

from typing import Any

from mlxkv.server.errors import APIError


def has_images(messages: list[dict], uuids: dict | None) -> bool:
    """Whether chat messages (dicts) hold ``image_url`` parts, or the body names images."""
    return bool(uuids) or any(isinstance(p, dict) and p.get("type") == "image_url" for m in messages
                              for p in (m.get("content") if isinstance(m.get("content"), list) else ()))


def take_openai_images(vision: Any, messages: list[dict], uuids: dict | None, param: str = "messages") -> Any:
    """The ``image_url`` parts of chat messages (dicts, each part left as its marker text), decoded.

    Raises:
        APIError: 400 (blamed on ``param``) for a bad image, or images given to a model that takes none.
    """
    from mlxkv.vision.images import ImageError
    from mlxkv.vision.inputs import VisionInputs
    from mlxkv.vision.support import VisionUnavailable

    try:
        return (vision or VisionInputs()).take_openai(messages, (uuids or {}).get("image"))
    except (ImageError, VisionUnavailable) as exc:
        raise APIError(400, str(exc), "invalid_image", param) from None
