"""Decode speed by cache: mlxkv with in-place writes on and off, and mlx-lm's own caches.

Same random-weight float32 llama for every side, one process, same BLAS. For each context length the
caches are filled with one multi-row update of random K/V (decode work does not depend on the values),
then each side decodes ``--steps`` greedy tokens; sides alternate round-robin ``--rounds`` times and the
best round counts. Two decode loops:

- ``ordered`` (the documented engine order): build step n+1 while step n runs, wait for step n, then
  schedule step n+1 — MLX decides buffer donation when a write is *scheduled*, so writes land in place;
- ``eager``: schedule step n+1 before waiting for step n (mlx-lm's generate order): the write is scheduled
  while step n still reads the buffer, so MLX copies the whole K/V buffer every step.

    python scripts/bench_cache.py                 # contexts 512, 2048, 8192, full attention
    python scripts/bench_cache.py --max-kv-size 1024   # rotating caches (keep 4) instead
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ensure_openblas, random_llama  # noqa: E402


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


def decode(model, caches, steps: int, ordered: bool) -> float:
    """Greedy decode ``steps`` tokens; return tok/s."""
    import mlx.core as mx

    def step(y):
        return mx.argmax(model(y.reshape(1, 1), cache=caches)[0, -1])

    y = step(mx.array(1))
    mx.eval(y)
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
    return steps / (time.perf_counter() - start)


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
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
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
    sides = ["mlxkv in-place", "mlxkv slice-update", "mlx-lm"]
    for ordered in (True, False):
        print(f"\n{'ordered' if ordered else 'eager'} loop: decode tok/s (best of {opts.rounds} rounds, "
              f"{opts.steps} steps)")
        print(f"{'context':>8} " + " ".join(f"{s:>19}" for s in sides) + "   in-place/mlx-lm   in-place/off")
        for context in opts.contexts:
            best = {s: 0.0 for s in sides}
            for r in range(opts.rounds):
                for side in sides:  # alternate sides within a round
                    caches = make(side, model, opts.max_kv_size)
                    fill(model, caches, context, seed=context)
                    best[side] = max(best[side], decode(model, caches, opts.steps, ordered))
                    del caches
            row = " ".join(f"{best[s]:19.1f}" for s in sides)
            print(f"{context:>8} {row}   {best[sides[0]] / best['mlx-lm']:15.2f}x "
                  f"{best[sides[0]] / best[sides[1]]:13.2f}x", flush=True)


if __name__ == "__main__":
    main()
