"""Random paged inputs and kernel-vs-reference comparisons (runtime self-check, scripts, tests)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx

from .geometry import TOLERANCES
from .metal_specs import MAX_CONSTANT_ARRAY_SIZE
from .paged_attention_ref import REFERENCE, run_paged_attention
from .paged_mass_ref import MASS_TOLERANCE
from .quantized_paged_ref import ReferenceQuantizedPagedAttention, run_quantized_paged_attention


# The self-check's second batch: enough sequences that context_lens is passed in device memory.
SELF_CHECK_LARGE_BATCH = MAX_CONSTANT_ARRAY_SIZE


@dataclass(slots=True)
class PagedCase:
    """One random decode step over a shuffled block pool (block 0 is the null block)."""

    queries: mx.array  # (B, H, 1, D)
    k_pages: mx.array  # (KVH, num_blocks, bs, D)
    v_pages: mx.array
    block_tables: mx.array  # (B, max_blocks) int32, padded with 0
    context_lens: mx.array  # (B,) int32
    sinks: mx.array | None  # (H,) or None

    def args(self) -> tuple[mx.array, ...]:
        return self.queries, self.k_pages, self.v_pages, self.block_tables, self.context_lens


def random_paged_case(
    *,
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    kv_heads: int,
    gqa: int,
    context_lens: list[int],
    sinks: bool = False,
    extra_blocks: int = 2,
    seed: int = 0,
) -> PagedCase:
    """Random queries/pages; each sequence gets distinct shuffled blocks, tables padded with 0."""
    rng = random.Random(seed)
    key = mx.random.key(seed)
    kq, kk, kv, ks = mx.random.split(key, 4)
    pages = [-(-L // block_size) for L in context_lens]
    max_blocks = max(pages) + 1  # at least one padding entry per row
    num_blocks = sum(pages) + 1 + extra_blocks
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    table = [[free.pop() for _ in range(n)] + [0] * (max_blocks - n) for n in pages]
    H = kv_heads * gqa
    shape = (kv_heads, num_blocks, block_size, head_dim)
    return PagedCase(
        queries=mx.random.normal((len(context_lens), H, 1, head_dim), key=kq).astype(dtype),
        k_pages=mx.random.normal(shape, key=kk).astype(dtype),
        v_pages=mx.random.normal(shape, key=kv).astype(dtype),
        block_tables=mx.array(table, dtype=mx.int32),
        context_lens=mx.array(context_lens, dtype=mx.int32),
        sinks=mx.random.normal((H,), key=ks).astype(dtype) if sinks else None,
    )


def max_abs_error(a: mx.array, b: mx.array) -> float:
    """Largest elementwise |a - b| in float32 (inf if either has a NaN)."""
    diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
    return float("inf") if bool(mx.any(mx.isnan(diff)).item()) else float(mx.max(diff).item())


def close(a: mx.array, b: mx.array, dtype: mx.Dtype) -> bool:
    """``allclose`` with atol = rtol = the dtype's tolerance (``TOLERANCES``)."""
    tol = TOLERANCES[dtype]
    return a.shape == b.shape and bool(mx.allclose(a.astype(mx.float32), b.astype(mx.float32),
                                                   atol=tol, rtol=tol).item())


