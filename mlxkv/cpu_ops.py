"""Cheaper CPU forms of the operations mlx-lm's models run: RoPE from a table, RMSNorm compiled, causal
attention by query blocks.

On the CPU backend ``mx.fast.rope`` and ``mx.fast.rms_norm`` run MLX's fallback graphs: RoPE recomputes its
frequencies, positions, cosines and sines at every call (~20 graph operations), RMSNorm is ~11 operations, and a
decode step of a small model is mostly per-operation overhead (SmolLM2-135M: ~4,070 operations per token, ~1,000
of them in these two). Here RoPE reads cosines and sines from a table computed once with the fallback's own
arithmetic, and RMSNorm's elementwise parts are fused by ``mx.compile``; both give results bit-equal to MLX's,
which :func:`install_cpu_ops` checks on the model's own shapes before swapping any module in (a mismatch keeps
MLX's). GPUs keep MLX's fused kernels: nothing is installed there, nor with ``MLXKV_CPU_OPS=0``.

Causal attention over a long prompt chunk (:func:`causal_attention`) is the one path here that is not bit-equal
to MLX's: MLX's CPU ``scaled_dot_product_attention`` computes the softmax of every query over every key, masked
half included, and its exponentials (~20-30 ns an element on this backend) are most of a prefill; split by query
blocks, each block attends only the keys up to its last query, which skips the masked triangle. Each output row is
the same softmax over the same visible keys; the sums round differently (outputs agree to ~1e-6).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

log = logging.getLogger("mlxkv.cpu_ops")

#: Positions the RoPE table covers at first; it grows (doubling) when a single sequence goes past it.
TABLE_POSITIONS = 8192
#: The largest table built up front (a declared context of billions of tokens must not size an allocation).
MAX_INITIAL_POSITIONS = 1 << 17


class TableRoPE(nn.RoPE):
    """``nn.RoPE`` reading its cosines and sines from a table (positions x dims/2, float32).

    The table comes from ``mx.fast.rope`` itself, rotating ``[1, ..., 1, 0, ..., 0]`` at positions ``0..N-1``
    (its outputs are then exactly the cosines and sines it computes for those positions), so every output equals
    ``mx.fast.rope``'s bit for bit. Per-sequence
    offsets (an array, as batched decode passes) index the table directly, so they must stay below its length:
    the engines cap every sequence at the model's context length, which the table covers.
    """

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000, scale: float = 1.0,
                 positions: int = TABLE_POSITIONS):
        super().__init__(dims, traditional=traditional, base=base, scale=scale)
        self._build(positions)

    def _build(self, positions: int) -> None:
        half = self.dims // 2
        unit = mx.concatenate([mx.ones((half,)), mx.zeros((half,))])  # (dims,): x1 = 1, x2 = 0
        rotated = mx.fast.rope(mx.broadcast_to(unit, (1, 1, positions, self.dims)), self.dims, traditional=False,
                               base=self.base, scale=self.scale, offset=0)[0, 0]  # (positions, dims)
        self._cos, self._sin = rotated[:, :half], rotated[:, half:]  # x1*cos - x2*sin, x1*sin + x2*cos
        mx.eval(self._cos, self._sin)
        self._positions = positions

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if x.ndim != 4 or x.shape[-1] != self.dims:
            return super().__call__(x, offset)  # partial rotations and odd ranks: MLX's own path
        length = x.shape[2]
        if isinstance(offset, int):
            if offset + length > self._positions:
                self._build(max(2 * self._positions, offset + length))
            cos, sin = self._cos[offset:offset + length], self._sin[offset:offset + length]  # (L, half)
        else:  # (B,) offsets: rows b of the batch at positions offset[b] + i
            rows = offset.reshape(-1, 1) + mx.arange(length)  # (B, L)
            cos, sin = self._cos[rows][:, None], self._sin[rows][:, None]  # (B, 1, L, half)
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        half = self.dims // 2
        if self.traditional:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, H, L, half) each
            out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)  # (B, H, L, half, 2)
            return out.reshape(x.shape)
        x1, x2 = x[..., :half], x[..., half:]
        return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)  # (B, H, L, dims)


#: Query rows per block of :func:`causal_attention`; queries fewer than twice this run in one call.
CAUSAL_BLOCK = 64


def causal_attention_blocked(queries: mx.array) -> bool:
    """Whether :func:`causal_attention` splits these ``(B, n_q, L, D)`` queries: on the CPU, ``L`` of at least
    two blocks, unless ``MLXKV_CPU_OPS=0``."""
    from mlxkv.env import flags

    return queries.shape[2] >= 2 * CAUSAL_BLOCK and mx.default_device() == mx.cpu and flags().cpu_ops


def causal_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     sinks: mx.array | None = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(..., mask="causal")`` one block of query rows at a time.

    Args:
        queries: ``(B, n_q, L, D)``, the last ``L`` positions of the ``K`` keys (the causal mask's alignment).
        keys, values: ``(B, n_kv, K, D)``.
        sinks: optional per-query-head sink logits ``(n_q,)``.

    Returns:
        ``(B, n_q, L, D_v)``; block ``[a, b)`` attends keys ``[0, K - L + b)`` with the causal mask, which gives
        its rows exactly the keys the whole call would leave visible to them.
    """
    length, offset = queries.shape[2], keys.shape[2] - queries.shape[2]
    outs = []
    for start in range(0, length, CAUSAL_BLOCK):
        end = min(start + CAUSAL_BLOCK, length)
        visible = offset + end
        outs.append(mx.fast.scaled_dot_product_attention(
            queries[:, :, start:end], keys[:, :, :visible], values[:, :, :visible], scale=scale, mask="causal",
            sinks=sinks))  # (B, n_q, end - start, D_v)
    return mx.concatenate(outs, axis=2)  # (B, n_q, L, D_v)


