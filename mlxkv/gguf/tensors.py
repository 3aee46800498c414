"""A GGUF file's tensors read from their bytes by block layout (numpy), for files MLX's own reader cannot keep
quantized: the K-quants (and Q5_0 / Q5_1, which the K-quant mixes use for rows not a multiple of 256).

Quantized tensors become MLX affine triplets (``name.weight`` packed uint32, ``name.scales``, ``name.biases``;
groups of 32) as :func:`mlxkv.gguf.kquants.affine` writes them where that form holds them exactly, or float weights
(Q6_K and Q2_K unless ``MLXKV_GGUF_REQUANTIZE`` is set; every type when ``dequantize`` is set); F32 / F16 / BF16
tensors are read as they are.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from mlxkv.gguf.bounds import alignment
from mlxkv.gguf.header import Header
from mlxkv.gguf.kquants import BLOCKS, affine, decode, dequantized
from mlxkv.gguf.metadata import read_metadata

#: Float types read as they are -> (numpy dtype of a stored element, bytes per element).
FLOATS = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}


def scale_dtype() -> Any:
    """The dtype of converted scales and biases: float32 on the CPU backend (exact, and the dtype mlxkv runs
    there, see :func:`mlxkv.precision.upcast_on_cpu`), float16 elsewhere (what MLX's own GGUF reader stores)."""
    import mlx.core as mx

    from mlxkv.env import flags

    return mx.float32 if mx.default_device() == mx.cpu and not flags().cpu_keep_dtype else mx.float16


def read_tensors(path: Path, head: Header, *, dequantize: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, metadata)`` of the GGUF file at ``path`` whose checked header is ``head``.

    Quantized tensors become affine triplets, or float32 weights (float16 off the CPU backend) with ``dequantize``
    and for the types no MLX affine form holds exactly (unless ``MLXKV_GGUF_REQUANTIZE`` asks for 8 bits).
    """
    import mlx.core as mx

    from mlxkv.env import flags

    data = np.memmap(path, dtype=np.uint8, mode="r")
    start = -(-head.table_end // alignment(head)) * alignment(head)
    dtype = scale_dtype()
    requantize = flags().gguf_requantize
    tensors: dict[str, Any] = {}
    for t in head.tensors:
        shape = tuple(reversed(t.dims))  # GGUF lists ne0 (the row length) first
        offset = start + t.offset
        if t.kind in FLOATS:
            stored, size = FLOATS[t.kind]
            count = math.prod(shape)
            a = mx.array(np.frombuffer(data, stored, count, offset).reshape(shape))
            tensors[t.name] = a.view(mx.bfloat16) if t.kind == "BF16" else a
            continue
        per_block, size = BLOCKS[t.kind]
        cols, rows = t.dims[0], math.prod(t.dims[1:])
        raw = data[offset:offset + rows * cols // per_block * size]
        codes = decode(t.kind, raw, rows, cols)
        if dequantize or not (codes.exact_in_affine or requantize):
            tensors[t.name] = dequantized(codes).reshape(shape).astype(mx.float32 if dtype == mx.float32 else mx.float16)
            mx.eval(tensors[t.name])  # one tensor's codes at a time, not the whole file's
            continue
        w, scales, biases, _ = affine(codes)
        lead = shape[:-1]
        tensors[t.name] = mx.array(w.reshape(*lead, -1))
        base = t.name.removesuffix(".weight")
        tensors[f"{base}.scales"] = mx.array(scales.reshape(*lead, -1)).astype(dtype)
        tensors[f"{base}.biases"] = mx.array(biases.reshape(*lead, -1)).astype(dtype)
        mx.eval(tensors[f"{base}.scales"], tensors[f"{base}.biases"])  # frees this tensor's float32 temporaries now
    mx.eval(list(tensors.values()))  # materialised on this thread: a lazy graph is bound to its thread's stream
    return tensors, read_metadata(memoryview(data))
