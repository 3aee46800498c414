"""Run the Metal kernel bodies on the CPU through the C++ emulator (tests/metal_shim/emulator.py)
and compare with the references; an AddressSanitizer build proves the kernels stay inside their
buffers whatever the tables say. Not a Metal result (no Metal compiler, no GPU). Needs g++.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from metal_shim.emulator import GXX, EmulatedAttention, Emulator

from mlxkv.kernels import variants
from mlxkv.kernels.cascade import cascade_attention, find_prefix_groups
from mlxkv.kernels.geometry import TOLERANCES, plan_splits
from mlxkv.kernels.paged_attention_ref import REFERENCE, run_paged_attention
from mlxkv.kernels.selfcheck import (
    check_attention_impl,
    close,
    max_abs_error,
    random_paged_case,
)

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed (Debian/Ubuntu: apt-get install g++)")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_emu"))


CONFIGS = [  # dtype, head_dim, block_size, kv_heads, gqa: shapes of real models
    (mx.float32, 64, 16, 2, 4),
    (mx.bfloat16, 128, 32, 1, 8),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[4]}")
def test_emulated_attention_matches_reference(emulator, cfg):
    dtype, D, bs, kvh, gqa = cfg
    impl = EmulatedAttention(emulator, dtype, D, bs, kvh, gqa)
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa,
                             context_lens=[1, bs + 1, 5 * bs + 3], sinks=True, seed=3)
    tol = TOLERANCES[dtype]
    for kw, splits in [({}, 1), ({"sinks": case.sinks}, 3), ({"window": bs + 5}, 2), ({"chunk_size": 2 * bs - 3}, 2)]:
        want = run_paged_attention(REFERENCE, *case.args(), num_splits=splits, **kw)
        got = run_paged_attention(impl, *case.args(), num_splits=splits, **kw)
        assert got.dtype == dtype
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), (
            kw.keys(), splits, max_abs_error(got, want))
    # The partials themselves agree (including lse = -inf and o = 0 for empty splits).
    plan = plan_splits(5 * bs + 3, bs, num_splits=3)
    kw = dict(scale=0.125, window=None, chunk_size=None)
    o_e, lse_e = impl.partials(*case.args(), plan, **kw)
    o_r, lse_r = REFERENCE.partials(*case.args(), plan, **kw)
    assert mx.array_equal(mx.isinf(lse_e), mx.isinf(lse_r)).item() and mx.isinf(lse_r).any().item()
    finite = mx.where(mx.isinf(lse_r), 0.0, lse_r)
    assert mx.allclose(mx.where(mx.isinf(lse_e), 0.0, lse_e), finite, atol=1e-5, rtol=1e-5).item()
    assert mx.allclose(o_e, o_r, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("variant", variants.emulation_classes(), ids=lambda v: v.label.replace(" ", "-"))
def test_every_variant_class_matches_reference(emulator, variant):
    # One per (dtype, simdgroup count, context_lens address space), from the factory's own tables.
    t = variant.call.template
    dtype, D, bs, kvh, gqa = t["T"], t["D"], t["BS"], t["KVH"], t["G"]
    B = variant.call.inputs["context_lens"].shape[0]
    lens = ([5 * bs + 3, 1, 2 * bs + 1, bs, 3, 4 * bs + 2, bs + 1, 7] * 2)[:B]
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa,
                             context_lens=lens, sinks=True, seed=B + gqa)
    impl = EmulatedAttention(emulator, dtype, D, bs, kvh, gqa)
    tol = TOLERANCES[dtype]
    for kw, splits in [({"sinks": case.sinks}, 3), ({"window": bs + 2, "sinks": case.sinks}, 2)]:
        want = run_paged_attention(REFERENCE, *case.args(), num_splits=splits, **kw)
        got = run_paged_attention(impl, *case.args(), num_splits=splits, **kw)
        assert close(got, want, dtype), (kw.keys(), splits, max_abs_error(got, want), tol)


def test_emulated_kernel_passes_the_dispatch_self_check(emulator):
    impl = EmulatedAttention(emulator, mx.float16, 64, 16, 2, 4)
    ok, err = check_attention_impl(impl, dtype=mx.float16, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                                   window=20, sinks=True)
    assert ok, err


def test_emulated_cascade_matches_flat(emulator):
    dtype, D, bs, kvh, gqa = mx.float32, 64, 16, 2, 2
    lens = [70, 60, 50]
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa,
                             context_lens=lens, seed=8)
    table = case.block_tables.tolist()
    for r in (1, 2):
        table[r][:3] = table[0][:3]
    case.block_tables = mx.array(table, dtype=mx.int32)
    groups = find_prefix_groups(table, lens, bs, min_group=2, min_shared_pages=1)
    assert groups and groups[0].shared_pages == 3
    got = cascade_attention(lambda g: EmulatedAttention(emulator, dtype, D, bs, kvh, g), *case.args(), groups)
    want = run_paged_attention(REFERENCE, *case.args())
    assert mx.allclose(got, want, atol=1e-6, rtol=1e-6).item(), max_abs_error(got, want)


def test_emulator_catches_a_wrong_body(emulator, monkeypatch):
    # Negative control: an off-by-one page index in the body must be caught by the comparison.
    from mlxkv.kernels import metal_specs

    original = metal_specs.PAGED_ATTENTION
    body = original.source().replace("block_tables[size_t(b) * max_blocks + tc / BS]",
                                     "block_tables[size_t(b) * max_blocks + (tc + 1) / BS]")
    bad = metal_specs.KernelSpec(original.name, original.source_file, original.input_names,
                                 original.output_names, original.template_params)
    monkeypatch.setattr(type(bad), "source", lambda self: body)
    import mlxkv.kernels.metal as metal_mod

    monkeypatch.setattr(metal_mod, "PAGED_ATTENTION", bad)
    impl = EmulatedAttention(emulator, mx.float32, 64, 16, 2, 4)
    ok, err = check_attention_impl(impl, dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4)
    assert not ok and err > 1e-3


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_asan"), sanitize=True)


@pytest.mark.parametrize("option", [{}, {"window": 24}, {"chunk_size": 40}], ids=["full", "window", "chunk"])
def test_out_of_range_tables_never_leave_the_pool(sanitized, option):
    # Block ids past the pool and negative, and context lengths longer than the table: under
    # AddressSanitizer any read outside k_pages / v_pages / block_tables aborts the launch.
    dtype, D, bs, kvh, gqa = mx.float32, 64, 16, 1, 2
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa,
                             context_lens=[20, 40], seed=5)
    num_blocks, max_blocks = case.k_pages.shape[1], case.block_tables.shape[1]
    tables = mx.array([[num_blocks + 5, -3, 1], [2, 1 << 30, -(1 << 30)]], dtype=mx.int32)
    lens = mx.array([max_blocks * bs + 50, 1 << 20], dtype=mx.int32)
    plan = plan_splits(1 << 20, bs, num_splits=3, **option)
    impl = EmulatedAttention(sanitized, dtype, D, bs, kvh, gqa)
    o, lse = impl.partials(case.queries, case.k_pages, case.v_pages, tables, lens, plan, scale=0.125,
                           window=option.get("window"), chunk_size=option.get("chunk_size"))
    assert not mx.isnan(o).any().item() and not mx.isnan(lse).any().item()


@pytest.mark.parametrize("D, lanes_per_key", [(128, 32), (64, 16), (32, 8)])
def test_operation_counts_match_the_design(emulator, D, lanes_per_key):
    # Per (token, head): log2(LPK) shuffles on LPK lanes, several tokens per simdgroup step where
    # LPK < 32, and two exps on each of the token's LPK lanes; one threadgroup barrier per thread;
    # G / HT threadgroups per kv head (a head tile each). MLX's sdpa_vector: one 32-lane simd_sum
    # (five shuffle stages) and 32 lanes of exps per (token, head).
    dtype, bs, kvh, gqa, L = mx.float32, 16, 2, 8, 96
    impl = EmulatedAttention(emulator, dtype, D, bs, kvh, gqa)
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa, context_lens=[L], seed=2)
    call = impl.partials_call(*case.args(), plan_splits(L, bs, num_splits=1), scale=0.1, window=None, chunk_size=None)
    t = call.template
    assert t["LPK"] == lanes_per_key and t["HT"] * D // lanes_per_key <= 8
    emulator.launch(call)
    n = emulator.last_counts
    heads, nsg, kps = kvh * gqa, t["NSG"], 32 // lanes_per_key
    stages = lanes_per_key.bit_length() - 1
    assert n["simd_reductions"] == 0
    assert n["simd_shuffles"] == (L // kps) * heads * 32 * stages  # L is a multiple of every KPS here
    assert n["exps"] == 2 * L * heads * lanes_per_key + heads * nsg * kps * 32  # softmax + combine
    assert n["threads"] == n["barriers"] == kvh * (gqa // t["HT"]) * 32 * nsg
