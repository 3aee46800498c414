"""Paged decode attention over quantized pages: the pure-MLX reference (the spec), the Metal variant run on the CPU
emulator (tests/metal_shim; not a Metal result), the dispatcher's self-check and fallback, and the wiring of the
paged layer caches. The emulator tests need g++.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest
from metal_shim.emulator import GXX, EmulatedQuantizedAttention, Emulator

from mlxkv.kernels import KernelDispatch, metal_quantized, metal_specs, variants
from mlxkv.kernels.geometry import TOLERANCES, plan_splits
from mlxkv.kernels.quantized_paged_ref import (
    ReferenceQuantizedPagedAttention,
    quantized_paged_attention_reference,
    run_quantized_paged_attention,
)
from mlxkv.kernels.selfcheck import (
    check_quantized_attention_impl,
    close,
    max_abs_error,
    quantize_case,
    random_paged_case,
)
from mlxkv.kv.layouts.dense_attention import attend as dense_attend

needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not installed (Debian/Ubuntu: apt-get install g++)")


def qcase(dtype, D, bs, kvh, gqa, bits, gs, lens, seed=0, sinks=True):
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa, context_lens=lens,
                             sinks=sinks, seed=seed)
    return case, quantize_case(case, bits, gs)


# -- the reference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, gs", [(4, 32), (8, 64), (4, 128)])
def test_reference_is_dense_attention_over_the_dequantized_rows(bits, gs):
    # Independent of the paging: each sequence's rows in position order, dequantized by mx.dequantize, then SDPA.
    D, bs, kvh, gqa, lens = 128, 8, 2, 3, [1, 9, 30]
    case, args = qcase(mx.float32, D, bs, kvh, gqa, bits, gs, lens, seed=4, sinks=False)
    got = quantized_paged_attention_reference(*args, bits=bits, group_size=gs, num_splits=2)
    table = case.block_tables.tolist()
    for b, L in enumerate(lens):
        ids = mx.array(table[b][: -(-L // bs)])
        rows = [mx.dequantize(*(mx.take(p, ids, axis=1) for p in planes), group_size=gs, bits=bits)
                .reshape(kvh, -1, D)[None, :, :L] for planes in (args[1], args[2])]  # (1, KVH, L, D)
        want = mx.fast.scaled_dot_product_attention(case.queries[b:b + 1], *rows, scale=D**-0.5)
        assert mx.allclose(got[b:b + 1], want, atol=1e-5, rtol=1e-5).item(), max_abs_error(got[b:b + 1], want)
        # What the layer caches run on CPU (mx.quantized_matmul on the planes) agrees to float32 rounding.
        planes = [tuple(mx.take(p, ids, axis=1).reshape(kvh, -1, p.shape[-1])[None, :, :L] for p in pl)
                  for pl in (args[1], args[2])]
        qmm = dense_attend(case.queries[b:b + 1], *planes, D**-0.5, None, None, bits=bits, group_size=gs)
        assert mx.allclose(got[b:b + 1], qmm, atol=1e-4, rtol=1e-4).item(), max_abs_error(got[b:b + 1], qmm)


def test_reference_refuses_planes_that_do_not_match():
    _, (q, k, v, t, lens) = qcase(mx.float32, 64, 4, 1, 2, 4, 32, [5])
    with pytest.raises(ValueError, match="do not hold 8-bit rows"):
        quantized_paged_attention_reference(q, k, v, t, lens, bits=8, group_size=32)
    with pytest.raises(ValueError, match="not divisible"):
        quantized_paged_attention_reference(q[..., :48], k, v, t, lens, bits=4, group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        quantized_paged_attention_reference(q, k, v, t, lens, bits=4, group_size=16)


# -- the Metal variant on the CPU emulator ------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_emu_q"))


CONFIGS = [  # dtype, head_dim, block_size, kv_heads, gqa, bits, group_size
    (mx.float32, 64, 16, 2, 4, 4, 32),
    (mx.float32, 64, 8, 1, 1, 8, 64),
    (mx.float16, 128, 8, 1, 8, 8, 128),
    (mx.bfloat16, 128, 16, 2, 2, 4, 128),
    (mx.float16, 32, 1, 2, 3, 4, 32),
    (mx.bfloat16, 96, 4, 1, 6, 8, 32),
]


@needs_gxx
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[4]}-b{c[5]}-gs{c[6]}")
def test_emulated_quantized_kernel_matches_reference(emulator, cfg):
    dtype, D, bs, kvh, gqa, bits, gs = cfg
    lens = [1, bs + 1, 4 * bs + 3, 2 * bs - 1 if bs > 1 else 2]  # not multiples of the block
    case, args = qcase(dtype, D, bs, kvh, gqa, bits, gs, lens, seed=D + bs)
    impl = EmulatedQuantizedAttention(emulator, dtype, D, bs, kvh, gqa, bits, gs)
    reference = ReferenceQuantizedPagedAttention(bits, gs)
    q = dict(bits=bits, group_size=gs)
    for kw in [dict(num_splits=1), dict(num_splits=3, sinks=case.sinks), dict(num_splits=2, window=bs + 3),
               dict(num_splits=2, chunk_size=2 * bs + 1)]:
        want = run_quantized_paged_attention(reference, *args, **q, **kw)
        got = run_quantized_paged_attention(impl, *args, **q, **kw)
        assert got.dtype == dtype
        assert close(got, want, dtype), (kw.keys(), max_abs_error(got, want), TOLERANCES[dtype])
    # The partials themselves (empty splits: lse = -inf, zero output) at float32 precision.
    plan = plan_splits(max(lens), bs, num_splits=3)
    kw = dict(scale=0.125, window=None, chunk_size=None)
    o_e, lse_e = impl.partials(*args, plan, **kw)
    o_r, lse_r = reference.partials(*args, plan, **kw)
    assert mx.array_equal(mx.isinf(lse_e), mx.isinf(lse_r)).item() and mx.isinf(lse_r).any().item()
    assert mx.allclose(o_e, o_r, atol=1e-5, rtol=1e-5).item(), max_abs_error(o_e, o_r)


@needs_gxx
def test_emulated_quantized_kernel_passes_the_dispatch_self_check(emulator):
    impl = EmulatedQuantizedAttention(emulator, mx.float16, 64, 16, 2, 2, 8, 32)
    ok, err = check_quantized_attention_impl(impl, dtype=mx.float16, head_dim=64, block_size=16, kv_heads=2, gqa=2,
                                             bits=8, group_size=32, window=20, sinks=True)
    assert ok, err


def _planted(monkeypatch, old: str, new: str) -> None:
    """The quantized body with ``old`` replaced by ``new``, as the factory's spec."""
    original = metal_specs.PAGED_ATTENTION_QUANTIZED
    body = original.source()
    assert old in body
    bad = metal_specs.KernelSpec(original.name, original.source_file, original.input_names, original.output_names,
                                 original.template_params)
    monkeypatch.setattr(type(bad), "source", lambda self: body.replace(old, new))
    monkeypatch.setattr(metal_quantized, "PAGED_ATTENTION_QUANTIZED", bad)


