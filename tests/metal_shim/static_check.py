"""Static check of Metal kernel bodies with g++ and metal_shim.h (no Metal compiler exists off macOS).

Each body is wrapped in the signature MLX would generate for every variant the factories can emit
(:mod:`mlxkv.kernels.variants`), all of one kernel in one translation unit, and compiled:

- three times with ``-fsyntax-only -pedantic-errors -Werror=vla -Werror=cast-qual``, once per
  address space (device, constant, threadgroup) with that space's qualifier standing as
  ``volatile``, so a pointer that drops or swaps its address space fails to compile;
- once to an object with ``-fcallgraph-info`` (one variant per kernel), whose call graph must have
  no cycle: Metal has no recursion.

What the shim rejects and why is listed at the top of ``metal_shim.h``. Used by
``tests/test_kernels_metal_syntax.py`` and ``scripts/check_kernels.py --static``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.kernels.metal_specs import ALL_SPECS, KernelSpec, render_kernel
from mlxkv.kernels.variants import Variant, all_variants

SHIM = Path(__file__).parent
GXX = shutil.which("g++")
SPACES = ("DEVICE", "CONSTANT", "THREADGROUP")
FLAGS = ["-std=c++17", "-pedantic-errors", "-Werror=vla", "-Wcast-qual", "-Werror=cast-qual",
         "-Wno-attributes", "-I", str(SHIM), "-x", "c++"]


@dataclass(slots=True)
class Report:
    """The outcome for one kernel: the variants checked and the problems found (empty: passed)."""

    spec: KernelSpec
    variants: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def translation_unit(spec: KernelSpec, variants: list[Variant], body: str | None = None) -> str:
    """``spec``'s variants rendered with ``body`` (default: the shipped source) into one C++ source."""
    parts = ['#include "metal_shim.h"']
    for n, v in enumerate(variants):
        parts.append(render_kernel(spec, v.arg_infos(), v.call.output_dtypes, v.call.template, body=body,
                                   func_name=f"{spec.name}_{n}"))
    return "\n".join(parts)


def _errors(stderr: str, limit: int = 6) -> list[str]:
    lines = [ln for ln in stderr.splitlines() if "error" in ln]
    return lines[:limit] or stderr.splitlines()[-limit:]


def _compile(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([GXX, *args], capture_output=True, text=True, timeout=timeout)


def call_graph_cycles(ci_text: str) -> list[str]:
    """Functions on a cycle of a GCC ``-fcallgraph-info`` graph (VCG text)."""
    edges: dict[str, set[str]] = {}
    for src, dst in re.findall(r'edge: \{ sourcename: "([^"]+)" targetname: "([^"]+)"', ci_text):
        edges.setdefault(src, set()).add(dst)
    labels = dict(re.findall(r'node: \{ title: "([^"]+)" label: "([^"\\]+)', ci_text))
    on_cycle = []
    for start in edges:  # tiny graphs: a search from every node is enough
        stack, seen = list(edges[start]), set()
        while stack:
            node = stack.pop()
            if node == start:
                on_cycle.append(labels.get(start, start))
                break
            if node not in seen:
                seen.add(node)
                stack.extend(edges.get(node, ()))
    return on_cycle


def check_spec(spec: KernelSpec, body: str | None = None, variants: list[Variant] | None = None) -> Report:
    """Run every pass for one kernel body over its variants."""
    assert GXX is not None, "the static check needs g++ (Debian/Ubuntu: apt-get install g++)"
    variants = [v for v in (all_variants() if variants is None else variants) if v.spec == spec]
    assert variants, f"no variants for {spec.name}"
    report = Report(spec, len(variants))
    with tempfile.TemporaryDirectory(prefix="mlxkv_static_") as tmp:
        full = Path(tmp) / "all.cpp"
        full.write_text(translation_unit(spec, variants, body))
        one = Path(tmp) / "one.cpp"
        one.write_text(translation_unit(spec, variants[:1], body))
        jobs = {f"address space {s.lower()}": [*FLAGS, "-fsyntax-only", f"-DMLXKV_VOLATILE_{s}", str(full)]
                for s in SPACES}
        jobs["call graph"] = [*FLAGS, "-c", "-O0", "-fcallgraph-info", "-o", str(Path(tmp) / "one.o"), str(one)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = dict(zip(jobs, pool.map(_compile, jobs.values()), strict=True))
        for name, res in results.items():
            if res.returncode != 0:
                report.problems += [f"{name}: {line}" for line in _errors(res.stderr)]
        ci = Path(tmp) / "one.ci"
        if results["call graph"].returncode == 0 and ci.exists():
            report.problems += [f"recursion (Metal has none): {f}" for f in call_graph_cycles(ci.read_text())]
    # A failure shows up once per pass; keep each message once.
    report.problems = list(dict.fromkeys(report.problems))
    return report


def shipped_names() -> list[str]:
    """The names of the shipped sources: bodies, K/V row reads and the score write."""
    return list(dict.fromkeys(f for s in ALL_SPECS for f in s.files()))


def bodies_for_file(path: Path) -> dict[KernelSpec, str]:
    """The full bodies to check for a file named like a shipped source (empty: no such name): every kernel
    generated from that file, with the file's text in place of the shipped one."""
    text = path.read_text(encoding="utf-8")
    return {spec: spec.source({path.name: text}) for spec in ALL_SPECS if path.name in spec.files()}


def check_all(bodies: dict[KernelSpec, str] | None = None) -> list[Report]:
    """Check ``bodies`` (default: every shipped kernel's own source)."""
    bodies = {s: None for s in ALL_SPECS} if bodies is None else bodies
    variants = all_variants()
    return [check_spec(spec, body, variants) for spec, body in bodies.items()]
