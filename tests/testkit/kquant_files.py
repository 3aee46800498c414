"""Random-weight test models whose matrices are ggml K-quant blocks, for the GGUF K-quant tests.

The blocks come one of two ways: quantized from the float test model's weights (:mod:`testkit.kquant_quantize`,
laid out as llama.cpp's quantizers lay them out, so adjacent sub-blocks have related scales as in real files), or
from random bytes (codes, packed sub-block scales) with each block's float16 scale chosen to give the matrix the
spread of the float model's own (every bit pattern a decoder may meet). The float weights the blocks stand for are
computed by the ``gguf`` package's reference dequantizer and written as a Hugging Face folder: that folder and the
GGUF file hold the same model, one as mlx-lm reads it and one as llama.cpp writes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

#: Byte offsets of each type's float16 super-block scale ``d`` and, where there is one, ``dmin``; and the mean
#: code a ``dmin`` must offset so the weights centre on zero (E[scale] * E[code] = E[min] * ratio).
_SCALES = {"Q2_K": (80, 82, 1.5), "Q3_K": (108, None, 0), "Q4_K": (0, 2, 7.5), "Q5_K": (0, 2, 15.5),
           "Q6_K": (208, None, 0)}


def random_blocks(kind: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """``(rows, cols / 256 * block bytes)`` uint8: random ``kind`` blocks whose weights have about ``std`` spread."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    per_block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    d_at, dmin_at, ratio = _SCALES[kind]

    def set_scales(d: float) -> None:
        blocks[:, d_at:d_at + 2] = np.array([d], np.float16).view(np.uint8)
        if dmin_at is not None:
            blocks[:, dmin_at:dmin_at + 2] = np.array([d * ratio], np.float16).view(np.uint8)

    set_scales(1.0)
    spread = quants.dequantize(blocks.reshape(rows, -1), qtype).std()
    set_scales(std / spread)
    return blocks.reshape(rows, -1)


def kquant_model(folder: Path, out: Path, types: dict[str, str], seed: int = 0, *,
                 random: bool = False) -> tuple[Path, dict]:
    """Copy the Hugging Face test model in ``folder`` to ``out`` with every matrix named in ``types`` (HF name ->
    ggml block type) replaced by blocks of that type: the matrix quantized, or random blocks of its spread with
    ``random`` (K-quants only); returns ``(out, blocks)`` where ``out`` holds the blocks' float weights (the
    ``gguf`` package's dequantization) and ``blocks`` is what :func:`testkit.gguf_files.write_gguf` takes."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType, quants

    from testkit.kquant_quantize import quantize

    rng = np.random.default_rng(seed)
    shutil.copytree(folder, out)
    weights = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    blocks = {}
    for name, kind in types.items():
        w = weights[name]
        b = random_blocks(kind, w.shape[0], w.shape[1], float(w.std()), rng) if random else quantize(w, kind)
        blocks[name] = (kind, b)
        weights[name] = quants.dequantize(b, GGMLQuantizationType[kind]).astype(np.float32).reshape(w.shape)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    return out, blocks