def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    """MLX's RMSNorm fallback, operation for operation (float32 accumulation, then the input's dtype)."""
    x32 = x.astype(mx.float32)
    normed = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


_compiled_rms_norm = mx.compile(_rms_norm, shapeless=True)


class CompiledRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` through one compiled function (its elementwise operations fused)."""

    def __call__(self, x: mx.array) -> mx.array:
        return _compiled_rms_norm(x, self["weight"], mx.array(self.eps, mx.float32))


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def _rope_matches(orig: nn.RoPE, table: TableRoPE, heads: int) -> bool:
    """Bit equality with MLX's RoPE on queries of this model's width, at a few offsets (int and per-sequence)."""
    x = mx.random.normal((2, heads, 5, orig.dims), key=mx.random.key(7))
    for offset in (0, 1, 300, 4095):
        if not _equal(table(x, offset), orig(x, offset)):
            return False
    offsets = mx.array([3, 2048], dtype=mx.int32)
    return _equal(table(x, offsets), orig(x, offsets))


def _norm_matches(orig: nn.RMSNorm, compiled: CompiledRMSNorm) -> bool:
    dims = orig["weight"].shape[0]
    x = mx.random.normal((3, 7, dims), key=mx.random.key(11)).astype(orig["weight"].dtype)
    return _equal(compiled(x), orig(x)) and _equal(compiled(x[:, :1]), orig(x[:, :1]))


def install_cpu_ops(model: Any, context_length: int | None = None) -> list[str]:
    """On the CPU backend, swap the model's ``nn.RoPE`` and ``nn.RMSNorm`` modules for :class:`TableRoPE` and
    :class:`CompiledRMSNorm` where each is bit-equal to the original on this model's shapes; returns the names of
    the modules swapped (none on a GPU). ``context_length`` sizes the RoPE table (at least
    :data:`TABLE_POSITIONS`). ``MLXKV_CPU_OPS=0`` keeps MLX's modules."""
    from mlxkv.env import flags

    if mx.default_device() != mx.cpu or not flags().cpu_ops:
        return []
    positions = max(TABLE_POSITIONS, min(context_length or 0, MAX_INITIAL_POSITIONS))  # grows on demand past it
    swaps, checked = [], {}
    heads = getattr(getattr(model, "args", None), "num_attention_heads", 8)
    for name, module in model.named_modules():
        if type(module) is nn.RoPE:
            key = ("rope", module.dims, module.traditional, module.base, module.scale)
            if key not in checked:
                table = TableRoPE(module.dims, module.traditional, module.base, module.scale, positions)
                checked[key] = table if _rope_matches(module, table, heads) else None
            if checked[key] is not None:
                swaps.append((name, checked[key]))
        elif type(module) is nn.RMSNorm:
            compiled = CompiledRMSNorm(module["weight"].shape[0], eps=module.eps)
            compiled.update({"weight": module["weight"]})
            key = ("norm", module["weight"].dtype, module.eps)
            if key not in checked:
                checked[key] = _norm_matches(module, compiled)
            if checked[key]:
                swaps.append((name, compiled))
    failed = [k for k, v in checked.items() if v is None or v is False]
    if failed:
        log.warning("CPU fast paths differ from MLX's for %s; keeping MLX's there", failed)
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return [name for name, _ in swaps]
