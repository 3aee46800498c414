"""Decode speed by cache: mlxkv with in-place writes on and off, and mlx-lm's own caches.

Same weights for every side, one process, same BLAS: mlxkv's sides run the model ``mlxkv.models.load`` builds,
mlx-lm's side runs the model ``mlx_lm.utils.load`` builds from the folder bench_common prepares (for a GGUF:
the float32 folder ``mlxkv.gguf.convert(..., dequantize=True)`` writes; with ``--model random`` the same model
object). For each context length each side's caches are filled with one multi-row update of random K/V shaped
by the model's K/V heads and head size (decode work does not depend on the values); then the sides decode
greedily in alternating blocks of ``--block`` steps, ``--rounds`` blocks each, and the median block speed
counts (the machine may be shared: alternation and medians keep the comparison fair). Two decode loops:

- ``ordered`` (the documented engine order): build step n+1 while step n runs, wait for step n, then
  schedule step n+1 — MLX decides buffer donation when a write is *scheduled*, so writes land in place;
- ``eager``: schedule step n+1 before waiting for step n (mlx-lm's generate order): a write scheduled while
  step n still reads the buffer makes MLX copy the whole K/V buffer.

    python scripts/bench_cache.py                      # the reference model; contexts 512, 2048, 8192
    python scripts/bench_cache.py --max-kv-size 1024   # rotating caches (keep 4) instead
    python scripts/bench_cache.py --model random       # a random llama, hidden 768, 8 layers, 12 / 4 KV heads
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    kv_shape,
    load_peer_model,
    print_header,
)

SIDES = ("mlxkv in-place", "mlxkv slice-update", "mlx-lm")


def fill(caches, shape: tuple[int, int], context: int, seed: int) -> None:
    """One update of ``context`` random K/V rows (``shape`` = kv_heads, head_dim) into every layer's cache."""
    import mlx.core as mx

    kv_heads, head_dim = shape
    keys = mx.random.split(mx.random.key(seed), 2 * len(caches))
    for i, c in enumerate(caches):
        k1, k2 = keys[2 * i], keys[2 * i + 1]
        rows = (1, kv_heads, context, head_dim)  # (B, n_kv, L, D)
        mx.eval(c.update_and_fetch(mx.random.normal(rows, key=k1), mx.random.normal(rows, key=k2)))
    mx.eval([c.arrays() if hasattr(c, "arrays") else c.state for c in caches])


def decode_block(model, caches, y, steps: int, ordered: bool):
    """Greedy-decode ``steps`` tokens after the (evaluated) token ``y``; return (tok/s, last token)."""
    import mlx.core as mx

    def step(token):
        return mx.argmax(model(token.reshape(1, 1), cache=caches)[0, -1])

    start = time.perf_counter()
    for _ in range(steps):
        nxt = step(y)
        if ordered:
            y.item()
            mx.async_eval(nxt)
        else:
            mx.async_eval(nxt)
            y.item()
        y = nxt
    y.item()
    return steps / (time.perf_counter() - start), y


def make(side: str, model, max_kv_size):
    from mlx_lm.models import cache as mlx_cache

    from mlxkv.kv.layouts import make_caches

    if side == "mlx-lm":
        if max_kv_size is None:
            return [mlx_cache.KVCache() for _ in model.layers]
        return [mlx_cache.RotatingKVCache(max_kv_size, keep=4) for _ in model.layers]
    os.environ["MLXKV_KV_INPLACE_WRITE"] = "1" if side == "mlxkv in-place" else "0"  # read at construction
    try:
        return make_caches(model, max_kv_size=max_kv_size)
    finally:
        os.environ.pop("MLXKV_KV_INPLACE_WRITE")


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 768, 8 layers, 12 heads / 4 KV heads")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--block", type=int, default=4, help="decode steps per timed block")
    parser.add_argument("--rounds", type=int, default=6, help="timed blocks per side and loop")
    parser.add_argument("--max-kv-size", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None, help="--model random only: vocabulary (16384)")
    return parser, parser.parse_args()


def measure(models: dict, shape, opts) -> dict:
    """``{(ordered, context): {side: median tok/s}}`` with the sides alternating block by block."""
    import mlx.core as mx

    results = {}
    for context in opts.contexts:
        caches = {side: make(side, models[side], opts.max_kv_size) for side in SIDES}
        tokens = {}
        for side in SIDES:
            fill(caches[side], shape, context, seed=context)
            _, tokens[side] = decode_block(models[side], caches[side], mx.array(1), 2, True)  # warm up
        for ordered in (True, False):
            speeds = {side: [] for side in SIDES}
            for _ in range(opts.rounds):
                for side in SIDES:
                    tps, tokens[side] = decode_block(models[side], caches[side], tokens[side], opts.block, ordered)
                    speeds[side].append(tps)
            results[ordered, context] = {s: statistics.median(v) for s, v in speeds.items()}
        del caches
    return results


def report(results: dict, opts) -> None:
    for ordered in (True, False):
        print(f"\n{'ordered' if ordered else 'eager'} loop: decode tok/s, median of {opts.rounds} blocks of "
              f"{opts.block} steps")
        print(f"{'context':>8} " + " ".join(f"{s:>19}" for s in SIDES) + "   in-place/mlx-lm   in-place/off")
        for context in opts.contexts:
            best = results[ordered, context]
            row = " ".join(f"{best[s]:19.2f}" for s in SIDES)
            print(f"{context:>8} {row}   {best[SIDES[0]] / best['mlx-lm']:15.2f}x "
                  f"{best[SIDES[0]] / best[SIDES[1]]:13.2f}x", flush=True)


def main() -> None:
    parser, opts = parse_args()
    blas = ensure_openblas()  # first: it may re-exec the script
    if opts.vocab is not None and (opts.model or "") != "random":
        parser.error("--vocab sizes the random llama: add --model random")
    loaded, folder = bench_model(parser, opts, hidden=768, layers=8, vocab=opts.vocab or 16384, heads=12,
                                 kv_heads=4)
    theirs = load_peer_model(folder, loaded.model)
    print_header(blas, describe(loaded), folder or "the same model object (random weights)")
    shape = kv_shape(loaded.model)
    print(f"{shape[0]} KV heads x head_dim {shape[1]}; caches: "
          f"{'rotating ' + str(opts.max_kv_size) if opts.max_kv_size else 'full'}")
    models = {"mlxkv in-place": loaded.model, "mlxkv slice-update": loaded.model, "mlx-lm": theirs}
    report(measure(models, shape, opts), opts)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
