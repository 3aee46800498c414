"""Run the Metal kernel bodies on the CPU through a C++ emulator and compare with the references.

The body MLX would compile is wrapped in its generated signature (``render_kernel``), built with
``tests/metal_shim/metal_emulator.h`` (a POSIX thread per Metal thread, barriers for simd_sum and
threadgroup_barrier) and launched over the same grid/threadgroup the factory would use. This
executes the kernels' indexing, online softmax, split-K and merge logic on real data; it is not
a Metal result (no Metal compiler, no GPU memory model, no speed). Needs g++ (C++17, pthreads).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.kernels.cascade import cascade_attention, find_prefix_groups
from mlxkv.kernels.geometry import TOLERANCES, plan_splits
from mlxkv.kernels.metal import KernelCall, MetalKvWrite, MetalPagedAttention
from mlxkv.kernels.metal_specs import (
    MAX_CONSTANT_ARRAY_SIZE,
    METAL_ATTRIBUTES,
    TYPE_NAMES,
    ArgInfo,
    render_kernel,
)
from mlxkv.kernels.paged_attention_ref import REFERENCE, run_paged_attention
from mlxkv.kernels.selfcheck import (
    check_attention_impl,
    check_kv_write_impl,
    max_abs_error,
    random_paged_case,
)

SHIM = Path(__file__).parent / "metal_shim"
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed (Debian/Ubuntu: apt-get install g++)")

ATTRIBUTE_VALUES = {  # C++ expressions in the launch loop below
    "thread_position_in_grid": "uint3{gx * tx + lx, gy * ty + ly, gz * tz + lz}",
    "thread_position_in_threadgroup": "uint3{lx, ly, lz}",
    "threadgroup_position_in_grid": "uint3{gx, gy, gz}",
    "threads_per_grid": "grid",
    "threads_per_threadgroup": "uint3{tx, ty, tz}",
    "threadgroups_per_grid": "groups",
    "thread_index_in_threadgroup": "uint(t)",
    "thread_index_in_simdgroup": "uint(t % 32)",
    "simdgroup_index_in_threadgroup": "uint(t / 32)",
    "simdgroups_per_threadgroup": "uint(threads / 32)",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
}
NP_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32}


def to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def from_bytes(raw: bytes, dtype: mx.Dtype, shape) -> mx.array:
    arr = mx.array(np.frombuffer(raw, dtype=NP_TYPES[dtype]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == mx.bfloat16 else arr


def program(call: KernelCall) -> str:
    """C++ source: the rendered kernel plus a main() that loads inputs, launches, saves outputs."""
    spec = call.spec
    infos = {n: ArgInfo(a.dtype, scalar=a.ndim == 0, small=a.size < MAX_CONSTANT_ARRAY_SIZE)
             for n, a in call.inputs.items()}
    kernel = render_kernel(spec, infos, call.output_dtypes, call.template,
                           header='#include "metal_emulator.h"', func_name="kern")
    body = spec.source()
    assert not any(n + s in body for n in spec.input_names for s in ("_shape", "_strides", "_ndim"))
    targs = []
    for name, kind in spec.template_params:
        v = call.template[name]
        targs.append(TYPE_NAMES[v] if kind == "typename" else ("true" if v is True else "false")
                     if kind == "bool" else str(int(v)))
    args = []
    lines = [
        "int main(int argc, char** argv) {",
        "  // argv: dir gx gy gz tx ty tz out_bytes...",
        "  const char* dir = argv[1];",
        "  const uint3 grid{uint(atoi(argv[2])), uint(atoi(argv[3])), uint(atoi(argv[4]))};",
        "  const uint tx = uint(atoi(argv[5])), ty = uint(atoi(argv[6])), tz = uint(atoi(argv[7]));",
        "  size_t size = 0;",
    ]
    for i, name in enumerate(spec.input_names):
        ctype = TYPE_NAMES[call.inputs[name].dtype]
        lines.append(f'  unsigned char* in{i} = emu::load(dir, "{name}", &size);')
        ref = "*" if infos[name].scalar else ""
        args.append(f"{ref}reinterpret_cast<const {ctype}*>(in{i})")
    for i, name in enumerate(spec.output_names):
        lines.append(f"  const size_t out{i}_size = size_t(atoll(argv[{8 + i}]));")
        lines.append(f"  unsigned char* out{i} = static_cast<unsigned char*>(malloc(out{i}_size));")
        lines.append(f"  memset(out{i}, 0xFF, out{i}_size);  // unwritten elements read as NaN / -1")
        args.append(f"reinterpret_cast<{TYPE_NAMES[call.output_dtypes[name]]}*>(out{i})")
    for attr in METAL_ATTRIBUTES:
        if attr in body:
            args.append(ATTRIBUTE_VALUES[attr])
    lines += [
        "  if (grid.x % tx || grid.y % ty || grid.z % tz) abort();  // uniform threadgroups only",
        "  const uint3 groups{grid.x / tx, grid.y / ty, grid.z / tz};",
        "  const int threads = int(tx * ty * tz);",
        "  for (uint gz = 0; gz < groups.z; ++gz) for (uint gy = 0; gy < groups.y; ++gy)",
        "  for (uint gx = 0; gx < groups.x; ++gx) {",
        "    emu::run_group(threads, [&](int t) {",
        "      const uint lx = uint(t) % tx, ly = (uint(t) / tx) % ty, lz = uint(t) / (tx * ty);",
        "      (void)lx; (void)ly; (void)lz;",
        f"      kern<{', '.join(targs)}>({', '.join(args)});",
        "    });",
        "  }",
    ]
    for i, name in enumerate(spec.output_names):
        lines.append(f'  emu::save(dir, "{name}", out{i}, out{i}_size);')
    lines += ["  return 0;", "}"]
    return kernel + "\n".join(lines) + "\n"


class Emulator:
    """Compiles each distinct program once per test session and runs launches through it."""

    def __init__(self, root: Path):
        self.root, self.binaries, self.launches = root, {}, 0

    def launch(self, call: KernelCall) -> list[mx.array]:
        src = program(call)
        key = hashlib.sha1(src.encode()).hexdigest()[:16]
        if key not in self.binaries:
            cpp, exe = self.root / f"{key}.cpp", self.root / key
            cpp.write_text(src)
            res = subprocess.run([GXX, "-std=c++17", "-O1", "-pthread", "-Wno-attributes", "-I", str(SHIM),
                                  "-x", "c++", str(cpp), "-o", str(exe)], capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-4000:]
            self.binaries[key] = exe
        self.launches += 1
        run_dir = self.root / f"run{self.launches}"
        run_dir.mkdir()
        mx.eval(*call.inputs.values())
        for name, a in call.inputs.items():
            (run_dir / f"{name}.bin").write_bytes(to_bytes(a))
        sizes = [int(np.prod(call.output_shapes[n])) * call.output_dtypes[n].size for n in call.spec.output_names]
        argv = [str(self.binaries[key]), str(run_dir), *map(str, call.grid), *map(str, call.threadgroup),
                *map(str, sizes)]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return [from_bytes((run_dir / f"{n}.out").read_bytes(), call.output_dtypes[n], call.output_shapes[n])
                for n in call.spec.output_names]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(tmp_path_factory.mktemp("metal_emu"))


class EmulatedAttention(MetalPagedAttention):
    """The Metal pair with launches going to the CPU emulator instead of mx.fast.metal_kernel."""

    def __init__(self, emulator, *args):
        super().__init__(*args)
        self.emulator = emulator

    def partials(self, *args, **kwargs):
        o_part, lse = self.emulator.launch(self.partials_call(*args, **kwargs))
        return o_part, lse

    def merge(self, *args):
        (out,) = self.emulator.launch(self.merge_call(*args))
        return out


class EmulatedKvWrite(MetalKvWrite):
    def __init__(self, emulator, *args):
        super().__init__(*args)
        self.emulator = emulator

    def __call__(self, *args):
        k_out, v_out = self.emulator.launch(self.call(*args))
        return k_out, v_out


CONFIGS = [  # dtype, head_dim, block_size, kv_heads, gqa
    (mx.float32, 64, 16, 2, 4),
    (mx.float16, 128, 32, 1, 8),
    (mx.bfloat16, 64, 16, 2, 1),
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


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_emulated_kv_write_is_exact(emulator, dtype):
    ok, err = check_kv_write_impl(EmulatedKvWrite(emulator, dtype, 64, 2), dtype=dtype, head_dim=64,
                                  block_size=16, kv_heads=2)
    assert ok, err


def test_emulator_catches_a_wrong_body(emulator, monkeypatch):
    # Negative control: an off-by-one page index in the body must be caught by the comparison.
    from mlxkv.kernels import metal_specs

    original = metal_specs.PAGED_ATTENTION
    body = original.source().replace("block_tables[size_t(b) * max_blocks + t / BS]",
                                     "block_tables[size_t(b) * max_blocks + (t + 1) / BS]")
    bad = metal_specs.KernelSpec(original.name, original.source_file, original.input_names,
                                 original.output_names, original.template_params)
    monkeypatch.setattr(type(bad), "source", lambda self: body)
    import mlxkv.kernels.metal as metal_mod

    monkeypatch.setattr(metal_mod, "PAGED_ATTENTION", bad)
    impl = EmulatedAttention(emulator, mx.float32, 64, 16, 2, 4)
    ok, err = check_attention_impl(impl, dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4)
    assert not ok and err > 1e-3
