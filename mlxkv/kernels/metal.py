"""Metal kernel factories: paged attention (split-K partials + merge; optionally the attention-mass variant of the
partials and the mass pass, ``partials_call(..., scores=True)`` / ``mass_call``).

Each factory builds its ``mx.fast.metal_kernel`` once (per source) and one wrapper per
configuration key, and returns ``None`` where Metal is unavailable or the configuration is one
the kernel does not cover, so the dispatcher falls back to the pure-MLX reference. Nothing here
runs on a machine without Metal; ``tests/test_kernels_metal_syntax.py`` checks the sources as C++.

There is no Metal KV-write kernel: ``mx.fast.metal_kernel`` outputs are fresh buffers (no input can
be written in place, ml-explore/mlx#2547), so one would copy the whole pool on every call, while
MLX's own scatter (a GPU kernel on Metal) writes only the new rows into a donated pool
(:mod:`mlxkv.kernels.kv_write_ref`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from .geometry import SplitPlan
from .metal_specs import PAGED_ATTENTION, PAGED_ATTENTION_SCORES, PAGED_MASS, PAGED_MERGE, KernelSpec

# What the factories cover; :mod:`mlxkv.kernels.variants` enumerates the checked launches from these
# tuples, so a value added here is syntax-checked and emulated before it can be built.
SUPPORTED_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
HEAD_DIMS = (32, 64, 96, 128, 256)  # multiples of 32: one element per lane per 32-wide slice
BLOCK_SIZES = tuple(2**i for i in range(9))  # every block size mlxkv.config allows (1..256)
# Query heads per kv head the attention kernel takes (the cascade stacks a group's heads up to it).
MAX_GQA_TIMES_HEAD_DIM = 2048
# Per lane a threadgroup keeps HT * D / LPK query and as many accumulator floats: at most this many
# each, so q + acc + one K and one V slice stay well inside the registers (no spills).
MAX_LANE_FLOATS = 8
# Fewest row elements per lane: below it a simdgroup takes several keys per step (LPK < 32).
MIN_LANE_ELEMENTS = 4
# Threadgroup memory for combining the virtual simdgroups: NSG * (32 / LPK) * HT * (D + 2) floats.
THREADGROUP_BYTES = 28 * 1024


@functools.cache
def _build(spec: KernelSpec):
    """The ``mx.fast.metal_kernel`` for ``spec`` (built once), or None without Metal."""
    if not mx.metal.is_available():
        return None
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source(),
        ensure_row_contiguous=True,
        compile_options={"math_mode": "safe"},  # masked softmax relies on exp(-inf) == 0
    )


def lanes_per_key(head_dim: int) -> int:
    """LPK: lanes sharing one K/V row (32, 16 or 8); a simdgroup takes 32 / LPK keys per step, so that
    each lane handles at least ``MIN_LANE_ELEMENTS`` elements of a row (small heads: several keys)."""
    lpk = 32
    while lpk > 8 and head_dim // lpk < MIN_LANE_ELEMENTS and head_dim % (lpk // 2) == 0:
        lpk //= 2
    return lpk


def heads_per_threadgroup(gqa: int, head_dim: int) -> int:
    """HT: the largest divisor of ``gqa`` whose per-lane state fits ``MAX_LANE_FLOATS``."""
    lane_floats = head_dim // lanes_per_key(head_dim)
    return max(h for h in range(1, gqa + 1) if gqa % h == 0 and (h * lane_floats <= MAX_LANE_FLOATS or h == 1))


def simdgroups_for(heads: int, head_dim: int) -> int:
    """Simdgroups per threadgroup of ``heads`` query heads: as many as the combine buffer fits (4, 2 or 1)."""
    keys = 32 // lanes_per_key(head_dim)  # virtual simdgroups per simdgroup
    for nsg in (4, 2, 1):
        if nsg * keys * heads * (head_dim + 2) * 4 <= THREADGROUP_BYTES:
            return nsg
    return 1


def max_gqa(head_dim: int) -> int:
    """Most query heads per kv head the attention kernel holds at ``head_dim``."""
    return MAX_GQA_TIMES_HEAD_DIM // head_dim


def supports_attention(dtype: mx.Dtype, head_dim: int, block_size: int, gqa: int) -> bool:
    """Whether the attention kernel covers this configuration (else the reference runs)."""
    return (dtype in SUPPORTED_DTYPES and head_dim in HEAD_DIMS and block_size in BLOCK_SIZES
            and 1 <= gqa <= max_gqa(head_dim))


@dataclass(slots=True)
class KernelCall:
    """Everything one launch passes to ``mx.fast.metal_kernel``, keyed by the spec's names."""

    spec: KernelSpec
    inputs: dict[str, mx.array]
    template: dict[str, object]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: dict[str, tuple[int, ...]]
    output_dtypes: dict[str, mx.Dtype]

    def launch(self) -> list[mx.array]:
        """Run the kernel (Metal only)."""
        kernel = _build(self.spec)
        assert kernel is not None, "KernelCall.launch needs Metal"
        spec = self.spec
        return kernel(
            inputs=[self.inputs[n] for n in spec.input_names],
            template=[(n, self.template[n]) for n, _ in spec.template_params],
            grid=self.grid,
            threadgroup=self.threadgroup,
            output_shapes=[self.output_shapes[n] for n in spec.output_names],
            output_dtypes=[self.output_dtypes[n] for n in spec.output_names],
        )


