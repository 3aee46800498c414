"""CachePool: the per-sequence owner of layer caches.

Every running sequence gets a monotonic :class:`SequenceId` and one cache per model layer, in the layout that
layer's attention needs. The pool records each sequence's prompt length and creation time, enforces
``max_sequences`` and reports the bytes its K/V buffers hold.

Not thread-safe, by design: the engine that owns the pool is its only caller (the server's engine thread,
or the direct engine's loop). Callers on other threads talk to the engine, never to the pool.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from mlxkv.config import KV_GROUP_SIZES

CacheFactory = Callable[[Any], list]
LAYOUTS = ("mlxkv", "mlx-lm")
BACKENDS = ("dense", "paged")


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
    paged: Any = None  # paged backend: the mlxkv.kv.paged.PagedSequence (block manager bridge); None when dense

    @property
    def num_cached(self) -> int:
        """Prompt tokens served by the prefix cache (paged backend); prefill starts there."""
        return self.paged.num_cached if self.paged is not None else 0

    def feed(self, token_ids: list[int]) -> None:
        """Announce the tokens the next model step appends (paged: allocates their slots; dense: no-op)."""
        if self.paged is not None:
            self.paged.feed(token_ids)

    def commit(self) -> None:
        """After a model step: its tokens are verified (paged: full blocks become cached; dense: no-op)."""
        if self.paged is not None:
            self.paged.commit()

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
    """mlxkv's own layouts for ``model`` (see :func:`mlxkv.kv.layouts.make_caches`)."""
    from mlxkv.kv.layouts import make_caches

    return make_caches(model, max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size)


