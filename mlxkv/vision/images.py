"""Image inputs: bytes from a data URL, base64 or an allowed local file, decoded and checked, with a content hash.

No network access ever: an ``http(s)`` URL is refused with a message saying so. A local ``file://`` URL is read
only from the folders the server names (``mlxkv serve --allowed-image-dir``). Every problem is an
:class:`ImageError` whose message is one line meant for the client (the routes answer it with a 400).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import unquote, urlparse

#: Most bytes one encoded image may have.
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Most pixels (width x height) one decoded image may have (a small file can decode to a huge bitmap).
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
#: Most images one request may hold.
DEFAULT_MAX_IMAGES = 8


class ImageError(ValueError):
    """An image input that cannot be used; the message is one line for the client."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request's images may be: ``max_bytes`` encoded each, ``max_pixels`` decoded each, ``max_images``
    in all; ``allowed_dirs``: folders ``file://`` URLs may read from (none: local files are refused)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES
    allowed_dirs: tuple[Path, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class DecodedImage:
    """One image ready for the processor: RGB pixels and the sha256 hex of its size and pixel bytes (the same
    picture in another file format hashes alike; one changed pixel does not)."""

    image: Any  # PIL.Image.Image, RGB
    content_hash: str


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> DecodedImage:
    """Decode encoded image bytes (any format Pillow reads) to RGB and hash the pixels.

    Raises:
        ImageError: too many bytes or pixels, or not an image.
    """
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > limits.max_pixels:
                raise ImageError(f"image is {width}x{height} pixels, over the limit of {limits.max_pixels}")
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError("the image data is not an image Pillow can read (PNG, JPEG, GIF, WebP, BMP, ...)") from None
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).hexdigest()
    return DecodedImage(rgb, digest)


def decode_base64(text: str) -> bytes:
    """Bytes of a base64 body (standard alphabet, padding optional)."""
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None


def read_image_url(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes an OpenAI ``image_url`` names: a ``data:`` URL, or a ``file://`` URL inside an allowed folder.

    Raises:
        ImageError: a network URL, a file outside the allowed folders (or none allowed), a missing file, a
            malformed data URL.
    """
    if url.startswith("data:"):
        head, sep, body = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError("an image data URL must look like data:image/png;base64,<data>")
        return decode_base64(body)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        raise ImageError("image URLs are not fetched (the server makes no network requests): send the image as a "
                         "data URL (data:image/png;base64,...)")
    if scheme != "file":
        raise ImageError(f"unsupported image URL scheme {scheme or '(none)'!r}: send a data URL")
    return _read_local(Path(unquote(urlparse(url).path)), limits)


def _read_local(path: Path, limits: ImageLimits) -> bytes:
    if not limits.allowed_dirs:
        raise ImageError("file:// image URLs are off on this server (mlxkv serve --allowed-image-dir DIR turns "
                         "them on for DIR)")
    resolved = path.resolve()
    if not any(resolved.is_relative_to(d.resolve()) for d in limits.allowed_dirs):
        raise ImageError(f"{path} is outside the folders this server reads images from")
    try:
        size = resolved.stat().st_size
        if size > limits.max_bytes:
            raise ImageError(f"image is {size} bytes, over the limit of {limits.max_bytes}")
        return resolved.read_bytes()
    except OSError:
        raise ImageError(f"cannot read the image file {path}") from None


def check_count(count: int, limits: ImageLimits) -> None:
    """Refuse more than ``limits.max_images`` images in one request."""
    if count > limits.max_images:
        raise ImageError(f"{count} images in one request, over the limit of {limits.max_images}")


def check_uuids(uuids: Sequence[str | None] | None, count: int) -> tuple[str | None, ...]:
    """The per-image UUIDs of a request (``multi_modal_uuids.image``): one entry per image, ``None`` for an image
    keyed by its content alone; no list: every image by content.

    Raises:
        ImageError: a list whose length is not the number of images, or an empty UUID.
    """
    if uuids is None:
        return (None,) * count
    if len(uuids) != count:
        raise ImageError(f"multi_modal_uuids.image has {len(uuids)} entries for {count} images: give one per image "
                         "(null for an image keyed by its content)")
    if any(u is not None and (not isinstance(u, str) or not u) for u in uuids):
        raise ImageError("multi_modal_uuids.image entries must be non-empty strings or null")
    return tuple(uuids)
