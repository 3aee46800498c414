"""CPU emulator of mlxkv's Metal kernels: a launch's rendered source runs as a C++ program.

The body MLX would compile is wrapped in its generated signature (``render_kernel``), built with
``metal_emulator.h`` (a POSIX thread per Metal thread, barriers for simd_sum and
threadgroup_barrier) and launched over the same grid/threadgroup the factory would use. This
executes the kernels' indexing, online softmax, split-K and merge logic on real data and counts
their SIMD reductions, barriers and exps; it is not a Metal result (no Metal compiler, no GPU
memory model, no speed). Needs g++ (C++17, pthreads; AddressSanitizer for ``sanitize=True``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxkv.kernels.metal import KernelCall, MetalPagedAttention
from mlxkv.kernels.metal_quantized import MetalQuantizedPagedAttention
from mlxkv.kernels.metal_specs import ArgInfo, METAL_ATTRIBUTES, TYPE_NAMES, render_kernel

SHIM = Path(__file__).parent
GXX = shutil.which("g++")


class EmulatorError(RuntimeError):
    """An emulated launch failed (a crash, or AddressSanitizer found an out-of-bounds access)."""


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
NP_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
            mx.uint32: np.uint32}


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
    infos = {n: ArgInfo.of(a) for n, a in call.inputs.items()}
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
        "  // One set of threads runs the threadgroups in turn; a barrier ends each group before the next",
        "  // reuses the threadgroup arrays.",
        "  emu::run_group(threads, [&](int t) {",
        "    const uint lx = uint(t) % tx, ly = (uint(t) / tx) % ty, lz = uint(t) / (tx * ty);",
        "    (void)lx; (void)ly; (void)lz;",
        "    for (uint gz = 0; gz < groups.z; ++gz) for (uint gy = 0; gy < groups.y; ++gy)",
        "    for (uint gx = 0; gx < groups.x; ++gx) {",
        f"      kern<{', '.join(targs)}>({', '.join(args)});",
        "      emu::group_done();",
        "    }",
        "  });",
    ]
    for i, name in enumerate(spec.output_names):
        lines.append(f'  emu::save(dir, "{name}", out{i}, out{i}_size);')
    lines += [
        '  printf("threads=%lu simd_reductions=%lu simd_shuffles=%lu barriers=%lu exps=%lu\\n",',
        "         (unsigned long)(grid.x) * grid.y * grid.z, emu::counts.simd_reductions, emu::counts.simd_shuffles,",
        "         emu::counts.barriers, emu::counts.exps);",
        "  return 0;",
        "}",
    ]
    return kernel + "\n".join(lines) + "\n"


class Emulator:
    """Compiles each distinct program once and runs launches through it.

    ``sanitize=True`` builds with AddressSanitizer: a read or write outside any input, output or
    threadgroup array aborts the launch (inputs are loaded into buffers of exactly their size).
    ``last_counts`` holds the operation counts of the latest launch (all threads together).
    """

    def __init__(self, root: Path, *, sanitize: bool = False):
        self.root, self.binaries, self.launches = root, {}, 0
        self.sanitize = sanitize
        self.last_counts: dict[str, int] = {}

    def launch(self, call: KernelCall) -> list[mx.array]:
        src = program(call)
        key = hashlib.sha1(src.encode()).hexdigest()[:16]
        if key not in self.binaries:
            cpp, exe = self.root / f"{key}.cpp", self.root / key
            cpp.write_text(src)
            extra = ["-fsanitize=address", "-fno-omit-frame-pointer"] if self.sanitize else []
            res = subprocess.run([GXX, "-std=c++17", "-O1", "-pthread", "-Wno-attributes", *extra, "-I", str(SHIM),
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
        env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}  # the program frees nothing before exit
        env.pop("LD_PRELOAD", None)  # a preloaded BLAS would come before ASan's runtime, which refuses to start
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        if res.returncode != 0:
            raise EmulatorError(f"{call.spec.name} exited {res.returncode}: {res.stderr[-3000:]}")
        self.last_counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", res.stdout.splitlines()[-1])}
        return [from_bytes((run_dir / f"{n}.out").read_bytes(), call.output_dtypes[n], call.output_shapes[n])
                for n in call.spec.output_names]


class EmulatedLaunches:
    """Mixin for a Metal pair: its launches go to the CPU emulator instead of mx.fast.metal_kernel."""

    def __init__(self, emulator, *args):
        super().__init__(*args)
        self.emulator = emulator

    def partials(self, *args, **kwargs):
        return tuple(self.emulator.launch(self.partials_call(*args, **kwargs)))  # o_part, lse[, scores]

    def mass(self, *args, **kwargs):
        (mass,) = self.emulator.launch(self.mass_call(*args, **kwargs))
        return mass

    def merge(self, *args):
        (out,) = self.emulator.launch(self.merge_call(*args))
        return out


class EmulatedAttention(EmulatedLaunches, MetalPagedAttention):
    """The Metal pair, emulated: ``EmulatedAttention(emulator, dtype, head_dim, block_size, kv_heads, gqa)``."""


class EmulatedQuantizedAttention(EmulatedLaunches, MetalQuantizedPagedAttention):
    """The quantized Metal pair, emulated (the factory's arguments after ``emulator``)."""
