"""The tensor table of a GGUF file, read from its header without loading any tensor data.

llama.cpp's ``gguf`` package parses the same header but decodes every metadata array into numpy objects
(4.3 s for SmolLM2's 49K-token vocabulary and merges on this machine's CPU); this reader only skips over
the metadata, which takes a few milliseconds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

# GGUF metadata value types -> struct format of a scalar (8 is a string, 9 an array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

#: ggml tensor type ids -> names (ggml.h's ``ggml_type``).
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


#: ggml tensor types mlxkv loads -> (elements per block, bytes per block).
BLOCK_SIZES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
               "Q5_0": (32, 22), "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
               "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292)}
#: Metadata strings longer than this are skipped, not kept (chat templates are the longest kept).
MAX_KEPT_STRING = 1 << 20
#: ggml's most dimensions per tensor.
MAX_DIMS = 4


class GGUFError(ValueError):
    """A GGUF file that mlxkv cannot load; the message is one line meant for the user."""


@dataclass(slots=True)
class TensorInfo:
    """One entry of the tensor table: ``dims`` in GGUF order (``ne0`` first, the fastest-varying)."""

    name: str
    dims: tuple[int, ...]
    kind: str
    offset: int  # from the start of the data section


@dataclass(slots=True)
class Header:
    """A GGUF header: scalar and string metadata (arrays only counted), the tensor table, and where the tensor data
    starts before alignment padding (``table_end``)."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    table_end: int = 0


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise ValueError("truncated header")
        text = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        """A scalar or a (short) string; anything else is skipped and ``None`` returned."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            n = struct.unpack_from("<Q", self.data, self.pos)[0]
            if n <= MAX_KEPT_STRING:
                return self.string()
        self.skip_value(kind)
        return None

    def skip_value(self, kind: int) -> None:
        if kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            n = self.take("Q")
            self.pos += n
        elif kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
                    if self.pos > len(self.data):
                        break
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        if self.pos > len(self.data):
            raise ValueError("truncated header")


def header_tensor_types(f: BinaryIO) -> dict[str, str]:
    """``{tensor name: ggml type name}`` from an open GGUF file (versions 2 and 3).

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a truncated / malformed header.
    """
    return {t.name: t.kind for t in read_header(f).tensors}


def read_header(f: BinaryIO) -> Header:
    """The :class:`Header` of an open GGUF file (versions 2 and 3), read without any tensor data.

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a truncated / malformed header.
    """
    size = 1 << 20
    while True:
        f.seek(0)
        data = f.read(size)
        try:
            return _parse(data)
        except (struct.error, ValueError):
            if len(data) < size:  # the whole file was read: the header itself is broken
                raise
            size *= 4


def _parse(data: bytes) -> Header:
    c = _Cursor(data)
    if bytes(c.data[:4]) != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    c.pos = 4
    header = Header(version=c.take("I"))
    if header.version not in (2, 3):
        raise ValueError(f"GGUF version {header.version} is not supported (2 and 3 are)")
    tensors, kvs = c.take("Q"), c.take("Q")
    for _ in range(kvs):  # each entry takes at least 12 bytes: a count past the data ends in struct.error
        key = c.string()
        kind = c.take("I")
        if kind == _ARRAY:
            header.array_lengths[key] = struct.unpack_from("<Q", c.data, c.pos + 4)[0]
        value = c.value(kind)
        if value is not None:
            header.metadata[key] = value
    for _ in range(tensors):
        name = c.string()
        dims = c.take("I")
        if dims > MAX_DIMS:
            raise ValueError(f"tensor {name[:64]} has {dims} dimensions (at most {MAX_DIMS})")
        shape = tuple(c.take("Q") for _ in range(dims))
        kind = c.take("I")
        header.tensors.append(TensorInfo(name, shape, GGML_TYPES.get(kind, f"ggml type {kind}"), c.take("Q")))
    if c.pos > len(c.data):
        raise ValueError("truncated header")
    header.table_end = c.pos
    return header
