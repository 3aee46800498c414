"""Cascade vs flat paged decode attention with the pure-MLX reference kernels (any machine).

    PYTHONPATH=. python scripts/bench_cascade.py [--iters 7]

B=8 sequences of SmolLM2-135M's attention shape (3 kv heads, GQA 3, head_dim 64), block 16, with and
without sinks, at a few context lengths and shared-prefix fractions. The figures behind
``mlxkv.kernels.cascade.MIN_SHARED_FRACTION``. CPU timings are noisy on a shared machine: compare
ratios, rerun before drawing conclusions.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from bench_common import median_ms

from mlxkv.kernels.cascade import cascade_attention, find_prefix_groups
from mlxkv.kernels.paged_attention_ref import REFERENCE, run_paged_attention
from mlxkv.kernels.selfcheck import max_abs_error, random_paged_case

B, BS, KVH, GQA, D = 8, 16, 3, 3, 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    for sinks in (False, True):
        for L, frac in [(4096, 0.95), (4096, 0.25), (4096, 0.05), (512, 0.95), (512, 0.25)]:
            shared = max(1, int(frac * L) // BS)
            case = random_paged_case(dtype=mx.float32, head_dim=D, block_size=BS, kv_heads=KVH, gqa=GQA,
                                     context_lens=[L] * B, sinks=sinks, seed=0)
            table = case.block_tables.tolist()
            for r in range(1, B):
                table[r][:shared] = table[0][:shared]
            case.block_tables = mx.array(table, dtype=mx.int32)
            groups = find_prefix_groups(table, [L] * B, BS, min_group=2, min_shared_pages=1)
            kw = {"sinks": case.sinks}
            flat = lambda: run_paged_attention(REFERENCE, *case.args(), **kw)  # noqa: E731
            casc = lambda: cascade_attention(lambda g: REFERENCE, *case.args(), groups, **kw)  # noqa: E731
            t_flat, t_casc = median_ms(flat, args.iters), median_ms(casc, args.iters)
            print(f"B={B} L={L:<5} shared={frac:>4.0%} sinks={sinks!s:<5} flat {t_flat:7.2f} ms  "
                  f"cascade {t_casc:7.2f} ms  ({t_flat / t_casc:.2f}x)  max|diff|={max_abs_error(flat(), casc()):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
