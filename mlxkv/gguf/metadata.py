"""A GGUF file's metadata with its arrays (vocabulary, merges, scores), read without loading any tensor.

MLX's reader returns the metadata only together with every tensor; a file whose tensors mlxkv decodes itself
(:mod:`mlxkv.gguf.tensors`) needs the metadata alone. Numeric arrays are read as numpy views, string arrays
string by string.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

# GGUF metadata value types -> numpy dtype of a scalar (8 is a string, 9 an array).
_NUMERIC = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
_STRING, _ARRAY = 8, 9


def read_metadata(data: bytes | memoryview) -> dict[str, Any]:
    """Every key-value pair of the GGUF file whose bytes start ``data``, as Python scalars, strings and lists.

    Raises:
        ValueError: a truncated or malformed metadata section (the header was already checked by
            :func:`mlxkv.gguf.header.read_header`, so this is only reached by a file changed in between).
    """
    view = memoryview(data)
    pos = 4 + 4 + 8  # magic, version, tensor count
    (count,) = struct.unpack_from("<Q", view, pos)
    pos += 8
    meta: dict[str, Any] = {}
    for _ in range(count):
        key, pos = _string(view, pos)
        (kind,) = struct.unpack_from("<I", view, pos)
        meta[key], pos = _value(view, pos + 4, kind)
    return meta


def _string(view: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", view, pos)
    end = pos + 8 + n
    if end > len(view):
        raise ValueError("truncated GGUF metadata")
    return bytes(view[pos + 8:end]).decode("utf-8", errors="replace"), end


def _value(view: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _NUMERIC:
        dtype = np.dtype(_NUMERIC[kind])
        return np.frombuffer(view, dtype, 1, pos)[0].item(), pos + dtype.itemsize
    if kind == _STRING:
        return _string(view, pos)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {kind}")
    item, n = struct.unpack_from("<IQ", view, pos)
    pos += 12
    if item in _NUMERIC:
        dtype = np.dtype(_NUMERIC[item])
        if pos + n * dtype.itemsize > len(view):
            raise ValueError("truncated GGUF metadata")
        return np.frombuffer(view, dtype, n, pos).tolist(), pos + n * dtype.itemsize
    out = []
    for _ in range(n):
        value, pos = _value(view, pos, item)
        out.append(value)
    return out, pos
