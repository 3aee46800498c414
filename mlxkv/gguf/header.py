"""The tensor table of a GGUF file, read from its header without loading any tensor data.

llama.cpp's ``gguf`` package parses the same header but decodes every metadata array into numpy objects
(4.3 s for SmolLM2's 49K-token vocabulary and merges on this machine's CPU); this reader only skips over
the metadata, which takes a few milliseconds.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

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


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def take(self, fmt: str) -> int:
        value = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        text = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

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
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        if self.pos > len(self.data):
            raise ValueError("truncated header")


def header_tensor_types(f: BinaryIO) -> dict[str, str]:
    """``{tensor name: ggml type name}`` from an open GGUF file (versions 2 and 3).

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


def _parse(data: bytes) -> dict[str, str]:
    c = _Cursor(data)
    if bytes(c.data[:4]) != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    c.pos = 4
    version = c.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensors, kvs = c.take("Q"), c.take("Q")
    for _ in range(kvs):
        key_length = c.take("Q")
        c.pos += key_length
        c.skip_value(c.take("I"))
    types = {}
    for _ in range(tensors):
        name = c.string()
        dims = c.take("I")
        c.pos += 8 * dims
        kind = c.take("I")
        c.pos += 8  # data offset
        types[name] = GGML_TYPES.get(kind, f"ggml type {kind}")
    if c.pos > len(c.data):
        raise ValueError("truncated header")
    return types