@needs_gxx
@pytest.mark.parametrize("old, new", [
    ("const uint shift = uint(d % PW) * uint(BITS);",  # high bits first: not MLX's packing order
     "const uint shift = uint(PW - 1 - d % PW) * uint(BITS);"),
    ("const size_t gi = groups + d / GS;", "const size_t gi = groups + d / D;"),  # one scale per row
], ids=["packing-order", "group-index"])
def test_a_planted_error_fails_the_self_check_and_the_dispatcher_falls_back(emulator, monkeypatch, old, new):
    _planted(monkeypatch, old, new)
    cfg = (mx.float32, 64, 16, 2, 2, 4, 32)
    dispatch = KernelDispatch(quantized_attention_factory=lambda *key: EmulatedQuantizedAttention(emulator, *key),
                              metal_available=lambda: True, mode=lambda: "auto")
    dtype, D, bs, kvh, gqa, bits, gs = cfg
    _, args = qcase(dtype, D, bs, kvh, gqa, bits, gs, [3, 40], seed=1, sinks=False)
    want = quantized_paged_attention_reference(*args, bits=bits, group_size=gs)
    with pytest.warns(RuntimeWarning, match="quantized paged-attention kernel disagrees with the reference"):
        out = dispatch.quantized_paged_attention(*args, bits=bits, group_size=gs)
    assert mx.array_equal(out, want).item()
    launches = emulator.launches
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per shape class; the bad kernel is never used again
        dispatch.quantized_paged_attention(*args, bits=bits, group_size=gs)
    assert emulator.launches == launches
    strict = KernelDispatch(quantized_attention_factory=lambda *key: EmulatedQuantizedAttention(emulator, *key),
                            metal_available=lambda: True, mode=lambda: "metal")
    with pytest.raises(RuntimeError, match="disagrees with the reference"):
        strict.quantized_paged_attention(*args, bits=bits, group_size=gs)


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_asan_q"), sanitize=True)


