"""CachePool: the per-sequence owner of layer caches.

Every running sequence gets a monotonic :class:`SequenceId` and one cache per model layer, in the layout that
layer's attention needs. The pool records each sequence's prompt length and creation time, enforces
``max_sequences`` and reports the bytes its K/V buffers hold.

Not thread-safe, by design: the engine that owns the pool is its only caller (the server's engine thread,
or the direct engine's loop). Callers on other threads talk to the engine, never to the pool.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

CacheFactory = Callable[[Any], list]
LAYOUTS = ("mlxkv", "mlx-lm")


class PoolFullError(RuntimeError):
    """Opening a sequence would exceed ``max_sequences``."""


@dataclass(frozen=True, order=True)
class SequenceId:
    """Identity of one sequence in a pool; ids only ever increase and are never reused."""

    value: int

    def __str__(self) -> str:
        return f"seq-{self.value}"


@dataclass
class Sequence:
    """A sequence's state in the pool: its layer caches and bookkeeping."""

    id: SequenceId
    caches: list  # one per model layer; the layout follows the layer's attention
    prompt_length: int  # tokens in the prompt (set by the engine at prefill)
    created_at: float = field(default_factory=time.monotonic)

    @property
    def offset(self) -> int:
        """Tokens processed so far (prompt + generated), read from the first attention cache."""
        for cache in self.caches:
            offset = getattr(cache, "offset", None)
            if isinstance(offset, int):
                return offset
        return 0

    def nbytes(self) -> int:
        """Bytes held by this sequence's cache buffers (K/V and any recurrent state)."""
        return sum(_cache_nbytes(c) for c in self.caches)


def _cache_nbytes(cache: Any) -> int:
    try:
        return int(cache.nbytes)
    except (NotImplementedError, AttributeError):
        return 0


def mlx_lm_caches(model: Any, *, max_kv_size: int | None = None, kv_bits: int | None = None,
                  kv_group_size: int = 64) -> list:
    """mlx-lm's own caches for ``model`` (the reference the tests and benchmarks compare against).

    mlx-lm quantizes only plain ``KVCache`` layers; others stay unquantized, as in mlx-lm.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    if kv_bits is not None:
        caches = [c.to_quantized(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
                  for c in caches]
    return caches


def mlxkv_caches(model: Any, *, max_kv_size: int | None = None, kv_bits: int | None = None,
                 kv_group_size: int = 64) -> list:
    """mlxkv's own layouts for ``model`` (see :func:`mlxkv.cache.make_caches`)."""
    from mlxkv.cache import make_caches

    return make_caches(model, max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size)


class CachePool:
    """Owns the layer caches of every open sequence of one model.

    Args:
        model: the mlx-lm model whose layers the caches serve.
        max_sequences: most sequences open at once (``open`` raises :class:`PoolFullError` past it).
        layout: ``"mlxkv"`` (our layouts, default) or ``"mlx-lm"`` (mlx-lm's caches, for comparison).
        max_kv_size: cap on cached tokens per layer (full-attention layers become rotating caches).
        kv_bits: quantize K/V to 4 or 8 bits (``None``: full precision).
        kv_group_size: quantization group size.
        cache_factory: overrides ``layout``: ``factory(model) -> list`` of layer caches.
    """

    def __init__(self, model: Any, *, max_sequences: int = 16, layout: str = "mlxkv",
                 max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64,
                 cache_factory: CacheFactory | None = None):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if kv_bits not in (None, 4, 8):
            raise ValueError(f"kv_bits must be 4, 8 or None, got {kv_bits}")
        if max_kv_size is not None and max_kv_size < 1:
            raise ValueError(f"max_kv_size must be >= 1, got {max_kv_size}")
        self.model = model
        self.max_sequences = max_sequences
        self.layout = layout
        if cache_factory is None:
            build = mlxkv_caches if layout == "mlxkv" else mlx_lm_caches
            options = dict(max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size)
            cache_factory = lambda m: build(m, **options)  # noqa: E731
        self._factory = cache_factory
        self._ids = itertools.count(1)
        self._sequences: dict[SequenceId, Sequence] = {}

    def open(self, prompt_length: int = 0) -> Sequence:
        """Start a sequence with fresh, empty layer caches.

        Raises:
            PoolFullError: ``max_sequences`` sequences are already open.
        """
        if len(self._sequences) >= self.max_sequences:
            raise PoolFullError(
                f"the cache pool is full: {self.max_sequences} sequences open (max_sequences={self.max_sequences})"
            )
        seq = Sequence(id=SequenceId(next(self._ids)), caches=self._factory(self.model),
                       prompt_length=prompt_length)
        self._sequences[seq.id] = seq
        return seq

    def get(self, seq_id: SequenceId) -> Sequence:
        """The open sequence ``seq_id`` (KeyError if it is not open)."""
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise KeyError(f"{seq_id} is not open in this pool") from None

    def release(self, seq_id: SequenceId) -> None:
        """Drop a sequence and its caches (KeyError if it is not open)."""
        seq = self.get(seq_id)
        del self._sequences[seq_id]
        seq.caches.clear()  # drop our references so MLX can free the buffers

    def memory_usage_bytes(self) -> int:
        """Bytes allocated by the K/V buffers (and recurrent state) of every open sequence."""
        return sum(seq.nbytes() for seq in self._sequences.values())

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._sequences

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._sequences.values()))
