"""Check every Metal kernel against its pure-MLX reference (on a Mac), or the references against
dense attention (anywhere else). Exit status 0 only if everything matches.

    PYTHONPATH=. python scripts/check_kernels.py [--quick]
    PYTHONPATH=. python scripts/check_kernels.py --static [FILE.metal ...]

--static (any machine with g++): compile kernel bodies against tests/metal_shim/metal_shim.h in the
signature of every variant the factories emit; a FILE named like a shipped source is checked with the
signatures of every kernel built from it: paged_attention.metal (the decode body, with each K/V row read),
paged_attention_dense.metal / paged_attention_quantized.metal (a K/V row read, in the shipped decode body),
paged_merge.metal; default: the shipped sources.

On Metal: a markdown report to paste into an issue. One row per attention variant the factories
emit (mlxkv.kernels.variants; --quick: one per emulator class): compile ok, max error vs the
pure-MLX reference over full / sinks / window / chunk and 1-3 splits, and milliseconds of the
kernel, the reference and dense SDPA at a 2K context; then cascade through the kernel pair; then one
row per quantized-pages variant (4/8 bits, group sizes 32/64/128; --quick: one per bits and group size):
max error vs the quantized reference, and milliseconds of the kernel and of mx.quantized_matmul
attention over the same rows; then the attention-mass variants (with_mass=True: the decode kernel writing its
logits, then paged_mass.metal), one row per attention variant at block size 16 (--quick: one emulator class per
head_dim) and one per quantized bits: max error of the output and of the mass vs the reference, and milliseconds
with and without the mass. Elsewhere: the references against dense attention (and the reference's mass against
the second pass of mlxkv/kv/overflow/mass.py).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import mlx.core as mx

from mlxkv.kernels.cascade import cascade_attention, find_prefix_groups
from mlxkv.kernels.geometry import TOLERANCES
from mlxkv.kernels.paged_attention_ref import REFERENCE, run_paged_attention
from mlxkv.kernels.selfcheck import (
    close,
    mass_close,
    max_abs_error,
    random_paged_case,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit: the dense oracle
from testkit.kernel_oracle import dense_attention_mass, dense_paged_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, when loaded from a path
from bench_common import median_ms  # noqa: E402

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
OPTIONS = ("none", "window", "chunk", "sinks")


def timed_ms(fn, iters=5) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls (bench_common's timer)."""
    return median_ms(fn, iters)


def option_kwargs(option: str, case) -> dict:
    return {"window": dict(window=300), "chunk": dict(chunk_size=256), "sinks": dict(sinks=case.sinks)}.get(option, {})


def grid(quick: bool):
    heads = (64, 128)
    blocks = (16, 32)
    gqas = (1, 4, 8)
    if quick:
        return [(d, 128, 16, 4, o) for d in DTYPES for o in OPTIONS]
    return list(itertools.product(DTYPES, heads, blocks, gqas, OPTIONS))


def check_references(quick: bool) -> bool:
    """Reference vs gather-then-SDPA (float32 oracle) over the grid, and its attention mass vs the second score
    pass of mlxkv/kv/overflow/mass.py."""
    ok = True
    for n, (dtype, D, bs, gqa, option) in enumerate(grid(quick)):
        case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=2, gqa=gqa,
                                 context_lens=[1, 100, 700, 1500], sinks=option == "sinks", seed=n)
        kw = option_kwargs(option, case)
        want = dense_paged_attention(*case.args(), **kw)
        want_mass = dense_attention_mass(case.queries, case.k_pages, case.block_tables, case.context_lens, **kw)
        for splits in (1, 2, 4):
            got, mass = run_paged_attention(REFERENCE, *case.args(), num_splits=splits, with_mass=True, **kw)
            good = close(got, want, dtype)
            good_mass = mass_close(mass, want_mass)
            ok &= good and good_mass
            if not (good and good_mass) or splits == 1:
                print(f"ref   {str(dtype):>18} D={D:<3} bs={bs:<2} gqa={gqa} {option:<6} splits={splits} "
                      f"max_err={max_abs_error(got, want):.2e} mass_err={max_abs_error(mass, want_mass):.2e} "
                      f"{'ok' if good and good_mass else 'MISMATCH'}")
    return ok


