"""Micro-benchmark: paged decode attention (reference, and Metal where available) vs dense SDPA.

Function level, no model: one decode query per sequence over K/V stored in pages, at 1K, 4K and
16K context, batch 1 and 8. Prints milliseconds per call (median of ``--iters``) and the ratio to
``mx.fast.scaled_dot_product_attention`` over the same K/V already laid out densely. ``--model`` is refused:
the shapes come from ``--kv-heads`` / ``--gqa`` / ``--head-dim`` (SmolLM2-135M: ``--kv-heads 3 --gqa 3
--head-dim 64``); ``scripts/bench_paged.py`` measures paged vs dense decode on a model.

    PYTHONPATH=. python scripts/bench_paged_kernel.py [--contexts 1024 4096 16384] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import random

import mlx.core as mx
from bench_common import (
    check_refused_model,
    ensure_openblas,
    median_ms,
    print_header,
    refuse_model_arg,
)

from mlxkv.kernels.paged_attention_ref import paged_attention_reference

NO_MODEL = ("this benchmark times the attention function alone on random pages; set the shapes with --kv-heads, "
            "--gqa, --head-dim (scripts/bench_paged.py runs a model)")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def build(batch: int, context: int, kv_heads: int, gqa: int, head_dim: int, block_size: int, dtype):
    """Random pages with shuffled block tables, plus the same K/V laid out densely."""
    pages = -(-context // block_size)
    num_blocks = batch * pages + 1  # block 0 is the null block
    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)
    table = mx.array(ids, dtype=mx.int32).reshape(batch, pages)  # (B, pages)
    k_pages = mx.random.normal((kv_heads, num_blocks, block_size, head_dim)).astype(dtype)
    v_pages = mx.random.normal((kv_heads, num_blocks, block_size, head_dim)).astype(dtype)
    q = mx.random.normal((batch, kv_heads * gqa, 1, head_dim)).astype(dtype)
    lens = mx.full((batch,), context, dtype=mx.int32)

    def dense(p):
        d = mx.take(p, table, axis=1).transpose(1, 0, 2, 3, 4)  # (B, KVH, pages, bs, D)
        return mx.contiguous(d.reshape(batch, kv_heads, pages * block_size, head_dim)[:, :, :context])  # (B, KVH, L, D)

    k_dense, v_dense = dense(k_pages), dense(v_pages)
    mx.eval(k_pages, v_pages, q, k_dense, v_dense)
    return q, k_pages, v_pages, table, lens, k_dense, v_dense


def bench_one(batch: int, context: int, args, dtype, metal_attention) -> str:
    """One table row: dense SDPA, the paged reference and (on Metal) the paged kernel."""
    q, kp, vp, table, lens, kd, vd = build(
        batch, context, args.kv_heads, args.gqa, args.head_dim, args.block_size, dtype
    )
    scale = args.head_dim**-0.5
    t_sdpa = median_ms(lambda: mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale), args.iters)
    t_ref = median_ms(lambda: paged_attention_reference(q, kp, vp, table, lens, max_context_len=context), args.iters)
    line = f"{batch:>3} {context:>8} {t_sdpa:>9.2f} {t_ref:>9.2f} {t_ref / t_sdpa:>9.2f}"
    if metal_attention:
        t_metal = median_ms(lambda: metal_attention(q, kp, vp, table, lens, max_context_len=context), args.iters)
        line += f" {t_metal:>9.2f} {t_metal / t_sdpa:>10.2f}"
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--iters", type=int, default=5)
    refuse_model_arg(ap, NO_MODEL)
    args = ap.parse_args()
    check_refused_model(ap, args, NO_MODEL)
    blas = ensure_openblas()
    print_header(blas, "none (function level, random K/V pages)")
    dtype = DTYPES[args.dtype]

    metal_attention = None
    if mx.metal.is_available():
        from mlxkv.kernels import metal

        metal_attention = metal.paged_attention_metal
    print(
        f"device={'metal' if metal_attention else 'cpu'} dtype={args.dtype} kv_heads={args.kv_heads} "
        f"gqa={args.gqa} head_dim={args.head_dim} block_size={args.block_size}"
    )
    print(f"{'B':>3} {'context':>8} {'sdpa ms':>9} {'ref ms':>9} {'ref/sdpa':>9}"
          + (f" {'metal ms':>9} {'metal/sdpa':>10}" if metal_attention else ""))
    for batch in args.batches:
        for context in args.contexts:
            print(bench_one(batch, context, args, dtype, metal_attention), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
