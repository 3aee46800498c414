"""ggml K-quant blocks quantized from float weights, the way llama.cpp's reference quantizers lay them out.

llama.cpp's ``gguf`` package dequantizes K-quants but cannot quantize them. These quantizers follow llama.cpp's
``quantize_row_qN_K_ref`` without its least-squares search: each sub-block's scale (and minimum) comes from its
own weights by round-to-nearest, the super-block's float16 ``d`` (and ``dmin``) from the largest of them, and the
sub-block scales are stored as small integers of ``d``. So adjacent sub-blocks have related scales, as in files
people download (random bytes do not). Vectorised over all blocks of a matrix.

Each function takes ``(rows, cols)`` float32 weights, ``cols`` a multiple of 256, and returns
``(rows, cols / 256 * block bytes)`` uint8: one row of blocks per weight row, as
:func:`testkit.gguf_files.write_gguf` takes them.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _blocks(w: np.ndarray, width: int) -> np.ndarray:
    """``(blocks, 256 / width, width)`` float32 sub-blocks of a ``(rows, cols)`` matrix."""
    return np.asarray(w, np.float32).reshape(-1, QK_K // width, width)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, with its sign."""
    at = np.abs(x).argmax(-1)[..., None]
    return np.take_along_axis(x, at, -1)[..., 0]


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(float32 value as stored, its two little-endian bytes)`` of float16-rounded ``x`` (shape ``(n,)``)."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(-1, 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


def _codes(x: np.ndarray, step: np.ndarray, offset: np.ndarray, low: int, high: int) -> np.ndarray:
    """``clip(round((x + offset) / step), low, high)`` per sub-block (step 0: code ``max(low, 0)``)."""
    q = np.rint(_safe_div(x + offset[..., None], step[..., None]))
    return np.clip(np.where(step[..., None] != 0, q, max(low, 0)), low, high).astype(np.int16)


def _fields(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``8 / bits`` runs (axis -2) into the bit fields of one byte run (lowest field first)."""
    out = np.zeros(q.shape[:-2] + q.shape[-1:], np.uint8)
    for k in range(q.shape[-2]):
        out |= (q[..., k, :].astype(np.uint8) << (bits * k)).astype(np.uint8)
    return out


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16, ``w = d * sc * (q - 32)`` with 6-bit ``q`` and int8 ``sc``."""
    x = _blocks(w, 16)
    n = x.shape[0]
    sub = -_signed_absmax(x) / 32  # (n, 16): the largest weight maps to code -32
    top = _signed_absmax(sub)  # (n,)
    iscale = _safe_div(np.float32(-128), top)
    d, d_bytes = _f16(_safe_div(np.float32(1), iscale))
    sc = np.minimum(127, np.rint(iscale[:, None] * sub)).astype(np.int8)
    q = (_codes(x, d[:, None] * sc, np.zeros_like(sub), -32, 31) + 32).reshape(n, 2, 4, 32)  # halves, runs of 32
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | lo[:, :, 2] << 4, lo[:, :, 1] | lo[:, :, 3] << 4], -1).astype(np.uint8)
    qh = _fields(hi, 2)  # (n, 2, 32)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes], 1).reshape(
        w.shape[0], -1)


def _k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes holding eight 6-bit scales and mins."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    a = ls[:, :4] | (ls[:, 4:] >> 4) << 6
    b = lm[:, :4] | (lm[:, 4:] >> 4) << 6
    c = (ls[:, 4:] & 0xF) | (lm[:, 4:] & 0xF) << 4
    return np.concatenate([a, b, c], 1).astype(np.uint8)


