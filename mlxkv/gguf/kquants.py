"""ggml's block-quantized tensor types decoded by their block layout, and rewritten as MLX affine quantization.

Every type here stores, per sub-block of ``width`` consecutive weights of a row, unsigned integer codes ``q`` and
a weight ``w = scale * q + bias`` (ggml's signed codes and subtracted minimums are folded into ``bias``). That is
MLX's affine quantization when the sub-block is one of MLX's groups:

======  =====  ============================  ========================================================
type    width  codes                          as MLX affine (``mx.quantize`` bits / group size)
======  =====  ============================  ========================================================
Q4_0    32     4-bit, ``d * (q - 8)``         4 / 32, exact
Q4_1    32     4-bit, ``d * q + m``           4 / 32, exact
Q5_0    32     5-bit, ``d * (q - 16)``        5 / 32, exact
Q5_1    32     5-bit, ``d * q + m``           5 / 32, exact
Q8_0    32     8-bit signed, ``d * q``        8 / 32, exact
Q4_K    32     4-bit, 6-bit scale and min     4 / 32, exact
Q5_K    32     5-bit, 6-bit scale and min     5 / 32, exact
Q8_K    256    8-bit signed, float32 ``d``    8 / 32, the scale repeated (one float32 rounding)
Q3_K    16     3-bit, 6-bit signed scale      8 / 32, exact: codes ``(sc - 32) * (q - 4)`` of the block's ``d``
Q6_K    16     6-bit, 8-bit signed scale      float by default; 8 / 32 re-quantized on request (see below)
Q2_K    16     2-bit, 4-bit scale and min     float by default; 8 / 32 re-quantized on request
======  =====  ============================  ========================================================

"Exact" means the codes are kept and the scale and bias computed in float32 (products of a float16 and small
integers, so float32 holds them without rounding; Q8_K's scale is already float32, so ``scale * code + bias``
may round, by at most 2^-15 of that scale). Off the CPU backend they are stored as float16, as MLX's own GGUF
reader stores Q4_0's, and round to 11 significant bits there.

MLX has no group of 16, so two 16-weight sub-blocks share one MLX group. Q3_K's sub-blocks are small signed
integers ``sc - 32`` (6 bits) of one super-block scale ``d`` times 3-bit codes ``q - 4``, so every weight is
``d`` times an integer in [-124, 128]: 8-bit codes over groups of 32 with scale ``d`` and bias ``-124 d`` hold them
exactly (:func:`grid_affine`). Q6_K's integers ``sc * (q - 32)`` span 13 bits and Q2_K's two sub-blocks have
unrelated minimums, so no MLX form keeps them: by default they are decoded to float (float32 on the CPU backend,
exactly; float16 elsewhere), and with ``MLXKV_GGUF_REQUANTIZE=1`` quantized again at 8 bits in groups of 32 by
each group's range (:func:`requantize`, about half the memory of float16). Each weight then moves by at most half
an 8-bit step of its group's range, for Q6_K at most 32/255 (~1/8) of the larger of its two sub-blocks' steps (a
group spans at most 64 of them), for Q2_K more as the two sub-blocks' minimums differ (at most 0.052 of that step
on random blocks). Measured on blocks quantized from float weights as llama.cpp lays them out
(``tests/test_gguf_kquants.py``): RMS 0.45% of the weights' RMS for Q6_K, about a quarter of Q6_K's own error
against the float weights it came from, and enough to change greedy tokens: SmolLM2-135M with its 30 ffn_down
matrices as Q6_K left the float Q6_K weights' greedy path within 7 tokens on 3 of 6 chat prompts (64 tokens),
float16-rounded weights on none.

Decoding is vectorised over all blocks of a tensor (numpy), never a Python loop per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256

#: ggml block types mlxkv decodes -> (weights per block, bytes per block).
BLOCKS = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
    "Q8_K": (QK_K, 292),
}

#: MLX's affine group size every converted tensor uses.
GROUP_SIZE = 32
#: Types whose 16-weight sub-blocks no MLX form holds exactly: float by default, or re-quantized ...
REQUANTIZED = ("Q2_K", "Q6_K")
#: ... at this many bits (``MLXKV_GGUF_REQUANTIZE``). Q3_K, also 16 wide, is held exactly at this width too.
REQUANTIZED_BITS = 8


@dataclass
class Codes:
    """A decoded block-quantized matrix: ``w[r, c] = scale[r, c // width] * q[r, c] + bias[r, c // width]``."""

    q: np.ndarray  # (rows, cols) uint8
    scale: np.ndarray  # (rows, cols // width) float32
    bias: np.ndarray  # (rows, cols // width) float32
    bits: int
    width: int
    #: Q3_K: ``(d, steps)``, the super-block scale (rows, cols // 256) float32 and each sub-block's scale in units
    #: of it (rows, cols // width) int16, so ``w = d * steps * (q - 4)``; None for the other types.
    grid: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def exact_in_affine(self) -> bool:
        """Whether :func:`affine` keeps these weights exactly (it re-quantizes the others)."""
        return self.width >= GROUP_SIZE or self.grid is not None

    def dequantize(self) -> np.ndarray:
        """The float32 weights (exact: every product fits float32's 24-bit significand)."""
        rows, cols = self.q.shape
        q = self.q.reshape(rows, -1, self.width).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            return (q * self.scale[..., None] + self.bias[..., None]).reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes (trailing axis of 2) as float32 with that axis dropped."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _bits_of(raw: np.ndarray, n: int) -> np.ndarray:
    """Split each byte of ``raw`` into ``n``-bit fields, lowest first: shape ``(..., bytes, 8 // n)``."""
    shifts = np.arange(0, 8, n, dtype=np.uint8)
    return (raw[..., None] >> shifts) & np.uint8((1 << n) - 1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit scales and mins from their 12 packed bytes: bytes 0-3 hold scales 0-3 (low 6 bits)
    and the top bits of scales 4-7, bytes 4-7 the same for mins, bytes 8-11 the low nibbles of scales / mins 4-7."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return scale.astype(np.float32), mins.astype(np.float32)


def decode(kind: str, raw: np.ndarray, rows: int, cols: int) -> Codes:
    """Decode a ``(rows, cols)`` tensor of ggml type ``kind`` from its raw bytes (``rows * cols / per_block``
    blocks in row-major order).

    Raises:
        KeyError: a type not in :data:`BLOCKS`.
    """
    per_block, size = BLOCKS[kind]
    n = rows * cols // per_block
    b = np.asarray(raw, dtype=np.uint8).reshape(n, size)
    with np.errstate(invalid="ignore", over="ignore"):  # a file's NaN / infinite scales stay what the file says
        q, scale, bias, bits, width, *grid = _DECODERS[kind](b, n)
    if grid:
        d, steps = grid[0]
        grid = (d.reshape(rows, -1), steps.reshape(rows, -1))
    return Codes(q=q.reshape(rows, cols), scale=scale.reshape(rows, -1), bias=bias.reshape(rows, -1), bits=bits,
                 width=width, grid=grid or None)


def _q4_0(b: np.ndarray, n: int):
    d = _f16(b[:, 0:2].reshape(n, 1, 2))
    q = _bits_of(b[:, 2:18], 4).transpose(0, 2, 1).reshape(n, 32)  # low nibbles are weights 0-15
    return q, d, -8 * d, 4, 32


def _q4_1(b: np.ndarray, n: int):
    d, m = _f16(b[:, 0:2].reshape(n, 1, 2)), _f16(b[:, 2:4].reshape(n, 1, 2))
    q = _bits_of(b[:, 4:20], 4).transpose(0, 2, 1).reshape(n, 32)
    return q, d, m, 4, 32


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Q5_0 / Q5_1's 32 fifth bits, one per weight, from their little-endian 4 bytes."""
    return np.unpackbits(qh, axis=1, bitorder="little").reshape(n, 32)


def _q5_0(b: np.ndarray, n: int):
    d = _f16(b[:, 0:2].reshape(n, 1, 2))
    q = _bits_of(b[:, 6:22], 4).transpose(0, 2, 1).reshape(n, 32) | (_high_bits(b[:, 2:6], n) << 4)
    return q, d, -16 * d, 5, 32


def _q5_1(b: np.ndarray, n: int):
    d, m = _f16(b[:, 0:2].reshape(n, 1, 2)), _f16(b[:, 2:4].reshape(n, 1, 2))
    q = _bits_of(b[:, 8:24], 4).transpose(0, 2, 1).reshape(n, 32) | (_high_bits(b[:, 4:8], n) << 4)
    return q, d, m, 5, 32


def _q8_0(b: np.ndarray, n: int):
    d = _f16(b[:, 0:2].reshape(n, 1, 2))
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d, 8, 32


def _q2_k(b: np.ndarray, n: int):
    # scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82].reshape(n, 1, 2)), _f16(b[:, 82:84].reshape(n, 1, 2))
    # each half of 128 weights: 32 bytes, whose four 2-bit fields are four runs of 32 weights
    q = _bits_of(b[:, 16:80].reshape(n, 2, 32), 2).transpose(0, 1, 3, 2).reshape(n, QK_K)
    return q, d * (sc & 0x0F), -dmin * (sc >> 4), 2, 16


def _q3_k(b: np.ndarray, n: int):
    # hmask[32] | qs[64] | scales[12] | d
    d = _f16(b[:, 108:110].reshape(n, 1, 2))
    low = _bits_of(b[:, 32:96].reshape(n, 2, 32), 2).transpose(0, 1, 3, 2).reshape(n, QK_K)
    high = np.unpackbits(b[:, 0:32], axis=1, bitorder="little").reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, QK_K)
    packed = b[:, 96:108]
    lo = _bits_of(packed[:, 0:8], 4).transpose(0, 2, 1).reshape(n, 16)  # scales 0-7 low nibbles, then 8-15
    hi = _bits_of(packed[:, 8:12], 2).transpose(0, 2, 1).reshape(n, 16)
    steps = (lo | (hi << 4)).astype(np.int16) - 32
    scale = d * steps.astype(np.float32)
    # the stored high bit set means no offset: code = low + 4 * high, weight = scale * (code - 4)
    return low | (high << 2), scale, -4 * scale, 3, 16, (d, steps)


def _q4_k(b: np.ndarray, n: int):
    # d | dmin | scales[12] | qs[128]
    d, dmin = _f16(b[:, 0:2].reshape(n, 1, 2)), _f16(b[:, 2:4].reshape(n, 1, 2))
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _bits_of(b[:, 16:144].reshape(n, 4, 32), 4).transpose(0, 1, 3, 2).reshape(n, QK_K)
    return q, d * sc, -dmin * mn, 4, 32


def _q5_k(b: np.ndarray, n: int):
    # d | dmin | scales[12] | qh[32] | qs[128]
    d, dmin = _f16(b[:, 0:2].reshape(n, 1, 2)), _f16(b[:, 2:4].reshape(n, 1, 2))
    sc, mn = _k_scale_min(b[:, 4:16])
    low = _bits_of(b[:, 48:176].reshape(n, 4, 32), 4).transpose(0, 1, 3, 2).reshape(n, QK_K)
    high = np.unpackbits(b[:, 16:48], axis=1, bitorder="little").reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, QK_K)
    return low | (high << 4), d * sc, -dmin * mn, 5, 32


