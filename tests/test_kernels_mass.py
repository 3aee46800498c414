"""The attention-mass output of paged decode attention (``with_mass=True``): the pure-MLX reference against the
second score pass of mlxkv/kv/overflow/mass.py, the Metal mass variants run on the CPU emulator (tests/metal_shim;
not a Metal result) with a planted-error control and AddressSanitizer, the variants without mass unchanged, and the
dispatcher's self-check and fallback. The emulator tests need g++.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest
from metal_shim.emulator import GXX, EmulatedAttention, EmulatedQuantizedAttention, Emulator
from testkit.kernel_oracle import dense_attention_mass

from mlxkv.kernels import KernelDispatch, metal_specs, paged_attention_reference
from mlxkv.kernels.geometry import plan_splits
from mlxkv.kernels.paged_attention_ref import REFERENCE, run_paged_attention
from mlxkv.kernels.paged_mass_ref import MASS_TOLERANCE
from mlxkv.kernels.quantized_paged_ref import dequantize_table_pages, quantized_paged_attention_reference
from mlxkv.kernels.selfcheck import (
    check_attention_impl,
    check_quantized_attention_impl,
    close,
    mass_close,
    max_abs_error,
    quantize_case,
    random_paged_case,
)

needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not installed (Debian/Ubuntu: apt-get install g++)")


def assert_mass_is_second_pass(case, mass, scale, **kw):
    want = dense_attention_mass(case.queries, case.k_pages, case.block_tables, case.context_lens, scale=scale, **kw)
    assert mass.dtype == mx.float32 and mass.shape == want.shape
    assert mx.allclose(mass, want, atol=MASS_TOLERANCE, rtol=MASS_TOLERANCE).item(), max_abs_error(mass, want)
    for b, L in enumerate(case.context_lens.tolist()):
        assert not mx.any(mass[b, :, L:]).item()  # past the context: 0


# -- the reference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [1, 3], ids=["single-pass", "split-k"])
@pytest.mark.parametrize("option", ["full", "sinks", "window", "chunk"])
def test_reference_mass_is_the_second_pass_mass(splits, option):
    # GQA 3, odd context lengths, block size 4; one split (the single-pass softmax) and three (split-K + rescale).
    case = random_paged_case(dtype=mx.float32, head_dim=32, block_size=4, kv_heads=2, gqa=3,
                             context_lens=[1, 7, 13, 30], sinks=True, seed=7)
    kw = {"full": {}, "sinks": {"sinks": case.sinks}, "window": {"window": 9}, "chunk": {"chunk_size": 6}}[option]
    scale = 0.3
    out, mass = paged_attention_reference(*case.args(), scale=scale, num_splits=splits, with_mass=True, **kw)
    # The attention output is unchanged by asking for the mass.
    assert mx.array_equal(out, paged_attention_reference(*case.args(), scale=scale, num_splits=splits, **kw)).item()
    assert_mass_is_second_pass(case, mass, scale, **kw)
    if option != "sinks":  # without a sink each query head's probabilities sum to 1
        assert mx.allclose(mass.sum(axis=-1), mx.full(mass.shape[:2], 3.0), atol=1e-5).item()


def test_quantized_reference_mass_is_the_mass_over_the_dequantized_rows():
    case = random_paged_case(dtype=mx.float16, head_dim=64, block_size=8, kv_heads=2, gqa=2,
                             context_lens=[5, 21, 40], sinks=True, seed=2)
    args = quantize_case(case, 4, 32)
    k, v, tables = dequantize_table_pages(args[1], args[2], case.block_tables, bits=4, group_size=32)
    for splits in (1, 2):
        got = quantized_paged_attention_reference(*args, bits=4, group_size=32, sinks=case.sinks,
                                                  num_splits=splits, with_mass=True)
        want = paged_attention_reference(case.queries, k, v, tables, case.context_lens, sinks=case.sinks,
                                         num_splits=splits, with_mass=True)
        assert mx.array_equal(got[0], want[0]).item() and mass_close(got[1], want[1])


# -- the Metal variants on the emulator ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_emu_mass"))


CONFIGS = [  # dtype, head_dim, block_size, kv_heads, gqa: lanes per key 16, 32 and 8; head tiles of 1 to 4
    (mx.float32, 64, 16, 2, 4),
    (mx.bfloat16, 128, 8, 1, 8),
    (mx.float16, 32, 4, 2, 3),
]


@needs_gxx
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-d{c[1]}-bs{c[2]}-g{c[4]}")
def test_emulated_mass_variant_matches_the_reference(emulator, cfg):
    dtype, D, bs, kvh, gqa = cfg
    impl = EmulatedAttention(emulator, dtype, D, bs, kvh, gqa)
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa,
                             context_lens=[1, bs + 1, 5 * bs + 3], sinks=True, seed=3)
    for kw, splits in [({}, 1), ({"sinks": case.sinks}, 3), ({"window": bs + 5}, 2), ({"chunk_size": 2 * bs - 3}, 2)]:
        want = run_paged_attention(REFERENCE, *case.args(), num_splits=splits, with_mass=True, **kw)
        got = run_paged_attention(impl, *case.args(), num_splits=splits, with_mass=True, **kw)
        assert close(got[0], want[0], dtype), (kw.keys(), splits, max_abs_error(got[0], want[0]))
        assert mass_close(got[1], want[1]), (kw.keys(), splits, max_abs_error(got[1], want[1]))


@needs_gxx
def test_emulated_mass_variants_pass_the_dispatch_self_check(emulator):
    # Both batches of the self-check (context_lens in constant and in device memory), 1 and 2 splits.
    impl = EmulatedAttention(emulator, mx.float32, 64, 16, 2, 4)
    ok, err = check_attention_impl(impl, dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                                   window=20, sinks=True, mass=True)
    assert ok, err
    qimpl = EmulatedQuantizedAttention(emulator, mx.float16, 64, 16, 2, 2, 8, 64)
    ok, err = check_quantized_attention_impl(qimpl, bits=8, group_size=64, dtype=mx.float16, head_dim=64,
                                             block_size=16, kv_heads=2, gqa=2, sinks=True, mass=True)
    assert ok, err


PLANTS = {  # file: (text in the shipped source, a plausible mistake)
    "paged_attention_scores.metal": ("+ t] = s;", "+ t] = s * 0.99f;"),
    "paged_mass.metal": ("denom += metal::exp(sinks[h] - top_safe);", "denom += 0.0f;"),
}


@needs_gxx
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_the_mass_comparison_catches_a_planted_error(emulator, monkeypatch, name):
    old, new = PLANTS[name]
    shipped = metal_specs.read_source

    def planted(filename: str) -> str:
        text = shipped(filename)
        if filename == name:
            assert old in text, old
            return text.replace(old, new)
        return text

    monkeypatch.setattr(metal_specs, "read_source", planted)
    impl = EmulatedAttention(emulator, mx.float32, 64, 16, 2, 4)
    shape = dict(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4, sinks=True)
    ok, err = check_attention_impl(impl, **shape, mass=True)
    assert not ok and 1e-4 < err < float("inf")  # a wrong number, not a failed build
    assert check_attention_impl(impl, **shape)[0]  # the variant without mass is not touched by the plant


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_asan_mass"), sanitize=True)


@needs_gxx
@pytest.mark.parametrize("option", [{}, {"window": 24}], ids=["full", "window"])
def test_mass_variant_never_leaves_its_buffers(sanitized, option):
    # Block ids outside the pool and contexts longer than the table: under AddressSanitizer any read or write
    # outside the pages, tables, scores or mass aborts the launch.
    dtype, D, bs, kvh, gqa = mx.float32, 64, 16, 1, 2
    case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=gqa,
                             context_lens=[20, 40], sinks=True, seed=5)
    num_blocks = case.k_pages.shape[1]
    tables = mx.array([[num_blocks + 5, -3, 1], [2, 1 << 30, -(1 << 30)]], dtype=mx.int32)
    max_blocks = tables.shape[1]
    lens = mx.array([max_blocks * bs + 50, 1 << 20], dtype=mx.int32)
    plan = plan_splits(1 << 20, bs, num_splits=3, **option)
    impl = EmulatedAttention(sanitized, dtype, D, bs, kvh, gqa)
    kw = dict(window=option.get("window"), chunk_size=None)
    o, lse, scores = impl.partials(case.queries, case.k_pages, case.v_pages, tables, lens, plan, scale=0.125,
                                   scores=True, **kw)
    mass = impl.mass(scores, lse, case.sinks, lens, kv_heads=kvh, **kw)
    assert mass.shape == (2, kvh, max_blocks * bs) and not mx.isnan(mass).any().item()
    assert mx.all(mass >= 0).item() and mx.all(mass.sum(axis=-1) <= gqa + 1e-4).item()


# -- the variants without mass ------------------------------------------------------------------------------
def test_variants_without_mass_are_the_body_without_the_score_line():
    body = metal_specs.read_source("paged_attention.metal")
    marked = [n for n, line in enumerate(body.splitlines()) if line.strip() == metal_specs.SCORE_WRITE]
    assert len(marked) == 1
    for off, on in [(metal_specs.PAGED_ATTENTION, metal_specs.PAGED_ATTENTION_SCORES),
                    (metal_specs.PAGED_ATTENTION_QUANTIZED, metal_specs.PAGED_ATTENTION_QUANTIZED_SCORES)]:
        full = metal_specs.with_kv_read(body, metal_specs.read_source(off.kv_read_file)).splitlines()
        assert off.source().splitlines() == [ln for ln in full if ln.strip() != metal_specs.SCORE_WRITE]
        assert "scores" not in off.source() and off.output_names == ("o_part", "lse")
        snippet = metal_specs.read_source("paged_attention_scores.metal")
        assert snippet.splitlines()[-2].strip() in on.source() and on.output_names[-1] == "scores"


# -- dispatch ------------------------------------------------------------------------------------------------
class ScaledMass:
    """The reference with its mass scaled by ``factor`` (1: a correct kernel); counts its calls."""

    name = "fake-metal"

    def __init__(self, factor=1.0):
        self.factor, self.calls = factor, 0

    def partials(self, *args, **kwargs):
        self.calls += 1
        return REFERENCE.partials(*args, **kwargs)

    def merge(self, *args):
        return REFERENCE.merge(*args)

    def mass(self, *args, **kwargs):
        return REFERENCE.mass(*args, **kwargs) * self.factor


def test_dispatch_returns_the_mass_from_the_checked_kernel_or_the_reference():
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[70, 5, 33], sinks=True, seed=11)
    want = paged_attention_reference(*case.args(), sinks=case.sinks, num_splits=2, with_mass=True)
    good = ScaledMass()
    d = KernelDispatch(attention_factory=lambda *key: good, metal_available=lambda: True, mode=lambda: "auto")
    got = d.paged_attention(*case.args(), sinks=case.sinks, num_splits=2, with_mass=True)
    assert good.calls > 0 and mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    # Without the flag: the output alone, through its own shape class (checked separately).
    keys = set(d._attention)
    assert isinstance(d.paged_attention(*case.args(), sinks=case.sinks), mx.array) and len(d._attention) == 2
    assert {k[1].mass for k in d._attention} == {True, False} and keys < set(d._attention)
    bad = ScaledMass(1.5)
    d = KernelDispatch(attention_factory=lambda *key: bad, metal_available=lambda: True, mode=lambda: "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = d.paged_attention(*case.args(), sinks=case.sinks, num_splits=2, with_mass=True)
    assert any("disagrees with the reference" in str(w.message) for w in caught)
    assert mx.array_equal(got[1], want[1]).item()  # the reference's mass, not the bad kernel's
    d = KernelDispatch(attention_factory=lambda *key: bad, metal_available=lambda: True, mode=lambda: "metal")
    with pytest.raises(RuntimeError, match="disagrees"):
        d.paged_attention(*case.args(), with_mass=True)


def test_quantized_dispatch_returns_the_mass_on_cpu():
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=8, kv_heads=2, gqa=2,
                             context_lens=[9, 17], seed=4)
    args = quantize_case(case, 8, 64)
    out, mass = KernelDispatch().quantized_paged_attention(*args, bits=8, group_size=64, with_mass=True)
    want = quantized_paged_attention_reference(*args, bits=8, group_size=64, with_mass=True)
    assert mx.array_equal(out, want[0]).item() and mx.array_equal(mass, want[1]).item()
    assert mass.shape == (2, 2, case.block_tables.shape[1] * 8)
