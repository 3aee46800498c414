"""Metal factory for paged decode attention over quantized pages.

The kernel is the decode body ``metal_kernels/paged_attention.metal`` with the K/V row read of
``paged_attention_quantized.metal``, which dequantizes MLX's affine planes in registers
(:mod:`mlxkv.kernels.quantized_paged_ref` states the format); launch geometry and the merge kernel are the
unquantized pair's (:class:`~mlxkv.kernels.metal.MetalPagedAttention`): only the K/V inputs and the row read's
template values differ. Returns ``None`` without Metal or for a configuration the kernel does not cover, so the
dispatcher runs the pure-MLX reference.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import metal
from .metal_specs import PAGED_ATTENTION_QUANTIZED, PAGED_ATTENTION_QUANTIZED_SCORES, KernelSpec
from .quantized_paged_ref import QUANTIZED_BITS, QUANTIZED_GROUP_SIZES, Planes


def supports_quantized_attention(dtype: mx.Dtype, head_dim: int, block_size: int, gqa: int, bits: int,
                                 group_size: int) -> bool:
    """Whether the quantized kernel covers this configuration (the unquantized kernel's, plus bits and a group
    size dividing head_dim)."""
    return (metal.supports_attention(dtype, head_dim, block_size, gqa) and bits in QUANTIZED_BITS
            and group_size in QUANTIZED_GROUP_SIZES and head_dim % group_size == 0)


class MetalQuantizedPagedAttention(metal.MetalPagedAttention):
    """The quantized Metal partials kernel plus the shared merge kernel (``partials`` / ``merge`` interface)."""

    name = "metal-quantized"

    def __init__(self, dtype: mx.Dtype, head_dim: int, block_size: int, kv_heads: int, gqa: int, bits: int,
                 group_size: int):
        super().__init__(dtype, head_dim, block_size, kv_heads, gqa)
        self.bits, self.group_size = bits, group_size

    def kernel_spec(self, scores: bool = False) -> KernelSpec:
        return PAGED_ATTENTION_QUANTIZED_SCORES if scores else PAGED_ATTENTION_QUANTIZED

    def kv_inputs(self, k_planes: Planes, v_planes: Planes) -> dict[str, mx.array]:
        """The K/V inputs by name: the three planes of K and of V."""
        (kp, ks, kb), (vp, vs, vb) = k_planes, v_planes
        return dict(k_packed=kp, k_scales=ks, k_biases=kb, v_packed=vp, v_scales=vs, v_biases=vb)

    def kv_template(self) -> dict[str, object]:
        return dict(BITS=self.bits, GS=self.group_size)


@functools.cache
def quantized_paged_attention_kernel(
    dtype: mx.Dtype, head_dim: int, block_size: int, kv_heads: int, gqa: int, bits: int, group_size: int
) -> MetalQuantizedPagedAttention | None:
    """The quantized Metal paged-attention pair for one configuration, or None (no Metal / unsupported)."""
    if not mx.metal.is_available() or not supports_quantized_attention(dtype, head_dim, block_size, gqa, bits,
                                                                         group_size):
        return None
    return MetalQuantizedPagedAttention(dtype, head_dim, block_size, kv_heads, gqa, bits, group_size)