class MetalPagedAttention:
    """The Metal kernel pair with the ``partials``/``merge`` interface of the reference."""

    name = "metal"

    def __init__(self, dtype: mx.Dtype, head_dim: int, block_size: int, kv_heads: int, gqa: int):
        self.dtype, self.head_dim, self.block_size = dtype, head_dim, block_size
        self.kv_heads, self.gqa = kv_heads, gqa
        self.max_gqa = max_gqa(head_dim)  # cascade splits groups to fit

    def kernel_spec(self, scores: bool = False) -> KernelSpec:
        """The partials kernel, or its attention-mass variant (looked up per call, so tests can swap the
        module's spec)."""
        return PAGED_ATTENTION_SCORES if scores else PAGED_ATTENTION

    def kv_inputs(self, k_pages: mx.array, v_pages: mx.array) -> dict[str, mx.array]:
        """The kernel's K/V inputs by name: the pages as they are."""
        return dict(k_pages=k_pages, v_pages=v_pages)

    def kv_template(self) -> dict[str, object]:
        """Template values of the K/V row read beyond the shape class (none for dense pages)."""
        return {}

    def partials_call(
        self,
        queries: mx.array,
        k_pages: mx.array,
        v_pages: mx.array,
        block_tables: mx.array,
        context_lens: mx.array,
        plan: SplitPlan,
        *,
        scale: float,
        window: int | None,
        chunk_size: int | None,
        scores: bool = False,
    ) -> KernelCall:
        """The launch of the attention kernel (built without running it); ``k_pages`` / ``v_pages`` are
        whatever :meth:`kv_inputs` takes. ``scores``: the attention-mass variant, with a third output
        ``(B, H, max_blocks * block_size)`` of visible tokens' logits (for :meth:`mass_call`)."""
        B, H, _, D = queries.shape
        S = plan.num_splits
        kv = self.kv_inputs(k_pages, v_pages)
        num_blocks = next(iter(kv.values())).shape[1]  # every K/V input is page-shaped (KVH, num_blocks, ...)
        params = [window or 0, chunk_size or 0, plan.pages_per_split, S, block_tables.shape[1], num_blocks]
        G = H // self.kv_heads
        ht = heads_per_threadgroup(G, D)
        threads = 32 * simdgroups_for(ht, D)
        shapes, dtypes = dict(o_part=(B, H, S, D), lse=(B, H, S)), dict(o_part=mx.float32, lse=mx.float32)
        if scores:
            shapes["scores"], dtypes["scores"] = (B, H, block_tables.shape[1] * self.block_size), mx.float32
        return KernelCall(
            spec=self.kernel_spec(scores),
            inputs=dict(queries=queries, **kv, block_tables=block_tables,
                        context_lens=context_lens, params=mx.array(params, dtype=mx.int32),
                        scale=mx.array(scale, dtype=mx.float32)),
            template=dict(T=self.dtype, D=D, BS=self.block_size, KVH=self.kv_heads,
                          G=G, HT=ht, LPK=lanes_per_key(D), NSG=threads // 32, **self.kv_template()),
            grid=(threads, self.kv_heads * (G // ht), B * S),
            threadgroup=(threads, 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
        )

    def merge_call(
        self, o_part: mx.array, lse: mx.array, sinks: mx.array | None, dtype: mx.Dtype
    ) -> KernelCall:
        """The launch of the merge kernel (built without running it)."""
        B, H, S, D = o_part.shape
        has_sinks = sinks is not None
        sink_arr = sinks.astype(mx.float32) if has_sinks else mx.zeros((H,), dtype=mx.float32)
        return KernelCall(
            spec=PAGED_MERGE,
            inputs=dict(o_part=o_part, lse=lse, sinks=sink_arr, params=mx.array([S], dtype=mx.int32)),
            template=dict(T=dtype, D=D, HAS_SINKS=has_sinks),
            grid=(D, H, B),
            threadgroup=(min(D, 256), 1, 1),
            output_shapes=dict(out=(B, H, 1, D)),
            output_dtypes=dict(out=dtype),
        )

    def mass_call(
        self,
        scores: mx.array,
        lse: mx.array,
        sinks: mx.array | None,
        context_lens: mx.array,
        *,
        kv_heads: int,
        window: int | None,
        chunk_size: int | None,
    ) -> KernelCall:
        """The launch of the mass pass (built without running it): ``scores`` ``(B, H, P)`` from the mass variant
        and ``lse`` ``(B, H, S)`` into ``(B, kv_heads, P)`` float32."""
        B, H, P = scores.shape
        S = lse.shape[-1]
        has_sinks = sinks is not None
        sink_arr = sinks.astype(mx.float32) if has_sinks else mx.zeros((H,), dtype=mx.float32)
        assert kv_heads == self.kv_heads, (kv_heads, self.kv_heads)
        tx = min(256, -(-P // 32) * 32)
        return KernelCall(
            spec=PAGED_MASS,
            inputs=dict(scores=scores, lse=lse, sinks=sink_arr, context_lens=context_lens,
                        params=mx.array([window or 0, chunk_size or 0, S, P], dtype=mx.int32)),
            template=dict(KVH=self.kv_heads, G=H // self.kv_heads, HAS_SINKS=has_sinks),
            grid=(-(-P // tx) * tx, self.kv_heads, B),
            threadgroup=(tx, 1, 1),
            output_shapes=dict(mass=(B, self.kv_heads, P)),
            output_dtypes=dict(mass=mx.float32),
        )

    def partials(self, *args, **kwargs) -> tuple[mx.array, ...]:
        """Split-K partials ``(B, H, S, D)`` and ``(B, H, S)``, float32, as the reference's (with
        ``scores=True`` also the logits ``(B, H, max_blocks * block_size)``)."""
        return tuple(self.partials_call(*args, **kwargs).launch())

    def mass(self, *args, **kwargs) -> mx.array:
        """Attention mass ``(B, kv_heads, P)`` float32 (arguments as :meth:`mass_call`)."""
        (mass,) = self.mass_call(*args, **kwargs).launch()
        return mass

    def merge(
        self, o_part: mx.array, lse: mx.array, sinks: mx.array | None, dtype: mx.Dtype
    ) -> mx.array:
        """Log-sum-exp merge of the partials (and sinks) into ``(B, H, 1, D)`` of ``dtype``."""
        (out,) = self.merge_call(o_part, lse, sinks, dtype).launch()
        return out


@functools.lru_cache(maxsize=None)
def paged_attention_kernel(
    dtype: mx.Dtype, head_dim: int, block_size: int, kv_heads: int, gqa: int
) -> MetalPagedAttention | None:
    """The Metal paged-attention pair for one configuration, or None (no Metal / unsupported)."""
    if not mx.metal.is_available() or not supports_attention(dtype, head_dim, block_size, gqa):
        return None
    return MetalPagedAttention(dtype, head_dim, block_size, kv_heads, gqa)


def paged_attention_metal(queries, k_pages, v_pages, block_tables, context_lens, **kwargs) -> mx.array:
    """Run the Metal kernel directly (no self-check, no fallback); for benchmarks and checks.

    Raises:
        RuntimeError: no Metal, or a configuration the kernel does not cover.
    """
    from .paged_attention_ref import run_paged_attention

    kv_heads, _, bs, D = k_pages.shape
    impl = paged_attention_kernel(k_pages.dtype, D, bs, kv_heads, queries.shape[1] // kv_heads)
    if impl is None:
        raise RuntimeError(
            f"no Metal paged-attention kernel here (metal available: {mx.metal.is_available()}, "
            f"dtype={k_pages.dtype}, head_dim={D}, gqa={queries.shape[1] // kv_heads})"
        )
    return run_paged_attention(impl, queries, k_pages, v_pages, block_tables, context_lens, **kwargs)