def _min_max_scales(x: np.ndarray, levels: int, scale_levels: int):
    """Per sub-block ``(step, minimum)`` from its range (the minimum at most 0, stored negated), as integers of the
    block's float16 ``d`` and ``dmin``: ``(ls, lm, d, d bytes, dmin, dmin bytes)``."""
    low = np.minimum(x.min(-1), 0)
    step, neg_min = (x.max(-1) - low) / levels, -low  # (n, subs)
    top_step, top_min = step.max(-1), neg_min.max(-1)
    ls = np.minimum(scale_levels, np.rint(_safe_div(scale_levels * step, top_step[:, None])))
    lm = np.minimum(scale_levels, np.rint(_safe_div(scale_levels * neg_min, top_min[:, None])))
    d, d_bytes = _f16(top_step / scale_levels)
    dmin, dmin_bytes = _f16(top_min / scale_levels)
    return ls, lm, d, d_bytes, dmin, dmin_bytes


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K: 8 sub-blocks of 32, ``w = d * sc * q - dmin * m`` with 4-bit ``q`` and 6-bit ``sc``, ``m``."""
    x = _blocks(w, 32)
    n = x.shape[0]
    ls, lm, d, d_bytes, dmin, dmin_bytes = _min_max_scales(x, 15, 63)
    q = _codes(x, d[:, None] * ls, dmin[:, None] * lm, 0, 15).reshape(n, 4, 2, 32)  # chunks of 64: two runs
    qs = (q[:, :, 0] | q[:, :, 1] << 4).astype(np.uint8)
    return np.concatenate([d_bytes, dmin_bytes, _k_scales(ls, lm), qs.reshape(n, 128)], 1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Q5_K: as Q4_K with 5-bit ``q`` (the fifth bits in their own 32 bytes)."""
    x = _blocks(w, 32)
    n = x.shape[0]
    ls, lm, d, d_bytes, dmin, dmin_bytes = _min_max_scales(x, 31, 63)
    q = _codes(x, d[:, None] * ls, dmin[:, None] * lm, 0, 31)  # (n, 8, 32)
    qs = ((q[:, 0::2] & 0xF) | (q[:, 1::2] & 0xF) << 4).astype(np.uint8)  # (n, 4, 32)
    qh = _fields(q >> 4, 1)  # bit j of byte l: weight 32 j + l
    return np.concatenate([d_bytes, dmin_bytes, _k_scales(ls, lm), qh, qs.reshape(n, 128)], 1).reshape(
        w.shape[0], -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """Q3_K: 16 sub-blocks of 16, ``w = d * (sc - 32) * (q - 4)`` with 3-bit ``q`` and 6-bit ``sc``."""
    x = _blocks(w, 16)
    n = x.shape[0]
    sub = -_signed_absmax(x) / 4
    top = _signed_absmax(sub)
    iscale = _safe_div(np.float32(-32), top)
    d, d_bytes = _f16(_safe_div(np.float32(1), iscale))
    sc = (np.clip(np.rint(iscale[:, None] * sub), -32, 31) + 32).astype(np.uint8)  # (n, 16)
    q = _codes(x, d[:, None] * (sc.astype(np.float32) - 32), np.zeros_like(sub), -4, 3) + 4  # (n, 16, 16), 0..7
    q = q.reshape(n, QK_K)
    hmask = _fields((q >> 2).reshape(n, 8, 32), 1)  # bit j of byte l: weight 32 j + l
    qs = _fields((q & 3).reshape(n, 2, 4, 32), 2)  # (n, 2, 32)
    packed = np.concatenate([(sc[:, :8] & 0xF) | (sc[:, 8:] & 0xF) << 4, _fields((sc >> 4).reshape(n, 4, 4), 2)], 1)
    return np.concatenate([hmask, qs.reshape(n, 64), packed.astype(np.uint8), d_bytes], 1).reshape(w.shape[0], -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16, ``w = d * sc * q - dmin * m`` with 2-bit ``q`` and 4-bit ``sc``, ``m``."""
    x = _blocks(w, 16)
    n = x.shape[0]
    ls, lm, d, d_bytes, dmin, dmin_bytes = _min_max_scales(x, 3, 15)
    q = _codes(x, d[:, None] * ls, dmin[:, None] * lm, 0, 3).reshape(n, 2, 4, 32)
    qs = _fields(q, 2)  # (n, 2, 32)
    scales = (ls.astype(np.uint8) | lm.astype(np.uint8) << 4).astype(np.uint8)
    return np.concatenate([scales, qs.reshape(n, 64), d_bytes, dmin_bytes], 1).reshape(w.shape[0], -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
              "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """``w`` as rows of ``kind`` blocks: the K-quants here, the other ggml types by the ``gguf`` package."""
    if kind in QUANTIZERS:
        return QUANTIZERS[kind](w)
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(np.asarray(w, np.float32), GGMLQuantizationType[kind])
