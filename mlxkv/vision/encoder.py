"""The vision side of a vision-language model: mlx-vlm's vision tower and projector, the checkpoint's image
processor, and a byte-budgeted cache of image features per content hash.

mlxkv runs the language model itself (loaded by mlx-lm, with mlxkv's caches and paged pool, like any text model);
this module loads only what turns an image into the rows that replace its placeholder tokens' embeddings. A cache
hit skips the vision tower; a prefix-cache hit covering the image skips this module entirely (the engine asks for
features only when a prefill chunk holds image tokens).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.precision import upcast_on_cpu
from mlxkv.vision.support import VisionFamily, family_of, require_mlx_vlm

#: Image-feature cache budget when none is given (bytes of cached feature arrays).
DEFAULT_FEATURE_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EncoderStats:
    """The feature cache's counters: lookups that hit (vision tower skipped) or missed (tower ran), entries and
    bytes held, and the budget."""

    hits: int
    misses: int
    entries: int
    bytes: int
    budget_bytes: int


@dataclass(frozen=True, slots=True, eq=False)
class ImagePixels:
    """What the image processor made of one image: its pixel values and, for families that keep the image's aspect
    ratio (Qwen2-VL), its grid of vision patches ``(t, h, w)`` (None: the family's one fixed resolution)."""

    values: np.ndarray
    grid: tuple[int, int, int] | None = None


class FeatureCache:
    """Image features by content hash, least recently used dropped first once over ``budget_bytes`` (0: off)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the image feature cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self._items: OrderedDict[str, mx.array] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> mx.array | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: str, value: mx.array) -> None:
        with self._lock:
            if value.nbytes > self.budget or key in self._items:
                return
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.budget:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes

    def stats(self) -> EncoderStats:
        with self._lock:
            return EncoderStats(self.hits, self.misses, len(self._items), self._bytes, self.budget)


class ImageEncoder:
    """Images to input-embedding rows for one VLM checkpoint.

    Args:
        path: the checkpoint folder (config.json, safetensors, the image processor's preprocessor_config.json).
        config: its config.json.
        cache_bytes: the feature cache's budget.

    Raises:
        VisionUnavailable: mlx-vlm is not installed, or the architecture has no image support in mlxkv.
    """

    def __init__(self, path: Path, config: dict, cache_bytes: int = DEFAULT_FEATURE_CACHE_BYTES):
        require_mlx_vlm()
        from mlx_vlm.utils import load_model
        from transformers import AutoImageProcessor

        self.family: VisionFamily = family_of(config)
        vlm = load_model(Path(path), lazy=True)
        self.tower = vlm.vision_tower
        self.projector = getattr(vlm, "multi_modal_projector", None)  # Qwen2-VL: the tower's own patch merger
        # the language model's weights stay unread (lazy): mlx-lm's copy runs the text
        upcast_on_cpu(self.tower)  # float32 on the CPU backend, as the language model runs there
        mx.eval(self.tower.parameters())
        if self.projector is not None:
            upcast_on_cpu(self.projector)
            mx.eval(self.projector.parameters())
        self.processor = AutoImageProcessor.from_pretrained(str(path))
        self.cache = FeatureCache(cache_bytes)

    def pixels(self, image: Any) -> ImagePixels:
        """The processor's pixel values for one RGB image (any thread): ``(1, C, H, W)`` float32 (Gemma 3), or the
        flattened patches ``(patches, C * T * P * P)`` and their grid (Qwen2-VL)."""
        out = self.processor(images=[image], return_tensors="np")
        grid = out.get("image_grid_thw")
        if grid is None:
            return ImagePixels(np.asarray(out["pixel_values"][:1], dtype=np.float32))
        return ImagePixels(np.asarray(out["pixel_values"], dtype=np.float32), tuple(int(v) for v in grid[0]))

    def tokens_for(self, pixels: ImagePixels) -> int:
        """How many placeholder tokens the image of ``pixels`` takes."""
        return self.family.tokens_for(pixels.grid)

    def features(self, content_hash: str, pixels: ImagePixels) -> mx.array:
        """The rows replacing one image's placeholders, ``(tokens, hidden)``, from the cache or the vision tower
        (engine thread: MLX graphs stay on the thread that evaluates them)."""
        found = self.cache.get(content_hash)
        if found is not None:
            return found
        if pixels.grid is not None:  # Qwen2-VL: patches and their grid in, merged rows out
            rows = self.tower(mx.array(pixels.values), mx.array([pixels.grid]))  # (tokens, hidden)
        else:
            x = mx.array(pixels.values).transpose(0, 2, 3, 1)  # (1, H, W, C): MLX convolutions are channels-last
            hidden, _, _ = self.tower(x, output_hidden_states=True)  # (1, patches, vision hidden)
            rows = self.family.project(self.projector, hidden)[0]  # (tokens, hidden)
        want = self.tokens_for(pixels)
        if rows.shape[0] != want:
            raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image of {want} tokens "
                             "(config.json's image token count and vision_config disagree)")
        mx.eval(rows)
        self.cache.put(content_hash, rows)
        return rows

    def stats(self) -> dict[str, int]:
        s = self.cache.stats()
        return {"encoder_cache_hits": s.hits, "encoder_cache_misses": s.misses, "encoder_cache_entries": s.entries,
                "encoder_cache_bytes": s.bytes, "encoder_cache_budget_bytes": s.budget_bytes}
