"""Pure-MLX paged decode attention over *quantized* pages: the twin of the quantized decode kernel
(``metal_kernels/paged_attention.metal`` with the row read of ``paged_attention_quantized.metal``).

The pages are MLX's affine quantization planes (:mod:`mlxkv.kv.paged.quantized_pages`), each page-shaped
``(kv_heads, num_blocks, block_size, width)``: packed ``uint32`` words (``32 / bits`` values per word, the lowest bits
first), per-group scales and biases (groups of ``group_size`` along head_dim). Element ``d`` of a row is

    ``q = (packed[d // (32 / bits)] >> ((d % (32 / bits)) * bits)) & (2**bits - 1)``,
    ``value = scales[d // group_size] * q + biases[d // group_size]``  (float32),

which is ``mx.dequantize`` with float32 scales and biases. The reference (the spec) dequantizes the pages its table
rows name (clamped to the pool, as the kernel clamps) into float32 pages and runs
:class:`~mlxkv.kernels.paged_attention_ref.ReferencePagedAttention` over them: the same split-K partials,
online softmax, windows, chunks, sinks and merge as unquantized pages. Cost: a gather and dequantization of
``B * max_blocks`` pages per call (the tables' capacity, not the pool).
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.rules import KV_BITS, KV_GROUP_SIZES

from .geometry import check_paged_inputs
from .paged_attention_ref import REFERENCE, run_paged_attention

Planes = tuple  # (packed uint32, scales, biases), each (kv_heads, num_blocks, block_size, width)

QUANTIZED_BITS = KV_BITS  # what the kernels support is what the config accepts
QUANTIZED_GROUP_SIZES = KV_GROUP_SIZES


def check_quantized_inputs(
    queries: mx.array, k_planes: Planes, v_planes: Planes, *, bits: int, group_size: int
) -> int:
    """Validate the planes against the queries, ``bits`` and ``group_size``; return head_dim.

    Raises:
        ValueError: bits or group size not supported, or a plane whose shape or dtype does not follow the layout.
    """
    if bits not in QUANTIZED_BITS:
        raise ValueError(f"bits must be one of {QUANTIZED_BITS}, got {bits}")
    if group_size not in QUANTIZED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {QUANTIZED_GROUP_SIZES}, got {group_size}")
    D = queries.shape[-1]
    if D % group_size:
        raise ValueError(f"head_dim {D} is not divisible by group_size {group_size}")
    for name, planes in (("k", k_planes), ("v", v_planes)):
        if len(planes) != 3:
            raise ValueError(f"{name}_planes must be (packed, scales, biases), got {len(planes)} arrays")
        packed, scales, biases = planes
        lead = packed.shape[:3]
        if (packed.ndim != 4 or packed.dtype != mx.uint32 or packed.shape[3] != D * bits // 32
                or scales.shape != (*lead, D // group_size) or biases.shape != scales.shape
                or scales.dtype != biases.dtype):
            raise ValueError(
                f"{name}_planes do not hold {bits}-bit rows of head_dim {D} in groups of {group_size}: packed "
                f"{packed.shape} {packed.dtype}, scales {scales.shape} {scales.dtype}, biases {biases.shape}")
    if k_planes[0].shape != v_planes[0].shape:
        raise ValueError(f"k and v planes differ in shape: {k_planes[0].shape} vs {v_planes[0].shape}")
    return D


def dequantize_table_pages(
    k_planes: Planes, v_planes: Planes, block_tables: mx.array, *, bits: int, group_size: int
) -> tuple[mx.array, mx.array, mx.array]:
    """The pages the tables name as float32 pages ``(KVH, 1 + B * M, bs, D)`` plus tables ``(B, M)`` into them
    (page 0 a zero null page; table entry ``(b, j)`` -> page ``1 + b * M + j``)."""
    B, M = block_tables.shape
    num_blocks = k_planes[0].shape[1]
    ids = mx.clip(block_tables, 0, num_blocks - 1).reshape(-1)  # (B * M,): clamped as the kernel clamps
    out = []
    for packed, scales, biases in (k_planes, v_planes):
        p, s, b = (mx.take(x, ids, axis=1) for x in (packed, scales, biases))  # (KVH, B * M, bs, w)
        dense = mx.dequantize(p, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size,
                              bits=bits)  # (KVH, B * M, bs, D)
        null = mx.zeros((dense.shape[0], 1, *dense.shape[2:]), dtype=mx.float32)
        out.append(mx.concatenate([null, dense], axis=1))  # (KVH, 1 + B * M, bs, D)
    tables = (1 + mx.arange(B * M, dtype=mx.int32)).reshape(B, M)  # (B, M)
    return out[0], out[1], tables


class ReferenceQuantizedPagedAttention:
    """Pure-MLX ``partials`` / ``merge`` over quantized pages (``bits``, ``group_size``): dequantize, then the
    unquantized reference."""

    name = "reference"
    default_num_splits = REFERENCE.default_num_splits

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size

    def partials(
        self, queries: mx.array, k_planes: Planes, v_planes: Planes, block_tables: mx.array, *args, **kwargs
    ) -> tuple[mx.array, mx.array]:
        """Split partials ``(B, H, S, D)`` and ``(B, H, S)`` float32: the table pages dequantized, then
        ``ReferencePagedAttention.partials`` (the remaining arguments as there)."""
        k, v, tables = dequantize_table_pages(k_planes, v_planes, block_tables, bits=self.bits,
                                              group_size=self.group_size)
        return REFERENCE.partials(queries, k, v, tables, *args, **kwargs)

    def merge(self, o_part: mx.array, lse: mx.array, sinks: mx.array | None, dtype: mx.Dtype) -> mx.array:
        """Log-sum-exp merge into ``(B, H, 1, D)`` of ``dtype``."""
        return REFERENCE.merge(o_part, lse, sinks, dtype)

    def mass(self, *args, **kwargs) -> mx.array:
        """Attention mass from ``partials(..., scores=True)``'s logits (as ``ReferencePagedAttention.mass``)."""
        return REFERENCE.mass(*args, **kwargs)


