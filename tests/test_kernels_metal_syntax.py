"""Static check of the Metal kernel bodies: compile each, wrapped in the signature MLX would
generate for the factory's real launch arguments, as C++17 against tests/metal_shim/metal_shim.h.

No Metal compiler exists off macOS; this catches syntax errors, undeclared names and type
mismatches (the shim's metal::max rejects mixed types, as Metal does). Needs g++ (Debian: g++).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.kernels.geometry import plan_splits
from mlxkv.kernels.metal import MetalKvWrite, MetalPagedAttention
from mlxkv.kernels.metal_specs import (
    ALL_SPECS,
    MAX_CONSTANT_ARRAY_SIZE,
    PAGED_ATTENTION,
    ArgInfo,
    KernelSpec,
    render_kernel,
)
from mlxkv.kernels.selfcheck import random_paged_case

SHIM = Path(__file__).parent / "metal_shim"
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed (Debian/Ubuntu: apt-get install g++)")

DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def launches(dtype, *, head_dim=64, block_size=16, kv_heads=2, gqa=4, batch=3):
    """The KernelCalls the factories build for one configuration (no kernel runs)."""
    case = random_paged_case(dtype=dtype, head_dim=head_dim, block_size=block_size, kv_heads=kv_heads,
                             gqa=gqa, context_lens=[5, 40, 70][:batch], sinks=True)
    impl = MetalPagedAttention(dtype, head_dim, block_size, kv_heads, gqa)
    plan = plan_splits(70, block_size, num_splits=2)
    attn = impl.partials_call(*case.args(), plan, scale=0.1, window=None, chunk_size=None)
    B, H = len(case.context_lens.tolist()), kv_heads * gqa
    o_part = mx.zeros((B, H, plan.num_splits, head_dim))
    lse = mx.zeros((B, H, plan.num_splits))
    merge = impl.merge_call(o_part, lse, case.sinks, dtype)
    slots = mx.array([17, 40], dtype=mx.int32)
    rows = mx.zeros((2, kv_heads, head_dim), dtype=dtype)
    write = MetalKvWrite(dtype, head_dim, kv_heads).call(case.k_pages, case.v_pages, slots, rows, rows)
    return [attn, merge, write]


def arg_info(a: mx.array) -> ArgInfo:
    return ArgInfo(a.dtype, scalar=a.ndim == 0, small=a.size < MAX_CONSTANT_ARRAY_SIZE)


def translation_unit(spec: KernelSpec, body: str | None = None) -> str:
    """Every dtype (and a couple of shapes) of ``spec``'s launches in one C++ source."""
    parts = ['#include "metal_shim.h"']
    n = 0
    for dtype in DTYPES:
        for shape in (dict(head_dim=64, gqa=4, batch=3), dict(head_dim=128, gqa=8, batch=1)):
            for call in launches(dtype, **shape):
                if call.spec != spec:
                    continue
                parts.append(render_kernel(
                    spec,
                    {name: arg_info(a) for name, a in call.inputs.items()},
                    call.output_dtypes,
                    call.template,
                    body=body,
                    func_name=f"{spec.name}_{n}",
                ))
                n += 1
    assert n > 0
    return "\n".join(parts)


def compile_cpp(source: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "kernel.cpp"
    path.write_text(source)
    return subprocess.run(
        [GXX, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-I", str(SHIM), "-x", "c++", str(path)],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.source_file)
def test_kernel_body_compiles_as_cpp(spec: KernelSpec, tmp_path: Path):
    result = compile_cpp(translation_unit(spec), tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]


def test_signature_matches_launch_arguments():
    # The generated signature declares exactly the spec's inputs, outputs and the attributes used.
    call = launches(mx.float16)[0]
    src = render_kernel(PAGED_ATTENTION, {n: arg_info(a) for n, a in call.inputs.items()},
                        call.output_dtypes, call.template)
    assert "const device float16_t* queries [[buffer(0)]]" in src
    assert "const constant int32_t* context_lens [[buffer(4)]]" in src  # 3 elements < 8
    assert "const constant float& scale [[buffer(6)]]" in src  # 0-d
    assert "device float* lse [[buffer(8)]]" in src
    assert "uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]" in src
    assert "<float16_t, 64, 16, 2, 4, 4>" in src


@pytest.mark.parametrize(
    "old, new",
    [
        ("const float s = simd_sum(dot);", "const float s = simd_sum(dot)"),  # missing semicolon
        ("simd_sum(dot)", "simd_summ(dot)"),  # misspelt builtin
        ("metal::max(m[g], s)", "metal::max(m[g], 0)"),  # float vs int: rejected by Metal too
        ("q[g][i] * k[i]", "q[g][i] * kk[i]"),  # undeclared name
    ],
    ids=["semicolon", "builtin", "mixed-max", "undeclared"],
)
def test_planted_typo_fails(old: str, new: str, tmp_path: Path):
    body = PAGED_ATTENTION.source()
    assert old in body
    result = compile_cpp(translation_unit(PAGED_ATTENTION, body=body.replace(old, new, 1)), tmp_path)
    assert result.returncode != 0


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.source_file)
def test_planted_typo_fails_in_every_kernel(spec: KernelSpec, tmp_path: Path):
    body = spec.source()
    assert "const int " in body
    result = compile_cpp(translation_unit(spec, body=body.replace("const int ", "const itn ", 1)), tmp_path)
    assert result.returncode != 0