@needs_gxx
def test_out_of_range_tables_never_leave_the_quantized_pool(sanitized):
    dtype, D, bs, kvh, gqa, bits, gs = mx.float32, 64, 16, 1, 2, 4, 32
    _, (q, k, v, _, _) = qcase(dtype, D, bs, kvh, gqa, bits, gs, [20, 40], seed=5, sinks=False)
    num_blocks = k[0].shape[1]
    tables = mx.array([[num_blocks + 5, -3, 1], [2, 1 << 30, -(1 << 30)]], dtype=mx.int32)
    lens = mx.array([3 * bs + 50, 1 << 20], dtype=mx.int32)
    impl = EmulatedQuantizedAttention(sanitized, dtype, D, bs, kvh, gqa, bits, gs)
    o, lse = impl.partials(q, k, v, tables, lens, plan_splits(1 << 20, bs, num_splits=3), scale=0.125, window=None,
                           chunk_size=None)
    assert not mx.isnan(o).any().item() and not mx.isnan(lse).any().item()


# -- dispatch and variants ----------------------------------------------------------------------------------
def test_without_metal_the_dispatcher_runs_the_reference_and_never_builds_a_kernel():
    built = []
    dispatch = KernelDispatch(quantized_attention_factory=lambda *key: built.append(key),
                              metal_available=lambda: False, mode=lambda: "auto")
    _, args = qcase(mx.float16, 64, 8, 2, 2, 8, 32, [7, 19])
    out = dispatch.quantized_paged_attention(*args, bits=8, group_size=32)
    assert mx.array_equal(out, quantized_paged_attention_reference(*args, bits=8, group_size=32)).item()
    assert built == [] and metal_quantized.quantized_paged_attention_kernel(mx.float16, 64, 8, 2, 2, 8, 32) is None
    with pytest.raises(ValueError, match="outside the pool|block"):
        bad = mx.array([[999, 0, 0, 0], [1, 2, 3, 0]], dtype=mx.int32)
        dispatch.quantized_paged_attention(args[0], args[1], args[2], bad, args[4], bits=8, group_size=32)
    strict = KernelDispatch(metal_available=lambda: False, mode=lambda: "metal")
    with pytest.raises(RuntimeError, match="Metal is not available"):
        strict.quantized_paged_attention(*args, bits=8, group_size=32)


def test_the_self_check_class_includes_bits_and_group_size():
    keys = []

    def factory(*key):
        keys.append(key)
        return ReferenceQuantizedPagedAttention(key[5], key[6])  # a correct "kernel"

    dispatch = KernelDispatch(quantized_attention_factory=factory, metal_available=lambda: True, mode=lambda: "auto")
    for bits, gs in [(4, 32), (8, 32), (4, 64), (4, 32)]:
        _, args = qcase(mx.float32, 64, 8, 1, 2, bits, gs, [9])
        dispatch.quantized_paged_attention(*args, bits=bits, group_size=gs)
    assert keys == [(mx.float32, 64, 8, 1, 2, 4, 32), (mx.float32, 64, 8, 1, 2, 8, 32),
                    (mx.float32, 64, 8, 1, 2, 4, 64)]


