"""Metal factory for paged decode attention over quantized pages (``metal_kernels/paged_attention_quantized.metal``).

The kernel is the unquantized decode kernel with its K/V row reads dequantizing MLX's affine planes in registers
(:mod:`mlxkv.kernels.quantized_paged_ref` states the format); grid, lane layout, head tiling and the merge kernel
are the unquantized pair's (:class:`~mlxkv.kernels.metal.MetalPagedAttention`). Returns ``None`` without Metal or
for a configuration the kernel does not cover, so the dispatcher runs the pure-MLX reference.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import metal
from .geometry import SplitPlan
from .metal_specs import PAGED_ATTENTION_QUANTIZED
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

    def partials_call(
        self,
        queries: mx.array,
        k_planes: Planes,
        v_planes: Planes,
        block_tables: mx.array,
        context_lens: mx.array,
        plan: SplitPlan,
        *,
        scale: float,
        window: int | None,
        chunk_size: int | None,
    ) -> metal.KernelCall:
        """The launch of the quantized attention kernel (built without running it)."""
        B, H, _, D = queries.shape
        S = plan.num_splits
        num_blocks = k_planes[0].shape[1]
        params = [window or 0, chunk_size or 0, plan.pages_per_split, S, block_tables.shape[1], num_blocks]
        G = H // self.kv_heads
        ht = metal.heads_per_threadgroup(G, D)
        threads = 32 * metal.simdgroups_for(ht, D)
        (kp, ks, kb), (vp, vs, vb) = k_planes, v_planes
        return metal.KernelCall(
            spec=PAGED_ATTENTION_QUANTIZED,
            inputs=dict(queries=queries, k_packed=kp, k_scales=ks, k_biases=kb, v_packed=vp, v_scales=vs,
                        v_biases=vb, block_tables=block_tables, context_lens=context_lens,
                        params=mx.array(params, dtype=mx.int32), scale=mx.array(scale, dtype=mx.float32)),
            template=dict(T=self.dtype, D=D, BS=self.block_size, KVH=self.kv_heads, G=G, HT=ht,
                          LPK=metal.lanes_per_key(D), NSG=threads // 32, BITS=self.bits, GS=self.group_size),
            grid=(threads, self.kv_heads * (G // ht), B * S),
            threadgroup=(threads, 1, 1),
            output_shapes=dict(o_part=(B, H, S, D), lse=(B, H, S)),
            output_dtypes=dict(o_part=mx.float32, lse=mx.float32),
        )


@functools.lru_cache(maxsize=None)
def quantized_paged_attention_kernel(
    dtype: mx.Dtype, head_dim: int, block_size: int, kv_heads: int, gqa: int, bits: int, group_size: int
) -> MetalQuantizedPagedAttention | None:
    """The quantized Metal paged-attention pair for one configuration, or None (no Metal / unsupported)."""
    if not mx.metal.is_available() or not supports_quantized_attention(dtype, head_dim, block_size, gqa, bits,
                                                                         group_size):
        return None
    return MetalQuantizedPagedAttention(dtype, head_dim, block_size, kv_heads, gqa, bits, group_size)
