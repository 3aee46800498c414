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
        self.projector = vlm.multi_modal_projector
        # the language model's weights stay unread (lazy): mlx-lm's copy runs the text
        upcast_on_cpu(self.tower)  # float32 on the CPU backend, as the language model runs there
        upcast_on_cpu(self.projector)
        mx.eval(self.tower.parameters(), self.projector.parameters())
        self.processor = AutoImageProcessor.from_pretrained(str(path))
        self.cache = FeatureCache(cache_bytes)

    @property
    def tokens_per_image(self) -> int:
        return self.family.tokens_per_image

    def pixels(self, image: Any) -> np.ndarray:
        """The processor's pixel values for one RGB image, ``(1, C, H, W)`` float32 (any thread)."""
        out = self.processor(images=[image], return_tensors="np")
        return np.asarray(out["pixel_values"][:1], dtype=np.float32)

    def features(self, content_hash: str, pixels: np.ndarray) -> mx.array:
        """The rows replacing one image's placeholders, ``(tokens_per_image, hidden)``, from the cache or the vision
        tower (engine thread: MLX graphs stay on the thread that evaluates them)."""
        found = self.cache.get(content_hash)
        if found is not None:
            return found
        x = mx.array(pixels).transpose(0, 2, 3, 1)  # (1, H, W, C): MLX convolutions are channels-last
        hidden, _, _ = self.tower(x, output_hidden_states=True)  # (1, patches, vision hidden)
        rows = self.family.project(self.projector, hidden)[0]  # (tokens_per_image, hidden)
        if rows.shape[0] != self.tokens_per_image:
            raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image of {self.tokens_per_image} "
                             "tokens (config.json's mm_tokens_per_image and vision_config disagree)")
        mx.eval(rows)
        self.cache.put(content_hash, rows)
        return rows

    def stats(self) -> dict[str, int]:
        s = self.cache.stats()
        return {"encoder_cache_hits": s.hits, "encoder_cache_misses": s.misses, "encoder_cache_entries": s.entries,
                "encoder_cache_bytes": s.bytes, "encoder_cache_budget_bytes": s.budget_bytes}