def self_check_batches(block_size: int, window: int | None, chunk_size: int | None) -> tuple[list[int], list[int]]:
    """Context lengths of the self-check's two batches: a few sequences (``context_lens`` in constant memory) and
    at least ``SELF_CHECK_LARGE_BATCH`` (device memory); lengths not multiples of the block, past a window or chunk."""
    lens = [1, block_size + 1, 3 * block_size + 5]
    if window is not None:
        lens.append(window + 2 * block_size + 3)
    if chunk_size is not None:
        lens.append(chunk_size + block_size // 2 + 1)
    large = lens + [2, block_size, 2 * block_size + 3, 5, 4 * block_size][: max(0, SELF_CHECK_LARGE_BATCH - len(lens))]
    return lens, large


def check_attention_impl(
    impl,
    *,
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    kv_heads: int,
    gqa: int,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: bool = False,
    mass: bool = False,
    seed: int = 0,
) -> tuple[bool, float]:
    """Run ``impl`` and the reference on small random inputs; ``(ok, max err)``.

    Two batches (fewer than 8 sequences and at least 8: MLX passes ``context_lens`` in constant
    memory below 8 elements and in device memory from 8, so the kernel is compiled twice), each
    with 1 and 2 splits. Exceptions from ``impl`` count as a mismatch (err = inf). ``mass``: the
    attention-mass path (``with_mass=True``), its mass compared too (``MASS_TOLERANCE``).
    """
    return _compare(impl, REFERENCE, run_paged_attention, PagedCase.args, dtype=dtype, head_dim=head_dim,
                    block_size=block_size, kv_heads=kv_heads, gqa=gqa, window=window, chunk_size=chunk_size,
                    sinks=sinks, seed=seed, **({"with_mass": True} if mass else {}))


def _compare(impl, reference, run, case_args, *, dtype: mx.Dtype, head_dim: int, block_size: int, kv_heads: int,
             gqa: int, window: int | None = None, chunk_size: int | None = None, sinks: bool = False, seed: int = 0,
             **fixed) -> tuple[bool, float]:
    """``run(impl, *case_args(case), **kw)`` against ``run(reference, ...)`` over the self-check's two batches,
    each with 1 and 2 splits (``fixed``: keywords every call takes); ``(ok, max err)``, an exception from ``impl``
    counting as a mismatch (err = inf)."""
    ok, worst = True, 0.0
    for n, batch in enumerate(self_check_batches(block_size, window, chunk_size)):
        case = random_paged_case(dtype=dtype, head_dim=head_dim, block_size=block_size, kv_heads=kv_heads,
                                 gqa=gqa, context_lens=batch, sinks=sinks, seed=seed + n)
        args = case_args(case)
        for splits in (1, 2):
            kw = dict(**fixed, window=window, chunk_size=chunk_size, sinks=case.sinks, num_splits=splits)
            want = run(reference, *args, **kw)
            try:
                got = run(impl, *args, **kw)
                mx.eval(got)
            except Exception:  # a kernel that fails to compile or run is a failed self-check
                return False, float("inf")
            if fixed.get("with_mass"):  # (out, mass): the mass compared at its own tolerance
                (got, got_mass), (want, want_mass) = got, want
                ok = ok and mass_close(got_mass, want_mass)
                worst = max(worst, max_abs_error(got_mass, want_mass))
            ok = ok and close(got, want, dtype)
            worst = max(worst, max_abs_error(got, want))
    return ok, worst


def mass_close(a: mx.array, b: mx.array) -> bool:
    """Attention masses agree: same shape, ``allclose`` with atol = rtol = ``MASS_TOLERANCE``."""
    return a.shape == b.shape and bool(mx.allclose(a, b, atol=MASS_TOLERANCE, rtol=MASS_TOLERANCE).item())


def quantize_case(case: PagedCase, bits: int, group_size: int) -> tuple[mx.array, ...]:
    """``case``'s arguments with its pages as ``mx.quantize`` planes (each row on its own, groups along D)."""
    k = tuple(mx.quantize(case.k_pages, group_size=group_size, bits=bits))  # (KVH, NB, bs, w) each
    v = tuple(mx.quantize(case.v_pages, group_size=group_size, bits=bits))
    return case.queries, k, v, case.block_tables, case.context_lens


def check_quantized_attention_impl(impl, *, bits: int, group_size: int, mass: bool = False,
                                   **shape) -> tuple[bool, float]:
    """:func:`check_attention_impl` for a quantized-pages implementation (``shape``: its keywords): the same two
    batches (constant and device ``context_lens``) and split counts, the pages quantized, against
    :class:`~mlxkv.kernels.quantized_paged_ref.ReferenceQuantizedPagedAttention`; ``(ok, max err)``."""
    return _compare(impl, ReferenceQuantizedPagedAttention(bits, group_size), run_quantized_paged_attention,
                    lambda case: quantize_case(case, bits, group_size), bits=bits, group_size=group_size, **shape,
                    **({"with_mass": True} if mass else {}))