def check_quantized_tables(queries: mx.array, k_planes: Planes, v_planes: Planes, *rest) -> tuple[int, ...]:
    """:func:`~mlxkv.kernels.geometry.check_paged_inputs` (the table / option checks of unquantized pages; ``rest``:
    its arguments after the pages) on planes that passed :func:`check_quantized_inputs`; returns its tuple (its D:
    the scales' width)."""
    scales = k_planes[1]
    # The checks run on the scales (last axis D / group_size): a lazy query-shaped array of that width stands
    # in for the queries (never evaluated).
    shape_q = mx.zeros((queries.shape[0], queries.shape[1], 1, scales.shape[-1]))  # (B, H, 1, D / gs)
    return check_paged_inputs(shape_q, scales, v_planes[1], *rest)


def run_quantized_paged_attention(
    impl,
    queries: mx.array,
    k_planes: Planes,
    v_planes: Planes,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    bits: int,
    group_size: int,
    **options,
) -> mx.array:
    """Validate the planes, then :func:`~mlxkv.kernels.paged_attention_ref.run_paged_attention` (the split plan,
    ``impl.partials`` and ``impl.merge``; ``options`` as there)."""
    check_quantized_inputs(queries, k_planes, v_planes, bits=bits, group_size=group_size)
    return run_paged_attention(impl, queries, k_planes, v_planes, block_tables, context_lens,
                               check_inputs=check_quantized_tables, **options)


def quantized_paged_attention_reference(
    queries: mx.array,
    k_planes: Planes,
    v_planes: Planes,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    bits: int,
    group_size: int,
    **kwargs,
) -> mx.array | tuple[mx.array, mx.array]:
    """Decode attention of one query token per sequence over quantized paged K/V, in pure MLX.

    Args:
        queries: ``[B, n_heads, 1, head_dim]``.
        k_planes, v_planes: ``(packed, scales, biases)``, each ``[kv_heads, num_blocks, block_size, width]``
            (``mx.quantize`` of each row; ``width`` is ``head_dim * bits / 32`` for the packed words and
            ``head_dim / group_size`` for scales and biases).
        block_tables, context_lens, and the keyword options (scale, window, chunk_size, sinks, num_splits,
            max_context_len): as :func:`~mlxkv.kernels.paged_attention_ref.paged_attention_reference`.
        bits: 4 or 8; group_size: 32, 64 or 128.
        with_mass (keyword): also return the attention mass, as the unquantized reference.

    Returns:
        ``[B, n_heads, 1, head_dim]`` in the query dtype (with ``with_mass=True``: ``(that, mass)``).

    Raises:
        ValueError: inputs that do not follow the layout.
    """
    return run_quantized_paged_attention(
        ReferenceQuantizedPagedAttention(bits, group_size), queries, k_planes, v_planes, block_tables,
        context_lens, bits=bits, group_size=group_size, **kwargs)
