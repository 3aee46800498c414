"""What every mlxkv layer cache shares: mlx-lm's cache protocol plus ``attend``.

mlx-lm models talk to a cache through ``offset``, ``update_and_fetch``, ``make_mask``, ``state`` /
``from_state``, ``is_trimmable`` / ``trim``, ``nbytes``, ``empty`` and ``size``; code around them also reads
and assigns ``keys`` / ``values`` and calls ``to_quantized`` and (batching) ``merge``. mlxkv layouts keep that
protocol exactly (so every mlx-lm architecture runs on them unchanged) and add ``attend`` (the cache
decides how attention runs) and ``rewindable`` (how many tokens ``trim`` can remove exactly).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv import env
from mlxkv.kv.layouts.dense_attention import attend
from mlxkv.kv.layouts.dense_storage import DenseStorage

#: Default tokens a rotating or chunked cache can always rewind exactly (speculative decoding drafts
#: stay well below this).
DEFAULT_MAX_REWIND = 64


class RewindError(ValueError):
    """A layer cache cannot remove exactly the tokens asked for: ``trim(n)`` past what it can restore, or (mlx-lm's
    caches, whose ``trim`` clamps) a trim that removed fewer."""


class LayerCache:
    """Base of the mlxkv layouts (not used directly).

    Subclasses set ``self.offset`` (tokens seen), own one :class:`DenseStorage` and implement
    ``update_and_fetch``, ``make_mask``, ``rewindable`` and the state hooks ``_arrays_state`` /
    ``_scalars`` / ``_restore``.
    """

    step = 256
    #: The layout's quantized twin class (set by :mod:`mlxkv.kv.layouts.quantized`, which subclasses the layouts).
    quantized_twin: type
    bits: int | None  # only quantized subclasses define these (mlx-lm checks hasattr(cache, "bits"))

    def __init__(self, step: int = 256):
        self.step = step
        self.offset = 0
        self._inplace = env.flags().kv_inplace_write
        self._store = self._make_storage()

    # -- storage -----------------------------------------------------------------------------
    def _max_rows(self) -> int | None:
        """Cap on storage rows (a ring's size); ``None`` for unbounded."""
        return None

    def _make_storage(self) -> DenseStorage:
        return DenseStorage(step=self.step, bits=getattr(self, "bits", None),
                            group_size=getattr(self, "group_size", 64), max_rows=self._max_rows())

    def _planes(self, x: Any) -> tuple:
        """A presented array / quantized tuple (as in ``state``) as storage planes."""
        return tuple(x) if isinstance(x, (tuple, list)) else (x,)

    @property
    def nbytes(self) -> int:
        """Bytes held by this cache's buffers (allocated capacity, not only filled rows)."""
        return self._store.nbytes

    @property
    def capacity(self) -> int:
        """Token rows allocated in the storage buffers (grows ``step`` rows at a time)."""
        return self._store.capacity

    def empty(self) -> bool:
        """True until the first ``update_and_fetch`` (or a loaded state)."""
        return self._store.empty()

    def arrays(self) -> list[mx.array]:
        """The resident buffers (for ``mx.eval`` between prefill chunks)."""
        return self._store.arrays()

    # -- mlx-lm's buffer attributes ----------------------------------------------------------
    # Read from storage on every access and never kept on the cache: no view of a buffer may outlive
    # the step that made it, or the next in-place decode write copies the whole buffer.
    @property
    def keys(self) -> Any:
        """mlx-lm's ``keys``: the whole key buffer ``(B, n_kv, capacity, D)`` (a plane tuple when quantized),
        ``None`` while empty. Rows are at their slots: row ``p`` holds token ``p`` for the standard layout (so
        ``cache.keys[..., :cache.offset, :]`` are the cached keys, as in mlx-lm). Assigning replaces the buffer."""
        return self._store.buffer("k")

    @keys.setter
    def keys(self, x: Any) -> None:
        self._store.set_buffer("k", x)

    @property
    def values(self) -> Any:
        """mlx-lm's ``values``: the whole value buffer, as :attr:`keys`."""
        return self._store.buffer("v")

    @values.setter
    def values(self, x: Any) -> None:
        self._store.set_buffer("v", x)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> LayerCache:
        """mlx-lm's ``to_quantized``: the quantized twin of this layout holding the same rows, each quantized.

        Rows stay at their slots, so the offset, window, chunk and rewind bookkeeping carry over unchanged.
        """
        twin = object.__new__(self.quantized_twin)
        twin.__dict__.update(self.__dict__)  # the layout's positions and sizes: the same for the twin
        twin.bits, twin.group_size = bits, group_size
        twin._store = twin._make_storage()
        if not self._store.empty():
            k, v = self._store.buffer("k"), self._store.buffer("v")  # (B, n_kv, capacity, D) each
            twin._store.load(twin._store.encode(k), twin._store.encode(v))
        return twin

    # -- attention ---------------------------------------------------------------------------
    def attend(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Attention of ``queries`` over ``keys``/``values`` as returned by ``update_and_fetch``
        (or derived from them by the model, as MLA does). See :func:`mlxkv.kv.layouts.dense_attention.attend`."""
        return attend(queries, keys, values, scale, mask, sinks,
                      bits=getattr(self, "bits", None), group_size=getattr(self, "group_size", 64))

    # -- rewind ------------------------------------------------------------------------------
    def rewindable(self) -> int:
        """How many of the last tokens ``trim`` can remove exactly right now."""
        raise NotImplementedError

    def is_trimmable(self) -> bool:
        """mlx-lm protocol: true when ``trim`` can remove at least one token exactly (or nothing is cached)."""
        return self.offset == 0 or self.rewindable() > 0

    def _check_rewind(self, n: int) -> int:
        """Clamp ``n`` to the cached tokens (like mlx-lm) and raise if it cannot be undone exactly."""
        n = min(max(int(n), 0), self.offset)
        limit = self.rewindable()
        if n > limit:
            raise RewindError(
                f"{type(self).__name__}: cannot trim {n} tokens exactly; at most {limit} can be removed now "
                f"(offset {self.offset}); rows older than that have been overwritten or dropped"
            )
        return n

    # -- state -------------------------------------------------------------------------------
    def _arrays_state(self) -> tuple:
        raise NotImplementedError

    def _scalars(self) -> tuple:
        raise NotImplementedError

    def _restore(self, arrays: tuple, scalars: tuple) -> None:
        raise NotImplementedError

    @property
    def state(self) -> tuple:
        """mlx-lm's state tuple for the same-named mlx-lm cache: arrays, then scalars."""
        return (*self._arrays_state(), *self._scalars())

    @state.setter
    def state(self, v) -> None:
        n = len(self._arrays_state_names())
        arrays, scalars = tuple(v[:n]), tuple(v[n:])
        self._restore(arrays, scalars if scalars else self._scalars())

    @property
    def meta_state(self) -> tuple:
        """The scalar part of ``state`` as strings (older mlx-lm protocol; informational)."""
        return tuple(str(s) for s in self._scalars())

    @classmethod
    def _arrays_state_names(cls) -> tuple:
        return ("keys", "values")

    @classmethod
    def _blank(cls, scalars: tuple) -> LayerCache:
        raise NotImplementedError

    @classmethod
    def from_state(cls, state, meta_state=None) -> LayerCache:
        """Rebuild a cache from ``state`` (mlx-lm's format for the same-named class; also accepts the
        older split ``(arrays, meta_state)`` form)."""
        n = len(cls._arrays_state_names())
        arrays = tuple(state[:n])
        if len(state) == n and meta_state is None:
            raise ValueError(f"{cls.__name__}.from_state: the state holds only arrays; pass its meta_state too")
        scalars = tuple(state[n:]) if len(state) > n else tuple(int(s) for s in meta_state)
        obj = cls._blank(scalars)
        obj._restore(arrays, scalars)
        return obj
