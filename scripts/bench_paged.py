"""Decode tok/s: paged storage (pure-MLX reference paged-attention kernel) vs dense layouts, same model.

No Metal figure is measured here: on this Linux CPU build there is no Metal kernel. A batch-1 step whose pages
are consecutive in the pool (what a fresh pool hands one sequence) runs dense SDPA on a zero-copy view of the
pages; pages in at most 4 runs of consecutive pages (``--runs N``) are attended run by run in place; scattered
pages (``--scattered``) and batches go through the pure-MLX reference kernel (batches of sequences sharing
prefix pages attend to those once, as a view; this benchmark's sequences share nothing).

The caches are filled with random K/V rows to the target context (no prefill, so 16K fits the time budget);
then greedy decode steps run the model, one forward per step, each step evaluated before the next is built
(both sides). The two sides alternate in rounds of a few steps, so machine noise hits both alike; each side's
figure is its median step. Batch 8 uses the batch views (``make_batch_views``): dense = KVBatchView (per-sequence SDPA),
paged = PagedBatchView (one paged_attention call per layer).

    python scripts/bench_paged.py                     # 1K, 4K, 16K context, batch 1 and 8
    python scripts/bench_paged.py --scattered         # the same with no two pages of a sequence adjacent
    python scripts/bench_paged.py --runs 3            # each sequence's pages in 3 runs (a pool that has cycled)
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import ensure_openblas, random_llama

ROUND = 4  # steps per side per round of the interleaved timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scattered", action="store_true",
                        help="fill each sequence one block at a time in turn with a filler sequence, so no two of "
                             "its pages are consecutive in the pool (every step goes through the paged kernel)")
    parser.add_argument("--runs", type=int, default=0,
                        help="fill each sequence in this many pieces in turn with a filler sequence, so its pages "
                             "form that many runs of consecutive pages (what a sequence holds after the pool has "
                             "cycled); batch 1 then attends run by run in place while runs <= 4")
    args = parser.parse_args()
    blas = ensure_openblas()

    import mlx.core as mx

    from mlxkv.cache import make_caches
    from mlxkv.cache.hook import install_attention_hook
    from mlxkv.config import KvCacheConfig
    from mlxkv.engine.batch_view import make_batch_views
    from mlxkv.paged import PagedLayerCache
    from mlxkv.pool import CachePool

    vocab = 4096
    model, n_params = random_llama(args.hidden, args.layers, vocab, heads=8, kv_heads=2)
    install_attention_hook(model)
    head_dim = args.hidden // 8
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    def fill(caches, ctx, seed):
        mx.random.seed(seed)
        for c in caches:
            k = mx.random.normal((1, 2, ctx, head_dim))  # (1, n_kv, ctx, D)
            v = mx.random.normal((1, 2, ctx, head_dim))
            out = c.update_and_fetch(k, v)
            del out
        mx.eval([a for c in caches for a in c.arrays()])

    def stepper(caches_per_seq, step_done):
        """One timed greedy decode step per call (the step is evaluated before the clock stops)."""
        B = len(caches_per_seq)
        state = {"tokens": mx.array([[5]] * B)}  # (B, 1)

        def step() -> float:
            start = time.perf_counter()
            step_done("feed", state["tokens"])
            cache = caches_per_seq[0] if B == 1 else make_batch_views(caches_per_seq)
            logits = model(state["tokens"], cache=cache)[:, -1]  # (B, vocab)
            state["tokens"] = mx.argmax(logits, axis=-1)[:, None].astype(mx.uint32)  # (B, 1)
            mx.eval(state["tokens"])
            step_done("commit", state["tokens"])
            return time.perf_counter() - start

        return step

    def alternate(dense_step, paged_step):
        """Both sides' tok/s from interleaved rounds of a few steps each (machine noise hits both alike)."""
        for _ in range(2):  # warm-up
            dense_step(), paged_step()
        times = {"dense": [], "paged": []}
        for r in range(0, args.steps, ROUND):
            for name, step in (("dense", dense_step), ("paged", paged_step))[:: 1 if r % 2 == 0 else -1]:
                times[name] += [step() for _ in range(min(ROUND, args.steps - r))]
        return statistics.median(times["dense"]), statistics.median(times["paged"])

    layout = "scattered" if args.scattered else f"in {args.runs} runs per sequence" if args.runs > 1 else "as allocated"
    print(f"BLAS: {blas}; random llama float32 hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.0f}M "
          f"params, 8 heads / 2 kv heads, head_dim {head_dim}; block size {args.block_size}; median of "
          f"{args.steps} steps per side, interleaved. Pages {layout}. "
          "No Metal figure is measured here.")
    print(f"{'context':>8s} {'batch':>5s} {'dense tok/s':>12s} {'paged tok/s':>12s} {'paged/dense':>12s}")
    for ctx in contexts:
        for B in batches:
            dense = [make_caches(model) for _ in range(B)]
            for b, caches in enumerate(dense):
                fill(caches, ctx, b)
            blocks = B * (-(-(ctx + args.steps + 4) // args.block_size) + 1) * (2 if args.scattered or args.runs > 1 else 1) + 2
            pool = CachePool(model, backend="paged", num_blocks=blocks, max_sequences=2 * B,
                             kv_config=KvCacheConfig(backend="paged", block_size=args.block_size,
                                                     enable_block_reuse=False))
            seqs = [pool.open(prompt=[7] * ctx) for _ in range(B)]
            for b, seq in enumerate(seqs):
                paged = [c for c in seq.caches if isinstance(c, PagedLayerCache)]
                if not (args.scattered or args.runs > 1):
                    fill(paged, ctx, b)
                else:  # alternate pieces with a filler sequence: the sequence's pages form one run per piece
                    pages = -(-ctx // args.block_size)
                    piece = args.block_size * (1 if args.scattered else -(-pages // args.runs))
                    filler = pool.open(prompt=[7] * ctx)
                    filler_paged = [c for c in filler.caches if isinstance(c, PagedLayerCache)]
                    while paged[0].offset < ctx:
                        n = min(piece, ctx - paged[0].offset)
                        fill(paged, n, b)
                        fill(filler_paged, n, b)
                    pool.release(filler.id)
                seq.commit()

            def paged_hook(what, tokens, seqs=seqs):
                for b, seq in enumerate(seqs):
                    if what == "feed":
                        seq.feed([int(tokens[b, 0].item())])
                    else:
                        seq.commit()

            t_dense, t_paged = alternate(stepper(dense, lambda *_: None), stepper([s.caches for s in seqs], paged_hook))
            dense_tps, paged_tps = B / t_dense, B / t_paged
            for seq in seqs:
                pool.release(seq.id)
            pool.check_invariants()
            del pool, seqs, dense
            print(f"{ctx:8d} {B:5d} {dense_tps:12.1f} {paged_tps:12.1f} {paged_tps / dense_tps:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
