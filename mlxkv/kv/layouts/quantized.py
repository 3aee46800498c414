"""Quantized storage for every layout: K/V rows kept as ``mx.quantize`` planes (4 or 8 bits).

Each row is quantized on its own along head_dim (groups of ``group_size``), so a row's bytes do not
depend on what else is cached: writes, ring overwrites, rewinds and fronts dropped stay exact
relative to the quantized values. ``update_and_fetch`` returns mlx-lm's ``(packed, scales, biases)``
tuples and ``attend`` runs attention on them with ``mx.quantized_matmul`` (no dequantized copy).

Tolerance (tests/test_cache_quantized.py): a quantized cache attends exactly the quantize-dequantized
K/V (within 1e-5 of a dense cache holding those values). Against dense K/V: attention outputs within
1e-2 (8 bits) / 1e-1 (4 bits) on unit-normal K/V (head_dim 64, groups of 64); 8-bit logits within 5% of
the logit range on the tiny random test models, whose sharp attention amplifies K/V rounding.

Classes carry ``bits`` and ``group_size`` (mlx-lm's own attention checks ``hasattr(cache, "bits")``),
and their state appends ``(group_size, bits)`` to the layout's state, as mlx-lm's QuantizedKVCache does.
Like mlx-lm's QuantizedKVCache they have no ``to_quantized`` and no ``merge``: mlx-lm tests for those with
``hasattr`` (generate quantizes every cache that has ``to_quantized`` at every step; the server batches only
caches that have ``merge``).
"""

from __future__ import annotations

from mlxkv.kv.layouts.chunked import ChunkedKVCache
from mlxkv.kv.layouts.rotating import RotatingKVCache
from mlxkv.kv.layouts.standard import KVCache
from mlxkv.rules import KV_BITS, KV_GROUP_SIZES


class _Absent:
    """A class attribute that reads as missing (``hasattr`` is False): hides a method a layout defines."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        raise AttributeError(f"{objtype.__name__} has no {self.name!r} (as mlx-lm's QuantizedKVCache)")


class _Quantized:
    """Mixin: quantized storage under a layout (put first in the bases)."""

    to_quantized = _Absent()  # already quantized
    merge = _Absent()  # mlx-lm's batch caches hold dense rows only

    def __init__(self, *args, bits: int = 8, group_size: int = 64, **kwargs):
        if bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS}, got {bits}")
        if group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {group_size}")
        self.bits = bits
        self.group_size = group_size
        super().__init__(*args, **kwargs)

    def _scalars(self) -> tuple:
        return (*super()._scalars(), self.group_size, self.bits)

    def _restore(self, arrays: tuple, scalars: tuple) -> None:
        group_size, bits = (int(s) for s in scalars[-2:])
        if (group_size, bits) != (self.group_size, self.bits):
            self.group_size, self.bits = group_size, bits
            self._store = self._make_storage()
        super()._restore(arrays, scalars[:-2])

    @classmethod
    def _blank(cls, scalars: tuple):
        obj = super()._blank(scalars[:-2])
        obj.group_size, obj.bits = (int(s) for s in scalars[-2:])
        obj._store = obj._make_storage()
        return obj


class QuantizedKVCache(_Quantized, KVCache):
    """Standard layout, quantized rows (mlx-lm ``QuantizedKVCache`` state and save/load compatible).

    Args (mlx-lm's order):
        group_size: quantization group along head_dim (32, 64 or 128).
        bits: 4 or 8.
        step: growth granularity in rows.
    """

    def __init__(self, group_size: int = 64, bits: int = 8, step: int = 256):
        super().__init__(step, bits=bits, group_size=group_size)


class QuantizedRotatingKVCache(_Quantized, RotatingKVCache):
    """Rotating layout (sinks + ring + undo rows), quantized rows."""


class QuantizedChunkedKVCache(_Quantized, ChunkedKVCache):
    """Chunked layout, quantized rows."""


KVCache.quantized_twin = QuantizedKVCache
RotatingKVCache.quantized_twin = QuantizedRotatingKVCache
ChunkedKVCache.quantized_twin = QuantizedChunkedKVCache
