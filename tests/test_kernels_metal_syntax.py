"""Static check of the Metal kernel bodies (tests/metal_shim/static_check.py): every variant the
factories can emit compiles against the strict shim, and each construct Metal rejects is caught
when planted in a shipped body. No Metal compiler exists off macOS; needs g++ (Debian: g++).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from metal_shim.static_check import GXX, call_graph_cycles, check_spec

from mlxkv.kernels import metal, variants
from mlxkv.kernels.metal_specs import ALL_SPECS, PAGED_ATTENTION, PAGED_MERGE, KernelSpec, render_kernel

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed (Debian/Ubuntu: apt-get install g++)")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def every_variant() -> list[variants.Variant]:
    return variants.all_variants()


@pytest.fixture(scope="module")
def few_variants(every_variant) -> list[variants.Variant]:
    """One float32 and one bfloat16 variant per kernel (one variant of a kernel without a dtype, the mass pass):
    enough for a planted error to show."""
    chosen = {}
    for v in every_variant:
        t = v.call.template.get("T")
        for dtype in (mx.float32, mx.bfloat16):
            if t is None or t == dtype:
                chosen.setdefault((v.spec.name, t and dtype), v)
    return list(chosen.values())


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_every_variant_of_every_kernel_passes(spec: KernelSpec, every_variant):
    report = check_spec(spec, variants=every_variant)
    assert report.ok, report.problems
    assert report.variants == sum(v.spec == spec for v in every_variant) > 0


def test_variants_cover_the_factory_tables(every_variant):
    # Enumerated from the factory: every dtype, head_dim, simdgroup count and both address spaces
    # of context_lens (constant below 8 sequences, device from 8) appear.
    attn = [v for v in every_variant if v.spec == PAGED_ATTENTION]
    assert {v.call.template["T"] for v in attn} == set(metal.SUPPORTED_DTYPES)
    assert {v.call.template["D"] for v in attn} == set(metal.HEAD_DIMS)
    assert {v.call.template["NSG"] for v in attn} == {
        metal.simdgroups_for(metal.heads_per_threadgroup(g, d), d)
        for d in metal.HEAD_DIMS for g in range(1, metal.max_gqa(d) + 1)}
    assert {v.arg_infos()["context_lens"].space for v in attn} == {"constant", "device"}
    merge = [v for v in every_variant if v.spec == PAGED_MERGE]
    assert {v.arg_infos()["sinks"].space for v in merge} == {"constant", "device"}
    assert {v.call.template["HAS_SINKS"] for v in merge} == {False, True}
    assert len({v.signature_key() for v in every_variant}) == len(every_variant)


def test_per_lane_state_is_bounded_in_every_variant(every_variant):
    # The decode kernel's registers per lane: HT * D / LPK query + as many accumulator floats.
    for v in every_variant:
        if v.spec == PAGED_ATTENTION:
            t = v.call.template
            assert t["G"] % t["HT"] == 0 and t["HT"] * t["D"] // t["LPK"] <= metal.MAX_LANE_FLOATS, v.label
            assert 32 % t["LPK"] == 0 and t["D"] % t["LPK"] == 0, v.label
            assert v.call.grid[1] == t["KVH"] * t["G"] // t["HT"], v.label


def test_signature_matches_launch_arguments(every_variant):
    small = next(v for v in every_variant if v.spec == PAGED_ATTENTION and "B=1 " in v.label
                 and v.call.template["T"] == mx.float16)
    src = render_kernel(PAGED_ATTENTION, small.arg_infos(), small.call.output_dtypes, small.call.template)
    assert "const device float16_t* queries [[buffer(0)]]" in src
    assert "const constant int32_t* context_lens [[buffer(4)]]" in src  # 1 element < 8
    assert "const constant float& scale [[buffer(6)]]" in src  # 0-d
    assert "device float* lse [[buffer(8)]]" in src
    assert "uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]" in src
    big = next(v for v in every_variant if v.spec == PAGED_ATTENTION and "B=8 " in v.label)
    src = render_kernel(PAGED_ATTENTION, big.arg_infos(), big.call.output_dtypes, big.call.template)
    assert "const device int32_t* context_lens [[buffer(4)]]" in src  # 8 sequences: device memory


ATTENTION_PLANTS = {
    # name: (text in the shipped body, replacement)
    "missing-semicolon": ("const float p = metal::exp(s - m_new);", "const float p = metal::exp(s - m_new)"),
    "misspelt-builtin": ("simd_shuffle_xor(s, ushort(mask))", "simd_shufle_xor(s, ushort(mask))"),
    "mixed-max": ("metal::max(m[g], s)", "metal::max(m[g], 0)"),
    "undeclared": ("q[g][i] * k[i]", "q[g][i] * kk[i]"),
    "vla": ("float k[EL];", "float k[EL];\n  float vla[lane + 1];\n  vla[0] = 0.0f;"),
    "double": ("const float p = metal::exp(s - m_new);", "const double p = metal::exp(s - m_new);"),
    "std-call": ("metal::exp(m[g] - m_new)", "std::exp(m[g] - m_new)"),
    "c-library-call": ("metal::exp(m[g] - m_new)", "expf(m[g] - m_new)"),
    "new-delete": ("float k[EL];", "float k[EL];\n  float* heap = new float[EL];\n  delete[] heap;"),
    "recursion": ("const float p = metal::exp(s - m_new);",
                  "auto down = [](auto& self, int n) -> float { return n > 0 ? self(self, n - 1) : 0.0f; };\n"
                  "      const float p = metal::exp(s - m_new) + down(down, 2);"),
    "threadgroup-pointer-unqualified": ("threadgroup float tg_acc[NV * HT * D];",
                                        "threadgroup float tg_acc[NV * HT * D];\nfloat* tg_p = tg_acc;\ntg_p[0] = 0.0f;"),
    "threadgroup-pointer-as-device": ("threadgroup float tg_acc[NV * HT * D];",
                                      "threadgroup float tg_acc[NV * HT * D];\ndevice float* tg_p = tg_acc;\n"
                                      "tg_p[0] = 0.0f;"),
    "device-pointer-unqualified": ("float k[EL];", "float k[EL];\n  const T* k_row = k_pages + row;\n  (void)k_row;"),
    "constant-pointer-unqualified": ("const int window = params[0];",
                                     "const int* pp = params;\nconst int window = pp[0];"),
    "cast-drops-address-space": ("threadgroup float tg_acc[NV * HT * D];",
                                 "threadgroup float tg_acc[NV * HT * D];\nfloat* tg_p = (float*)tg_acc;\n"
                                 "tg_p[0] = 0.0f;"),
    "atomic-64-bit": ("const int chunk = params[1];",
                      "atomic_fetch_add_explicit((device atomic<ulong>*)lse, 1ul, memory_order_relaxed);\n"
                      "const int chunk = params[1];"),
    "bfloat-arithmetic": ("static_cast<float>(k_pages[row + vl + LPK * i])", "k_pages[row + vl + LPK * i] * 1.0f"),
    "bfloat-math": ("static_cast<float>(k_pages[row + vl + LPK * i])", "metal::exp(k_pages[row + vl + LPK * i])"),
}
# Near misses that are valid Metal and must pass (the check is not rejecting every pointer).
ATTENTION_VALID = {
    "threadgroup-pointer-qualified": ("threadgroup float tg_acc[NV * HT * D];",
                                      "threadgroup float tg_acc[NV * HT * D];\nthreadgroup float* tg_p = tg_acc;\n"
                                      "tg_p[0] = 0.0f;"),
    "device-pointer-qualified": ("float k[EL];", "float k[EL];\n  const device T* k_row = k_pages + row;\n  (void)k_row;"),
    "constant-pointer-qualified": ("const int window = params[0];",
                                   "const constant int* pp = params;\nconst int window = pp[0];"),
    "atomic-32-bit": ("const int chunk = params[1];",
                      "atomic_fetch_add_explicit((device atomic_uint*)lse, 1u, memory_order_relaxed);\n"
                      "const int chunk = params[1];"),
}


def planted(old: str, new: str) -> str:
    body = PAGED_ATTENTION.source()
    assert old in body, old
    return body.replace(old, new, 1)


@pytest.mark.parametrize("name", sorted(ATTENTION_PLANTS))
def test_planted_non_metal_construct_fails(name: str, few_variants):
    report = check_spec(PAGED_ATTENTION, planted(*ATTENTION_PLANTS[name]), few_variants)
    assert not report.ok


@pytest.mark.parametrize("name", sorted(ATTENTION_VALID))
def test_planted_valid_metal_passes(name: str, few_variants):
    report = check_spec(PAGED_ATTENTION, planted(*ATTENTION_VALID[name]), few_variants)
    assert report.ok, report.problems


def test_recursion_is_reported_as_recursion(few_variants):
    report = check_spec(PAGED_ATTENTION, planted(*ATTENTION_PLANTS["recursion"]), few_variants)
    assert any(p.startswith("recursion") for p in report.problems), report.problems


def test_call_graph_cycle_detection():
    ci = ('node: { title: "a" label: "k" }\nnode: { title: "b" label: "lambda" }\n'
          'edge: { sourcename: "a" targetname: "b" label: "" }\n')
    assert call_graph_cycles(ci) == []
    assert call_graph_cycles(ci + 'edge: { sourcename: "b" targetname: "b" label: "" }\n') == ["lambda"]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_planted_typo_fails_in_every_kernel(spec: KernelSpec, few_variants):
    body = spec.source()
    assert "const int " in body
    assert not check_spec(spec, body.replace("const int ", "const itn ", 1), few_variants).ok


def test_script_static_mode(tmp_path: Path):
    # `check_kernels.py --static FILE` checks a file named like a shipped kernel with that kernel's
    # signatures and exits non-zero on a problem.
    bad = tmp_path / "paged_merge.metal"
    bad.write_text(PAGED_MERGE.source().replace("const float top_safe", "const double top_safe", 1))
    good = tmp_path / "merge" / "paged_merge.metal"
    good.parent.mkdir()
    good.write_text(PAGED_MERGE.source())
    script = [sys.executable, str(ROOT / "scripts" / "check_kernels.py"), "--static"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([*script, str(good)], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    fail = subprocess.run([*script, str(bad)], capture_output=True, text=True, env=env, timeout=300)
    assert fail.returncode == 1 and "double" in fail.stdout, fail.stdout + fail.stderr