def _q6_k(b: np.ndarray, n: int):
    # ql[128] | qh[64] | scales[16] int8 | d
    d = _f16(b[:, 208:210].reshape(n, 1, 2))
    # each half of 128 weights: 64 low-nibble bytes (two runs of 64 weights) and 32 high-bit bytes (four runs of 32)
    low = _bits_of(b[:, 0:128].reshape(n, 2, 64), 4).transpose(0, 1, 3, 2).reshape(n, 2, 128)
    high = _bits_of(b[:, 128:192].reshape(n, 2, 32), 2).transpose(0, 1, 3, 2).reshape(n, 2, 128)
    scale = d * b[:, 192:208].view(np.int8).astype(np.float32)
    return (low | (high << 4)).reshape(n, QK_K), scale, -32 * scale, 6, 16


def _q8_k(b: np.ndarray, n: int):
    # d float32 | qs[256] int8 | bsums[16] int16 (sums for ggml's dot products; not needed to decode)
    d = np.ascontiguousarray(b[:, 0:4]).view(np.float32)  # (n, 1)
    q = (b[:, 4:260].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d, 8, QK_K


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
             "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q8_K": _q8_k}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing of ``bits``-wide codes along the last axis: one little-endian bit stream per row, read as
    uint32 words (so 3-, 5- and 6-bit codes straddle words exactly as ``mx.quantize`` writes them).

    Eight codes fill ``bits`` whole bytes, so each run of eight is gathered into one uint64 and its low ``bits``
    bytes kept."""
    rows, cols = q.shape
    runs = q.reshape(rows, cols // 8, 8)
    acc = runs[..., 0].astype(np.uint64)
    for k in range(1, 8):
        acc |= runs[..., k].astype(np.uint64) << np.uint64(bits * k)
    stream = acc[..., None].view(np.uint8)[..., :bits] if bits < 8 else acc[..., None].view(np.uint8)
    return np.ascontiguousarray(stream).reshape(rows, cols * bits // 8).view(np.uint32)


def affine(codes: Codes) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(packed uint32, scales, biases, bits)`` in MLX's affine form with groups of :data:`GROUP_SIZE`, float32
    scales and biases.

    Sub-blocks of 32 keep their codes; wider ones repeat their scale; narrower ones (16) become 8-bit codes of
    their super-block scale where they are its small integers (Q3_K, exact), else are dequantized and quantized
    again at 8 bits (see the module docstring for the error).
    """
    if codes.width < GROUP_SIZE:
        if codes.grid is not None:
            return grid_affine(codes)
        return requantize(dequantized(codes), REQUANTIZED_BITS)
    repeat = codes.width // GROUP_SIZE
    scale, bias = codes.scale, codes.bias
    if repeat > 1:
        scale, bias = np.repeat(scale, repeat, axis=1), np.repeat(bias, repeat, axis=1)
    return pack(codes.q, codes.bits), scale, bias, codes.bits