def kv_head_dims(model: Any) -> set[int]:
    """The head sizes of the keys and values ``model``'s attention layers cache (from their projections).

    Found on modules that name their kv-head count (``n_kv_heads`` or ``num_key_value_heads``) and have
    ``k_proj`` / ``v_proj`` projections, as mlx-lm's attention classes do; a quantized projection's weight
    keeps one row per output feature. Empty when no layer looks like that (MLA, fused projections).
    """
    dims = set()
    for module in model.modules():
        kv_heads = getattr(module, "n_kv_heads", None) or getattr(module, "num_key_value_heads", None)
        if not isinstance(kv_heads, int) or kv_heads < 1:
            continue
        for name in ("k_proj", "v_proj"):
            weight = getattr(getattr(module, name, None), "weight", None)
            if weight is not None and weight.shape[0] % kv_heads == 0:
                dims.add(weight.shape[0] // kv_heads)
    return dims


def check_kv_group_size(model: Any, kv_group_size: int) -> None:
    """Refuse a quantized KV cache whose group size does not divide every cached head size of ``model``.

    MLX quantizes each cached row in groups along head_dim; checked here so that the error comes when the pool
    is built, before any prompt is processed.

    Raises:
        ValueError: one line naming the head_dim and the group sizes that fit, or saying that none does.
    """
    head_dims = kv_head_dims(model)
    misfits = sorted(d for d in head_dims if d % kv_group_size)
    if not misfits:
        return
    fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in head_dims)]
    hint = (f"use --kv-group-size {' or '.join(map(str, fits))}" if fits else
            f"no valid group size ({', '.join(map(str, KV_GROUP_SIZES))}) divides it, so this model cannot use a "
            "quantized KV cache: run it without --kv-bits")
    raise ValueError(f"--kv-bits: the model's head_dim {misfits[0]} is not divisible by the KV quantization "
                     f"group size {kv_group_size}; {hint}")


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
        backend: ``"dense"`` (per-sequence buffers, default) or ``"paged"`` (blocks of one shared pool, with
            prefix caching: :class:`mlxkv.kv.paged.PagedBackend`; ``open`` then takes the prompt tokens).
        kv_config: paged backend: block size, budget and reuse settings (default ``KvCacheConfig()``).
        num_blocks: paged backend: pool size in blocks, overriding the budget.
        model_path: paged backend: the model's folder, for the secondary KV tier's model fingerprint
            (``kv_config.secondary_*``); optional.
    """

    def __init__(self, model: Any, *, max_sequences: int = 16, layout: str = "mlxkv",
                 max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64,
                 cache_factory: CacheFactory | None = None, backend: str = "dense", kv_config: Any = None,
                 num_blocks: int | None = None, model_path: str | None = None):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if kv_bits not in (None, 4, 8):
            raise ValueError(f"kv_bits must be 4, 8 or None, got {kv_bits}")
        if max_kv_size is not None and max_kv_size < 1:
            raise ValueError(f"max_kv_size must be >= 1, got {max_kv_size}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.model = model
        self.max_sequences = max_sequences
        self.layout = layout
        self.backend = backend
        self.paged = None
        if backend == "paged":
            from mlxkv.config import KvCacheConfig
            from mlxkv.kv.paged import PagedBackend

            if layout != "mlxkv" or cache_factory is not None:
                raise ValueError("backend='paged' builds its own caches: use layout='mlxkv' and no cache_factory")
            self.paged = PagedBackend(model, kv_config or KvCacheConfig(backend="paged"), num_blocks=num_blocks,
                                      model_path=model_path)
        if cache_factory is None:
            if kv_bits is not None:
                check_kv_group_size(model, kv_group_size)
            build = mlxkv_caches if layout == "mlxkv" else mlx_lm_caches
            cache_factory = functools.partial(build, max_kv_size=max_kv_size, kv_bits=kv_bits,
                                              kv_group_size=kv_group_size)
        self._factory = cache_factory
        self._ids = itertools.count(1)
        self._sequences: dict[SequenceId, Sequence] = {}

    def open(self, prompt_length: int = 0, *, prompt: list[int] | None = None,
             salt: str | bytes | None = None) -> Sequence:
        """Start a sequence with fresh, empty layer caches.

        Paged backend: ``prompt`` (token ids) is required; the sequence is registered with the block manager
        and takes its prefix hit (``seq.num_cached`` tokens need no compute); ``salt`` isolates caches
        (sequences with different salts never share blocks).

        Raises:
            PoolFullError: ``max_sequences`` sequences are already open.
            ValueError: paged backend without ``prompt``.
        """
        if len(self._sequences) >= self.max_sequences:
            raise PoolFullError(
                f"the cache pool is full: {self.max_sequences} sequences open (max_sequences={self.max_sequences})"
            )
        if self.paged is not None:
            if not prompt:
                raise ValueError("backend='paged': open() needs the prompt token ids (prompt=[...])")
            caches, paged = self.paged.open(prompt, salt=salt)
            seq = Sequence(id=SequenceId(next(self._ids)), caches=caches,
                           prompt_length=prompt_length or len(prompt), paged=paged)
            self._sequences[seq.id] = seq
            return seq
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
        if seq.paged is not None:
            self.paged.release(seq.paged)  # blocks back to the pool, tail first; verified ones stay cached

    def fork(self, seq_id: SequenceId, n: int) -> list[Sequence]:
        """``n`` new sequences continuing from ``seq_id``'s current state (best-of-n, parallel sampling).

        Paged backend: the children share every block of the parent (copy-on-write on a shared partial tail),
        so n samples of one prompt hold the prompt's K/V once. Dense backend: the caches are copied.

        Raises:
            PoolFullError: the children would exceed ``max_sequences``; KeyError: ``seq_id`` is not open.
        """
        import copy

        parent = self.get(seq_id)
        if n < 1:
            raise ValueError(f"fork n must be >= 1, got {n}")
        if len(self._sequences) + n > self.max_sequences:
            raise PoolFullError(f"forking {n} would exceed max_sequences={self.max_sequences}")
        if parent.paged is not None:
            pairs = self.paged.fork(parent.paged, parent.caches, n)
        else:
            pairs = [(copy.deepcopy(parent.caches), None) for _ in range(n)]
        children = []
        for caches, paged in pairs:
            child = Sequence(id=SequenceId(next(self._ids)), caches=caches, prompt_length=parent.prompt_length,
                             paged=paged)
            self._sequences[child.id] = child
            children.append(child)
        return children

    def check_invariants(self) -> None:
        """Assert pool consistency (tests): paged: manager invariants, open sequences == manager sequences."""
        if self.paged is not None:
            self.paged.check_invariants()
            assert sorted(s.paged.seq_id for s in self._sequences.values()) == sorted(self.paged.sequences)

    def memory_usage_bytes(self) -> int:
        """Bytes allocated by the K/V buffers (and recurrent state) of every open sequence."""
        return sum(seq.nbytes() for seq in self._sequences.values())

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._sequences

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._sequences.values()))
