"""Reading a GGUF file: its tensors (through MLX's native reader) and its metadata as plain Python values.

MLX reads Q4_0, Q4_1 and Q8_0 tensors as affine-quantized triplets (``name.weight`` packed uint32,
``name.scales`` and ``name.biases``, groups of 32 along the row) and F32 / F16 / BF16 as they are. A file
holding any of the K-quants (or Q5_0 / Q5_1) is read by :mod:`mlxkv.gguf.tensors` instead, which decodes
each block type by its layout into the same triplets (MLX itself would silently dequantize some of them to
float16). Other ggml types (the IQ-quants, ...) are refused with their type named, from the tensor table alone.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxkv.gguf.bounds import check_layout
from mlxkv.gguf.header import GGUFError, Header, read_header

#: ggml tensor types MLX's own reader turns into arrays it can compute with (quantized ones keep their quantization).
NATIVE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
#: Every ggml tensor type mlxkv loads (the others through :mod:`mlxkv.gguf.tensors`).
SUPPORTED_TYPES = (*NATIVE_TYPES, "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


@dataclass
class GGUFFile:
    """The contents of a GGUF file.

    tensors: MLX arrays by GGUF tensor name (quantized tensors as ``.weight`` / ``.scales`` / ``.biases``).
    metadata: every key-value pair, as Python scalars, strings and lists.
    types: the ggml type name of each tensor (``"Q4_1"``, ``"F32"``, ...).
    dims: each tensor's dimensions as the header lists them (GGUF order: ``ne0``, the row length, first).
    """

    path: Path
    tensors: dict[str, Any]
    metadata: dict[str, Any]
    types: dict[str, str]
    dims: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``, ...)."""
        return str(self.metadata.get("general.architecture", ""))


def header(path: Path) -> Header:
    """The file's header (metadata and tensor table), read without any tensor data.

    Raises:
        GGUFError: the file is not a GGUF file, or its header cannot be parsed.
    """
    try:
        with open(path, "rb") as f:
            return read_header(f)
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {first_line(exc)}") from None


def tensor_types(path: Path) -> dict[str, str]:
    """The ggml type name of every tensor in the file, read from its header alone.

    Raises:
        GGUFError: the file is not a GGUF file, or its header cannot be parsed.
    """
    return {t.name: t.kind for t in header(path).tensors}


def check_types(types: dict[str, str], path: Path) -> None:
    """Raise :class:`GGUFError` naming the first tensor whose type MLX cannot represent."""
    for name, kind in types.items():
        if kind not in SUPPORTED_TYPES:
            count = sum(1 for k in types.values() if k == kind)
            raise GGUFError(
                f"{path.name}: tensor {name} is {kind} ({count} of its tensors are); mlxkv loads GGUF tensors "
                f"of types {', '.join(SUPPORTED_TYPES)} only (re-quantize the model to one of them)"
            )


def read(path: str | Path, *, dequantize: bool = False) -> GGUFFile:
    """Read a GGUF file: tensors as MLX arrays, metadata as Python values.

    ``dequantize`` asks for float weights where the block decoder reads the file (K-quants and their mixes), so
    types MLX cannot keep exactly come out exact; MLX's own reader keeps its types quantized regardless (the
    caller dequantizes those, exactly, after loading).

    Raises:
        GGUFError: unreadable file or a tensor type MLX cannot represent.
    """
    import mlx.core as mx

    path = Path(path)
    head = header(path)
    types = {t.name: t.kind for t in head.tensors}
    check_types(types, path)
    try:
        check_layout(head, path.stat().st_size)  # MLX's native reader trusts the header: bounded first
    except GGUFError as exc:
        raise GGUFError(f"{path.name}: {exc}") from None
    dims = {t.name: t.dims for t in head.tensors}
    if any(kind not in NATIVE_TYPES for kind in types.values()):
        from mlxkv.gguf.tensors import read_tensors

        try:
            tensors, metadata = read_tensors(path, head, dequantize=dequantize)
        except (ValueError, OSError, RuntimeError, struct.error) as exc:
            raise GGUFError(f"could not read {path.name}: {first_line(exc)}") from None
        return GGUFFile(path=path, tensors=tensors, metadata=metadata, types=types, dims=dims)
    try:
        tensors, raw_meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise GGUFError(f"MLX could not read {path.name}: {first_line(exc)}") from None
    return GGUFFile(path=path, tensors=tensors, metadata={k: _plain(v) for k, v in raw_meta.items()}, types=types,
                    dims=dims)


def _plain(value: Any) -> Any:
    """A metadata value as Python: MLX scalars become int/float/bool, arrays become lists."""
    if isinstance(value, (str, list)):
        return value
    if value.ndim == 0:
        return value.item()
    return value.tolist()


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when empty): what a one-line error quotes."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