#: Q3_K's weights in units of ``d``: ``(sc - 32) * (q - 4)`` with ``sc - 32`` in [-32, 31] and ``q - 4`` in [-4, 3]
#: lie in [-124, 128], so 8-bit codes offset by 124 hold them.
_GRID_OFFSET = 124


def grid_affine(codes: Codes) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The exact 8-bit affine form of a type whose weights are integers of its super-block scale (Q3_K):
    ``w = d * (code - 124)`` with ``code = steps * (q - 4) + 124``; scale ``d``, bias ``-124 d`` per group of 32
    (``d * code`` and its sum with the bias are exact in float32: an 11-bit significand times 8 bits)."""
    d, steps = codes.grid
    rows, cols = codes.q.shape
    q = codes.q.reshape(rows, -1, codes.width).astype(np.int16) - 4  # (rows, sub-blocks, 16)
    code = (steps[..., None] * q + _GRID_OFFSET).astype(np.uint8).reshape(rows, cols)
    scale = np.repeat(d, cols // d.shape[1] // GROUP_SIZE, axis=1)  # (rows, cols // 32)
    with np.errstate(invalid="ignore", over="ignore"):
        return pack(code, REQUANTIZED_BITS), scale, -_GRID_OFFSET * scale, REQUANTIZED_BITS


def dequantized(codes: Codes) -> "mx.array":
    """:meth:`Codes.dequantize` computed by MLX (the same float32 products, about twice numpy's speed here)."""
    import mlx.core as mx

    rows, cols = codes.q.shape
    q = mx.array(codes.q).reshape(rows, -1, codes.width).astype(mx.float32)
    return (q * mx.array(codes.scale)[..., None] + mx.array(codes.bias)[..., None]).reshape(rows, cols)


def requantize(w: "mx.array", bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """MLX affine form of float32 weights by each group's minimum and maximum: ``scale = (max - min) / (2^bits - 1)``,
    ``bias = min``, codes rounded to nearest, so no weight moves by more than half a step of its group's range.
    (``mx.quantize`` also snaps zero onto the grid, which can double that.)"""
    import mlx.core as mx

    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low, high = g.min(-1), g.max(-1)
    scale = (high - low) / ((1 << bits) - 1)
    safe = mx.where(scale > 0, scale, 1)  # a constant group: every code 0, the weight is the bias
    q = mx.clip(mx.round((g - low[..., None]) / safe[..., None]), 0, (1 << bits) - 1)
    q = mx.where(mx.isnan(q), 0, q).astype(mx.uint8)  # NaN weights in the file: code 0 (its NaN bias stays)
    mx.eval(q, scale, low)
    return pack(np.array(q).reshape(rows, cols), bits), np.array(scale), np.array(low), bits
