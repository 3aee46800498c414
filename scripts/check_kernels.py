"""Check every Metal kernel against its pure-MLX reference (on a Mac), or the references against
dense attention (anywhere else). Exit status 0 only if everything matches.

    PYTHONPATH=. python scripts/check_kernels.py [--quick]
    PYTHONPATH=. python scripts/check_kernels.py --static [FILE.metal ...]

--static (any machine with g++): compile kernel bodies against tests/metal_shim/metal_shim.h in the
signature of every variant the factories emit; a FILE named like a shipped kernel
(paged_attention.metal, paged_merge.metal) is checked with that kernel's
signatures; default: the shipped bodies.

On Metal: paged attention (partials + merge, splits 1/2/4, window/chunk/sinks, three dtypes,
head_dim 64/128, block 16/32, GQA 1/4/8), cascade through the Metal pair, and the KV write;
prints max errors and speed vs the reference and vs dense SDPA.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx

from mlxkv.kernels.cascade import cascade_attention, find_prefix_groups
from mlxkv.kernels.geometry import TOLERANCES
from mlxkv.kernels.paged_attention_ref import REFERENCE, run_paged_attention
from mlxkv.kernels.selfcheck import (
    close,
    max_abs_error,
    random_paged_case,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit: the dense oracle
from testkit.kernel_oracle import dense_paged_attention  # noqa: E402

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
OPTIONS = ("none", "window", "chunk", "sinks")


def timed_ms(fn, iters=5) -> float:
    mx.eval(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


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
    """Reference vs gather-then-SDPA (float32 oracle) over the grid."""
    ok = True
    for n, (dtype, D, bs, gqa, option) in enumerate(grid(quick)):
        case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=2, gqa=gqa,
                                 context_lens=[1, 100, 700, 1500], sinks=option == "sinks", seed=n)
        kw = option_kwargs(option, case)
        want = dense_paged_attention(*case.args(), **kw)
        for splits in (1, 2, 4):
            got = run_paged_attention(REFERENCE, *case.args(), num_splits=splits, **kw)
            good = close(got, want, dtype)
            ok &= good
            if not good or splits == 1:
                print(f"ref   {str(dtype):>18} D={D:<3} bs={bs:<2} gqa={gqa} {option:<6} splits={splits} "
                      f"max_err={max_abs_error(got, want):.2e} {'ok' if good else 'MISMATCH'}")
    return ok


def check_metal(quick: bool) -> bool:
    from mlxkv.kernels import metal

    ok = True
    for n, (dtype, D, bs, gqa, option) in enumerate(grid(quick)):
        impl = metal.paged_attention_kernel(dtype, D, bs, 2, gqa)
        if impl is None:
            print(f"metal {dtype} D={D} bs={bs} gqa={gqa}: not covered (reference runs)")
            continue
        case = random_paged_case(dtype=dtype, head_dim=D, block_size=bs, kv_heads=2, gqa=gqa,
                                 context_lens=[1, 100, 700, 3000], sinks=option == "sinks", seed=n)
        kw = option_kwargs(option, case)
        errs, good = [], True
        for splits in (1, 2, 4):
            want = run_paged_attention(REFERENCE, *case.args(), num_splits=splits, **kw)
            got = run_paged_attention(impl, *case.args(), num_splits=splits, **kw)
            good &= close(got, want, dtype)
            errs.append(max_abs_error(got, want))
        ok &= good
        t_metal = timed_ms(partial(run_paged_attention, impl, *case.args(), **kw))
        t_ref = timed_ms(partial(run_paged_attention, REFERENCE, *case.args(), **kw))
        print(f"metal {str(dtype):>18} D={D:<3} bs={bs:<2} gqa={gqa} {option:<6} max_err={max(errs):.2e} "
              f"(tol {TOLERANCES[dtype]:.0e}) {'ok' if good else 'MISMATCH'} "
              f"metal={t_metal:.2f}ms ref={t_ref:.2f}ms")
    # Dense SDPA speed at one long context, for scale.
    for dtype in DTYPES:
        case = random_paged_case(dtype=dtype, head_dim=128, block_size=16, kv_heads=8, gqa=4,
                                 context_lens=[8192] * 4, seed=1)
        impl = metal.paged_attention_kernel(dtype, 128, 16, 8, 4)
        table = case.block_tables[:, :512]
        k = mx.contiguous(mx.take(case.k_pages, table, axis=0).reshape(4, 8192, 8, 128).transpose(0, 2, 1, 3))
        v = mx.contiguous(mx.take(case.v_pages, table, axis=0).reshape(4, 8192, 8, 128).transpose(0, 2, 1, 3))
        t_sdpa = timed_ms(partial(mx.fast.scaled_dot_product_attention, case.queries, k, v, scale=128**-0.5))
        t_metal = timed_ms(partial(run_paged_attention, impl, *case.args()))
        t_ref = timed_ms(partial(run_paged_attention, REFERENCE, *case.args()))
        print(f"speed {str(dtype):>18} B=4 ctx=8192: sdpa={t_sdpa:.2f}ms metal={t_metal:.2f}ms "
              f"({t_metal / t_sdpa:.2f}x) ref={t_ref:.2f}ms ({t_ref / t_sdpa:.2f}x)")
    # Cascade through the Metal pair.
    case = random_paged_case(dtype=mx.float16, head_dim=128, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[500, 400, 300], seed=7)
    table = case.block_tables.tolist()
    for r in (1, 2):
        table[r][:10] = table[0][:10]
    case.block_tables = mx.array(table, dtype=mx.int32)
    groups = find_prefix_groups(table, [500, 400, 300], 16, min_group=2, min_shared_pages=1)
    got = cascade_attention(lambda g: metal.paged_attention_kernel(mx.float16, 128, 16, 2, g) or REFERENCE,
                            *case.args(), groups)
    want = run_paged_attention(REFERENCE, *case.args())
    good = close(got, want, mx.float16)
    ok &= good
    print(f"cascade float16 groups={len(groups)} max_err={max_abs_error(got, want):.2e} {'ok' if good else 'MISMATCH'}")
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
        spec = static_check.spec_for_file(path)
        if spec is None:
            known = ", ".join(s.source_file for s in static_check.ALL_SPECS)
            print(f"{path}: not named like a shipped kernel ({known})")
            return False
        bodies[spec] = path.read_text(encoding="utf-8")
    ok = True
    for report in static_check.check_all(bodies or None):
        ok &= report.ok
        print(f"static {report.spec.source_file}: {report.variants} variants "
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
        ok = check_metal(args.quick)
    else:
        print("Metal is not available here: checking the pure-MLX references against dense attention instead")
        ok = check_references(args.quick)
    print("ALL OK" if ok else "MISMATCHES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