def test_variants_cover_bits_group_sizes_and_both_address_spaces():
    quantized = [v for v in variants.all_variants() if v.spec == metal_specs.PAGED_ATTENTION_QUANTIZED]
    assert quantized and len(quantized) == len(variants.quantized_attention_variants())
    t = [v.call.template for v in quantized]
    assert {x["BITS"] for x in t} == {4, 8} and {x["GS"] for x in t} == {32, 64, 128}
    assert {x["D"] for x in t} == set(metal_quantized.metal.HEAD_DIMS)
    assert {x["T"] for x in t} == set(metal_quantized.metal.SUPPORTED_DTYPES)
    assert {(x["D"], x["GS"], x["BITS"]) for x in t} == {
        (D, gs, b) for D in metal_quantized.metal.HEAD_DIMS for gs in (32, 64, 128) if D % gs == 0 for b in (4, 8)}
    assert {v.arg_infos()["context_lens"].space for v in quantized} == {"constant", "device"}
    assert all(x["D"] % x["GS"] == 0 and x["HT"] * x["D"] // x["LPK"] <= 8 for x in t)


# -- wiring: the paged layer caches and batch views call the kernel where it may run ------------------------
@pytest.fixture
def spy_kernel(monkeypatch):
    """The process-wide dispatcher on a pretend Metal device whose quantized "kernel" is the reference recording
    each launch's (batch, pool blocks); the self-check passes it."""
    from mlxkv.kernels.dispatch import DEFAULT_DISPATCH

    launches: list[tuple[int, int]] = []

    class Spy(ReferenceQuantizedPagedAttention):
        def partials(self, queries, k_planes, *args, **kwargs):
            launches.append((queries.shape[0], k_planes[0].shape[1]))
            return super().partials(queries, k_planes, *args, **kwargs)

    monkeypatch.setattr(DEFAULT_DISPATCH, "metal_available", lambda: True)
    monkeypatch.setattr(DEFAULT_DISPATCH, "mode", lambda: "auto")
    monkeypatch.setattr(DEFAULT_DISPATCH, "quantized_attention_factory", lambda *key: Spy(key[5], key[6]))
    monkeypatch.setattr(DEFAULT_DISPATCH, "_attention", {})
    return launches


@pytest.mark.parametrize("bits", [8, 4])
def test_paged_layer_cache_decode_goes_through_the_quantized_kernel(spy_kernel, bits):
    from test_paged_quantized import GROUP, PROMPT, model_for, paged_pool, step
    from test_paged_quantized import close as logits_close

    model = model_for("llama")
    pool = paged_pool(model, bits, num_blocks=160)
    seq = pool.open(prompt=PROMPT[:21])
    dense = make_caches_quantized(model, bits, GROUP)
    lp, ld = step(model, seq.caches, PROMPT[:21]), step(model, dense, PROMPT[:21])
    seq.commit()
    assert not [n for n in spy_kernel if n[1] == 160]  # prefill runs mx.quantized_matmul
    for _ in range(4):
        token = int(mx.argmax(ld).item())
        assert int(mx.argmax(lp).item()) == token
        seq.feed([token])
        lp, ld = step(model, seq.caches, [token]), step(model, dense, [token])
        seq.commit()
        assert logits_close(lp, ld), mx.abs(lp - ld).max().item()
    layers = len(seq.caches)
    assert [n for n in spy_kernel if n[1] == 160] == [(1, 160)] * (4 * layers)  # every decode step, every layer
    pool.release(seq.id)


def test_batched_decode_views_go_through_the_quantized_kernel(spy_kernel):
    from test_paged_quantized import dense_quantized_tokens, model_for, paged_pool

    from mlxkv.engine.batch import BatchEngine, EngineConfig
    from mlxkv.engine.request import GenerationRequest
    from mlxkv.engine.sampling import SamplingParams

    model = model_for("llama")
    prompts = [[(7 * i + 11 * j) % 900 + 10 for i in range(n)] for j, n in enumerate((5, 13, 22))]
    expected = [dense_quantized_tokens(model, p, 6) for p in prompts]
    pool = paged_pool(model, 8, num_blocks=64, max_sequences=4)
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=4, prefill_chunk_size=8), pool=pool,
                         context_length=4096).start()
    try:
        handles = [engine.submit(GenerationRequest(p, SamplingParams(max_tokens=6))) for p in prompts]
        got = [[e.token for e in h if e.kind == "token"] for h in handles]
    finally:
        engine.stop()
    assert got == expected
    assert any(b > 1 and n == 64 for b, n in spy_kernel)  # a batched decode step read the pool's planes


def make_caches_quantized(model, bits: int, group: int):
    from mlxkv.kv.layouts import make_caches

    return make_caches(model, kv_bits=bits, kv_group_size=group)
