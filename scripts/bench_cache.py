"""Decode speed by cache: mlxkv with in-place writes on and off, and mlx-lm's own caches.

Same random-weight float32 llama for every side, one process, same BLAS. For each context length each
side's caches are filled with one multi-row update of random K/V (decode work does not depend on the
values); then the sides decode greedily in alternating blocks of ``--block`` steps, ``--rounds`` blocks
each, and the median block speed counts (the machine may be shared: alternation and medians keep the
comparison fair). Two decode loops:

- ``ordered`` (the documented engine order): build step n+1 while step n runs, wait for step n, then
  schedule step n+1 — MLX decides buffer donation when a write is *scheduled*, so writes land in place;
- ``eager``: schedule step n+1 before waiting for step n (mlx-lm's generate order): a write scheduled while
  step n still reads the buffer makes MLX copy the whole K/V buffer.

    python scripts/bench_cache.py                      # contexts 512, 2048, 8192, full attention
    python scripts/bench_cache.py --max-kv-size 1024   # rotating caches (keep 4) instead
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ensure_openblas, random_llama


def fill(model, caches, context: int, seed: int) -> None:
    import mlx.core as mx

    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    keys = mx.random.split(mx.random.key(seed), 2 * len(caches))
    for i, c in enumerate(caches):
        k1, k2 = keys[2 * i], keys[2 * i + 1]
        shape = (1, args.num_key_value_heads, context, head_dim)  # (B, n_kv, L, D)
        mx.eval(c.update_and_fetch(mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2)))
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

    from mlxkv.cache import make_caches

    if side == "mlx-lm":
        if max_kv_size is None:
            return [mlx_cache.KVCache() for _ in model.layers]
        return [mlx_cache.RotatingKVCache(max_kv_size, keep=4) for _ in model.layers]
    os.environ["MLXKV_KV_INPLACE_WRITE"] = "1" if side == "mlxkv in-place" else "0"  # read at construction
    try:
        return make_caches(model, max_kv_size=max_kv_size)
    finally:
        os.environ.pop("MLXKV_KV_INPLACE_WRITE")


def main() -> None:
    blas = ensure_openblas()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--block", type=int, default=4, help="decode steps per timed block")
    parser.add_argument("--rounds", type=int, default=6, help="timed blocks per side and loop")
    parser.add_argument("--max-kv-size", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    opts = parser.parse_args()

    import mlx.core as mx

    from mlxkv.cache import install_attention_hook

    model, params = random_llama(opts.hidden, opts.layers, opts.vocab, heads=12, kv_heads=4)
    install_attention_hook(model)
    print(f"BLAS: {blas}")
    print(f"model: random llama, {params / 1e6:.0f}M params float32, {opts.layers} layers, 4 KV heads x 64; "
          f"mlx {mx.__version__}; caches: {'rotating ' + str(opts.max_kv_size) if opts.max_kv_size else 'full'}")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    sides = ["mlxkv in-place", "mlxkv slice-update", "mlx-lm"]
    results = {}
    for context in opts.contexts:
        caches = {side: make(side, model, opts.max_kv_size) for side in sides}
        tokens = {}
        for side in sides:
            fill(model, caches[side], context, seed=context)
            _, tokens[side] = decode_block(model, caches[side], mx.array(1), 2, True)  # warm up
        for ordered in (True, False):
            speeds = {side: [] for side in sides}
            for _ in range(opts.rounds):
                for side in sides:  # alternate sides block by block
                    tps, tokens[side] = decode_block(model, caches[side], tokens[side], opts.block, ordered)
                    speeds[side].append(tps)
            results[ordered, context] = {s: statistics.median(v) for s, v in speeds.items()}
        del caches
    for ordered in (True, False):
        print(f"\n{'ordered' if ordered else 'eager'} loop: decode tok/s, median of {opts.rounds} blocks of "
              f"{opts.block} steps")
        print(f"{'context':>8} " + " ".join(f"{s:>19}" for s in sides) + "   in-place/mlx-lm   in-place/off")
        for context in opts.contexts:
            best = results[ordered, context]
            row = " ".join(f"{best[s]:19.2f}" for s in sides)
            print(f"{context:>8} {row}   {best[sides[0]] / best['mlx-lm']:15.2f}x "
                  f"{best[sides[0]] / best[sides[1]]:13.2f}x", flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