def _lens(batch: int, ctx: int, bs: int) -> list[int]:
    """Varied context lengths (a page edge, one token, ...) for ``batch`` sequences."""
    pattern = [ctx, 1, ctx // 2 + 1, bs, 3 * bs + 5, ctx - 7, 2, ctx // 3]
    return [max(1, n) for n in (pattern * 2)[:batch]]


def dense_sdpa_ms(case, batch: int, ctx: int, scale: float) -> float:
    """Dense SDPA over the same K/V gathered contiguous (every sequence ``ctx`` long): the speed to beat."""
    kvh, _, bs, D = case.k_pages.shape
    pages = -(-ctx // bs)
    table = case.block_tables[:, :pages]  # (B, pages)
    k = mx.contiguous(mx.take(case.k_pages, table, axis=1).reshape(kvh, batch, pages * bs, D)[:, :, :ctx]
                      .transpose(1, 0, 2, 3))  # (B, kvh, ctx, D)
    v = mx.contiguous(mx.take(case.v_pages, table, axis=1).reshape(kvh, batch, pages * bs, D)[:, :, :ctx]
                      .transpose(1, 0, 2, 3))
    return timed_ms(partial(mx.fast.scaled_dot_product_attention, case.queries, k, v, scale=scale))


def max_errors(run, impl, reference, args, dtype: mx.Dtype, options) -> tuple[list[float], bool]:
    """Max error of ``run(impl, *args, **kw)`` against ``run(reference, ...)`` per ``kw`` in ``options``, and
    whether every one is within the dtype's tolerance (an exception from ``impl`` propagates)."""
    errs, good = [], True
    for kw in options:
        want = run(reference, *args, **kw)
        got = run(impl, *args, **kw)
        good &= close(got, want, dtype)
        errs.append(max_abs_error(got, want))
    return errs, good


def report_rows(chosen, factory, ctx: int):
    """One markdown row per attention variant: compile, max error vs the reference, speeds. Yields (row, ok)."""
    for v in chosen:
        t = v.call.template
        dtype, D, bs, kvh, G = t["T"], t["D"], t["BS"], t["KVH"], t["G"]
        batch = v.call.inputs["context_lens"].shape[0]
        label = f"{str(dtype).split('.')[-1]} D={D} bs={bs} G={G} HT={t['HT']} B={batch}"
        impl = factory(dtype, D, bs, kvh, G)
        if impl is None:
            yield f"| {label} | not covered | | | | | |", False
            continue
        case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=G,
                                 context_lens=_lens(batch, ctx, bs), sinks=True, seed=batch + G)
        try:
            errs, good = max_errors(run_paged_attention, impl, REFERENCE, case.args(), dtype, (
                {"num_splits": 1}, {"sinks": case.sinks, "num_splits": 3},
                {"window": ctx // 3, "num_splits": 2}, {"chunk_size": ctx // 4 + 3}))
        except Exception as exc:  # a compile or launch failure is a result to report
            yield f"| {label} | FAILED: {type(exc).__name__}: {str(exc)[:80]} | | | | | |", False
            continue
        speed = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=G,
                                  context_lens=[ctx] * batch, seed=1)
        scale = D**-0.5
        t_k = timed_ms(partial(run_paged_attention, impl, *speed.args(), scale=scale))
        t_r = timed_ms(partial(run_paged_attention, REFERENCE, *speed.args(), scale=scale))
        t_s = dense_sdpa_ms(speed, batch, ctx, scale)
        verdict = "ok" if good else "MISMATCH"
        yield (f"| {label} | ok | {max(errs):.1e} (tol {TOLERANCES[dtype]:.0e}) {verdict} | {t_k:.3f} | "
               f"{t_r:.3f} | {t_s:.3f} | {t_k / t_s:.2f}x |"), good


def quantized_report_rows(chosen, factory, ctx: int):
    """One markdown row per quantized-pages variant: compile, max error vs the quantized reference, kernel ms and
    ms of ``mx.quantized_matmul`` attention over the same rows gathered densely. Yields (row, ok)."""
    from mlxkv.kernels.quantized_paged_ref import ReferenceQuantizedPagedAttention, run_quantized_paged_attention
    from mlxkv.kernels.selfcheck import quantize_case
    from mlxkv.kv.layouts.dense_attention import attend

    for v in chosen:
        t = v.call.template
        dtype, D, bs, kvh, G, bits, gs = t["T"], t["D"], t["BS"], t["KVH"], t["G"], t["BITS"], t["GS"]
        batch = v.call.inputs["context_lens"].shape[0]
        label = f"{str(dtype).split('.')[-1]} D={D} bits={bits} gs={gs} bs={bs} G={G} B={batch}"
        impl = factory(dtype, D, bs, kvh, G, bits, gs)
        if impl is None:
            yield f"| {label} | not covered | | | |", False
            continue
        reference = ReferenceQuantizedPagedAttention(bits, gs)
        case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=G,
                                 context_lens=_lens(batch, ctx, bs), sinks=True, seed=batch + G)
        args, q = quantize_case(case, bits, gs), dict(bits=bits, group_size=gs)
        try:
            errs, good = max_errors(partial(run_quantized_paged_attention, **q), impl, reference, args, dtype, (
                {"num_splits": 1}, {"sinks": case.sinks, "num_splits": 3}, {"window": ctx // 3}))
        except Exception as exc:  # a compile or launch failure is a result to report
            yield f"| {label} | FAILED: {type(exc).__name__}: {str(exc)[:80]} |  | | |", False
            continue
        speed = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=G,
                                  context_lens=[ctx] * batch, seed=1)
        sargs = quantize_case(speed, bits, gs)
        pages = -(-ctx // bs)
        rows = [tuple(mx.contiguous(mx.take(p, speed.block_tables[:, :pages], axis=1)
                                    .reshape(kvh, batch, pages * bs, -1)[:, :, :ctx].transpose(1, 0, 2, 3))
                      for p in planes) for planes in sargs[1:3]]  # (B, kvh, ctx, w) each
        t_k = timed_ms(partial(run_quantized_paged_attention, impl, *sargs, **q, scale=D**-0.5))
        t_q = timed_ms(partial(attend, speed.queries, *rows, D**-0.5, None, None, **q))
        verdict = "ok" if good else "MISMATCH"
        yield (f"| {label} | ok | {max(errs):.1e} (tol {TOLERANCES[dtype]:.0e}) {verdict} | {t_k:.3f} | "
               f"{t_q:.3f} |"), good


def mass_report_rows(chosen, run, factory, reference, ctx: int, quantize=None):
    """One markdown row per variant of ``chosen`` run with ``with_mass=True``: max error of the output and of the
    mass against ``reference``, kernel ms with and without the mass. ``quantize(case, bits, group_size)``: the
    case's arguments as planes (quantized rows: ``factory`` and ``reference`` take bits and group size too), else
    its pages. Yields (row, ok)."""
    from mlxkv.kernels.selfcheck import mass_close

    for v in chosen:
        t = v.call.template
        dtype, D, bs, kvh, G = t["T"], t["D"], t["BS"], t["KVH"], t["G"]
        quant = (t["BITS"], t["GS"]) if quantize else ()
        batch = v.call.inputs["context_lens"].shape[0]
        label = (f"{str(dtype).split('.')[-1]} D={D} bs={bs} G={G} B={batch}"
                 + (f" bits={quant[0]} gs={quant[1]}" if quant else ""))
        impl = factory(dtype, D, bs, kvh, G, *quant)
        if impl is None:
            yield f"| {label} | not covered | | | |", False
            continue
        case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=G,
                                 context_lens=_lens(batch, ctx, bs), sinks=True, seed=batch + G)
        args = quantize(case, *quant) if quantize else case.args()
        ref = reference(*quant) if quantize else reference
        run_row = partial(run, bits=quant[0], group_size=quant[1]) if quant else run  # quantized: with the planes
        err_out = err_mass = 0.0
        good = True
        try:
            for kw in ({"num_splits": 1}, {"sinks": case.sinks, "num_splits": 3},
                       {"window": ctx // 3, "num_splits": 2}):
                want = run_row(ref, *args, with_mass=True, **kw)
                got = run_row(impl, *args, with_mass=True, **kw)
                good &= close(got[0], want[0], dtype) and mass_close(got[1], want[1])
                err_out = max(err_out, max_abs_error(got[0], want[0]))
                err_mass = max(err_mass, max_abs_error(got[1], want[1]))
        except Exception as exc:  # a compile or launch failure is a result to report
            yield f"| {label} | FAILED: {type(exc).__name__}: {str(exc)[:80]} | | | |", False
            continue
        speed = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=kvh, gqa=G,
                                  context_lens=[ctx] * batch, seed=1)
        sargs = quantize(speed, *quant) if quantize else speed.args()
        t_m = timed_ms(partial(run_row, impl, *sargs, scale=D**-0.5, with_mass=True))
        t_k = timed_ms(partial(run_row, impl, *sargs, scale=D**-0.5))
        verdict = "ok" if good else "MISMATCH"
        yield (f"| {label} | {err_out:.1e} / {err_mass:.1e} {verdict} | {t_m:.3f} | {t_k:.3f} | "
               f"{t_m / t_k:.2f}x |"), good


def mass_rows_for(chosen: list, quick: bool, key) -> list:
    """The variants of ``chosen`` the mass section runs: one per ``key(template)`` when quick, else those at
    block size 16."""
    if not quick:
        return [v for v in chosen if v.call.template["BS"] == 16]
    first = {}
    for v in chosen:
        first.setdefault(key(v.call.template), v)
    return list(first.values())


def quantized_quick(chosen: list) -> list:
    """One variant per (bits, group size): the first at batch 1."""
    out = {}
    for v in chosen:
        t = v.call.template
        if v.call.inputs["context_lens"].shape[0] == 1:
            out.setdefault((t["BITS"], t["GS"]), v)
    return list(out.values())


def metal_report(quick: bool, factory=None, ctx: int = 2048, out=print, quantized_factory=None) -> bool:
    """The markdown report a maintainer pastes into an issue: every attention variant the factories emit
    (``--quick``: one per emulator class), compile / max error / ms vs the reference and dense SDPA, then
    cascade through the kernel pair, then the quantized-pages variants. The factories default to the Metal ones
    (tests pass others; with ``factory`` given and no ``quantized_factory`` the quantized rows are left out)."""
    import platform

    from mlxkv.kernels import metal, metal_quantized, variants

    if factory is None and quantized_factory is None:
        quantized_factory = metal_quantized.quantized_paged_attention_kernel
    factory = factory or metal.paged_attention_kernel
    chosen = variants.emulation_classes() if quick else variants.attention_variants()
    info = mx.metal.device_info() if mx.metal.is_available() else {}
    out("## mlxkv Metal kernel report\n")
    out(f"- machine: {platform.platform()}, {info.get('device_name', 'no Metal device')}; mlx {mx.__version__}")
    out(f"- {len(chosen)} attention variants{' (--quick)' if quick else ''}; context {ctx}; merge kernel "
        "launched by every row (with and without sinks)\n")
    out("| variant | compile | max error vs reference | kernel ms | reference ms | dense SDPA ms | kernel / SDPA |")
    out("| --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for row, good in report_rows(chosen, factory, ctx):
        ok &= good
        out(row)
    # Cascade through the kernel pair.
    case = random_paged_case(dtype=mx.float16, head_dim=128, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[500, 400, 300], seed=7)
    table = case.block_tables.tolist()
    for r in (1, 2):
        table[r][:10] = table[0][:10]
    case.block_tables = mx.array(table, dtype=mx.int32)
    groups = find_prefix_groups(table, [500, 400, 300], 16, min_group=2, min_shared_pages=1)
    got = cascade_attention(lambda g: factory(mx.float16, 128, 16, 2, g) or REFERENCE, *case.args(), groups)
    want = run_paged_attention(REFERENCE, *case.args())
    good = close(got, want, mx.float16)
    ok &= good
    out(f"\ncascade float16 (3 sequences, 10 shared pages): max error {max_abs_error(got, want):.1e} "
        f"{'ok' if good else 'MISMATCH'}")
    if quantized_factory is not None:
        chosen = variants.quantized_attention_variants()
        chosen = quantized_quick(chosen) if quick else chosen
        out(f"\n{len(chosen)} quantized-pages variants; context {ctx}\n")
        out("| variant | compile | max error vs reference | kernel ms | quantized_matmul ms |")
        out("| --- | --- | --- | --- | --- |")
        for row, good in quantized_report_rows(chosen, quantized_factory, ctx):
            ok &= good
            out(row)
    ok &= mass_report(quick, factory, quantized_factory, ctx, out)
    return ok


def mass_report(quick: bool, factory, quantized_factory, ctx: int, out) -> bool:
    """The attention-mass rows of the report (``with_mass=True`` through the kernels against the references)."""
    from mlxkv.kernels import variants
    from mlxkv.kernels.quantized_paged_ref import ReferenceQuantizedPagedAttention, run_quantized_paged_attention
    from mlxkv.kernels.selfcheck import quantize_case

    chosen = mass_rows_for(variants.emulation_classes() if quick else variants.attention_variants(), quick,
                           lambda t: t["D"])
    rows = list(mass_report_rows(chosen, run_paged_attention, factory, REFERENCE, ctx))
    if quantized_factory is not None:
        few = mass_rows_for(variants.quantized_attention_variants(), True, lambda t: t["BITS"])
        rows += list(mass_report_rows(few, run_quantized_paged_attention, quantized_factory,
                                      ReferenceQuantizedPagedAttention, ctx, quantize=quantize_case))
    out(f"\n{len(rows)} attention-mass variants (with_mass=True); context {ctx}\n")
    out("| variant | max error output / mass vs reference | ms with mass | ms without | ratio |")
    out("| --- | --- | --- | --- | --- |")
    ok = True
    for row, good in rows:
        ok &= good
        out(row)
    return ok


def check_static(files: list[str]) -> bool:
    """The static check (tests/metal_shim/static_check.py) over ``files`` or the shipped bodies."""
    from metal_shim import static_check

    if static_check.GXX is None:
        print("the static check needs g++ (Debian/Ubuntu: apt-get install g++)")
        return False
    bodies = {}
    for name in files:
        path = Path(name)
        found = static_check.bodies_for_file(path)
        if not found:
            print(f"{path}: not named like a shipped kernel source ({', '.join(static_check.shipped_names())})")
            return False
        bodies.update(found)
    ok = True
    for report in static_check.check_all(bodies or None):
        ok &= report.ok
        print(f"static {report.spec.name} ({' + '.join(report.spec.files())}): {report.variants} variants "
              f"{'ok' if report.ok else 'FAILED'}")
        for problem in report.problems:
            print(f"  {problem}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one head_dim/block/gqa per dtype and option")
    ap.add_argument("--static", nargs="*", metavar="FILE.metal", default=None,
                    help="static check of kernel bodies with g++ (default: the shipped ones)")
    args = ap.parse_args()
    if args.static is not None:
        ok = check_static(args.static)
        print("STATIC OK" if ok else "STATIC CHECK FAILED")
        return 0 if ok else 1
    if mx.metal.is_available():
        ok = metal_report(args.quick)
    else:
        print("Metal is not available here: checking the pure-MLX references against dense attention instead")
        ok = check_references(args.quick)
    print("ALL OK" if ok else "MISMATCHES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
