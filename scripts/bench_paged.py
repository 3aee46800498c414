"""Decode tok/s: paged storage (pure-MLX reference paged-attention kernel) vs dense layouts, same model.

No Metal figure is measured here: on this Linux CPU build there is no Metal kernel. A batch-1 step whose pages
are consecutive in the pool (what a fresh pool hands one sequence) runs dense SDPA on a zero-copy view of the
pages; pages in at most 4 runs of consecutive pages (``--runs N``) are attended run by run in place; scattered
pages (``--scattered``) and batches go through the pure-MLX reference kernel (batches of sequences sharing
prefix pages attend to those once, as a view; this benchmark's sequences share nothing).

The caches are filled with random K/V rows to the target context (no prefill, so 16K fits the time budget),
shaped by the model's own K/V heads and head size; then greedy decode steps run the model, one forward per
step, each step evaluated before the next is built (both sides). The two sides alternate in rounds of a few
steps, so machine noise hits both alike; each side's figure is its median step. Batch 8 uses the batch views
(``make_batch_views``): dense = KVBatchView (per-sequence SDPA), paged = PagedBatchView (one paged_attention
call per layer). A context past the model's trained positions still measures speed (the K/V are random);
a (context, batch) whose K/V would not fit the available memory is skipped.

    python scripts/bench_paged.py                     # the reference model: 1K, 4K, 16K context, batch 1 and 8
    python scripts/bench_paged.py --scattered         # the same with no two pages of a sequence adjacent
    python scripts/bench_paged.py --runs 3            # each sequence's pages in 3 runs (a pool that has cycled)
    python scripts/bench_paged.py --model random      # a random llama, hidden 256, 4 layers, 8 / 2 KV heads
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_common import (
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    kv_shape,
    print_header,
)

ROUND = 4  # steps per side per round of the interleaved timing
MEMORY_SHARE = 0.8  # of the available memory the K/V of one (context, batch) may take


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 256, 4 layers, 8 heads / 2 KV heads")
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
    return parser, parser.parse_args()


class Bench:
    """One model's dense and paged decode steps over random-filled caches."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.kv_heads, self.head_dim = kv_shape(model)
        self.layers = len(model.layers)
        self.split = args.scattered or args.runs > 1  # a filler sequence interleaves with each sequence

    def token_bytes(self) -> int:
        """K/V bytes one token takes over all layers (float32 rows)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 4

    def blocks(self, ctx: int, batch: int) -> int:
        """Pool blocks for ``batch`` sequences of ``ctx`` rows plus the decode steps (and the fillers)."""
        per_seq = -(-(ctx + self.args.steps + 4) // self.args.block_size) + 1
        return batch * per_seq * (2 if self.split else 1) + 2

    def fits(self, ctx: int, batch: int) -> bool:
        """Whether both sides' K/V for this row fit :data:`MEMORY_SHARE` of the available memory."""
        dense = batch * ctx * self.token_bytes()
        paged = self.blocks(ctx, batch) * self.args.block_size * self.token_bytes()
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return dense + paged <= MEMORY_SHARE * available

    def fill(self, caches, ctx: int, seed: int) -> None:
        """Append ``ctx`` random K/V rows to every layer's cache."""
        import mlx.core as mx

        mx.random.seed(seed)
        for c in caches:
            k = mx.random.normal((1, self.kv_heads, ctx, self.head_dim))  # (1, n_kv, ctx, D)
            v = mx.random.normal((1, self.kv_heads, ctx, self.head_dim))
            c.update_and_fetch(k, v)  # the returned views are dropped at once: nothing holds the buffers
        mx.eval([a for c in caches for a in c.arrays()])

    def stepper(self, caches_per_seq, step_done):
        """One timed greedy decode step per call (the step is evaluated before the clock stops)."""
        import mlx.core as mx

        from mlxkv.kv.batching import make_batch_views

        B = len(caches_per_seq)
        state = {"tokens": mx.array([[5]] * B)}  # (B, 1)

        def step() -> float:
            start = time.perf_counter()
            step_done("feed", state["tokens"])
            cache = caches_per_seq[0] if B == 1 else make_batch_views(caches_per_seq)
            logits = self.model(state["tokens"], cache=cache)[:, -1]  # (B, vocab)
            state["tokens"] = mx.argmax(logits, axis=-1)[:, None].astype(mx.uint32)  # (B, 1)
            mx.eval(state["tokens"])
            step_done("commit", state["tokens"])
            return time.perf_counter() - start

        return step

    def alternate(self, dense_step, paged_step) -> tuple[float, float]:
        """Both sides' median step from interleaved rounds of a few steps each (machine noise hits both)."""
        for _ in range(2):  # warm-up
            dense_step(), paged_step()
        times = {"dense": [], "paged": []}
        steps = self.args.steps
        for r in range(0, steps, ROUND):
            for name, step in (("dense", dense_step), ("paged", paged_step))[:: 1 if r % 2 == 0 else -1]:
                times[name] += [step() for _ in range(min(ROUND, steps - r))]
        return statistics.median(times["dense"]), statistics.median(times["paged"])

    def paged_sequences(self, pool, ctx: int, batch: int) -> list:
        """``batch`` pool sequences holding ``ctx`` random rows each, laid out as the options ask."""
        from mlxkv.kv.paged import PagedLayerCache

        args = self.args
        seqs = [pool.open(prompt=[7] * ctx) for _ in range(batch)]
        for b, seq in enumerate(seqs):
            paged = [c for c in seq.caches if isinstance(c, PagedLayerCache)]
            if not self.split:
                self.fill(paged, ctx, b)
            else:  # alternate pieces with a filler sequence: the sequence's pages form one run per piece
                pages = -(-ctx // args.block_size)
                piece = args.block_size * (1 if args.scattered else -(-pages // args.runs))
                filler = pool.open(prompt=[7] * ctx)
                filler_paged = [c for c in filler.caches if isinstance(c, PagedLayerCache)]
                while paged[0].offset < ctx:
                    n = min(piece, ctx - paged[0].offset)
                    self.fill(paged, n, b)
                    self.fill(filler_paged, n, b)
                pool.release(filler.id)
            seq.commit()
        return seqs

    def row(self, ctx: int, batch: int) -> tuple[float, float]:
        """``(dense tok/s, paged tok/s)`` at one context and batch."""
        from mlxkv.config import KvCacheConfig
        from mlxkv.kv.layouts import make_caches
        from mlxkv.kv.store import CachePool

        dense = [make_caches(self.model) for _ in range(batch)]
        for b, caches in enumerate(dense):
            self.fill(caches, ctx, b)
        config = KvCacheConfig(backend="paged", block_size=self.args.block_size, enable_block_reuse=False)
        pool = CachePool(self.model, backend="paged", num_blocks=self.blocks(ctx, batch), max_sequences=2 * batch,
                         kv_config=config)
        seqs = self.paged_sequences(pool, ctx, batch)

        def paged_hook(what, tokens):
            for b, seq in enumerate(seqs):
                if what == "feed":
                    seq.feed([int(tokens[b, 0].item())])
                else:
                    seq.commit()

        t_dense, t_paged = self.alternate(self.stepper(dense, lambda *_: None),
                                          self.stepper([s.caches for s in seqs], paged_hook))
        for seq in seqs:
            pool.release(seq.id)
        pool.check_invariants()
        return batch / t_dense, batch / t_paged


def main() -> None:
    parser, args = parse_args()
    blas = ensure_openblas()  # first: it may re-exec the script
    loaded, _ = bench_model(parser, args, hidden=256, layers=4, vocab=4096, heads=8, kv_heads=2,
                            peer=False)
    bench = Bench(loaded.model, args)
    print_header(blas, describe(loaded))
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    trained = loaded.config.get("max_position_embeddings")
    layout = "scattered" if args.scattered else f"in {args.runs} runs per sequence" if args.runs > 1 else "as allocated"
    print(f"{bench.kv_heads} KV heads x head_dim {bench.head_dim}, {bench.layers} layers, "
          f"{bench.token_bytes()} B of K/V per token; block size {args.block_size}; median of {args.steps} steps "
          f"per side, interleaved. Pages {layout}. No Metal figure is measured here.")
    if trained and max(contexts) > trained:
        print(f"note: contexts past the model's {trained} trained positions measure speed only (random K/V)")
    print(f"{'context':>8s} {'batch':>5s} {'dense tok/s':>12s} {'paged tok/s':>12s} {'paged/dense':>12s}")
    for ctx in contexts:
        for B in batches:
            if not bench.fits(ctx, B):
                print(f"{ctx:8d} {B:5d}   skipped: the K/V of both sides would not fit the available memory")
                continue
            dense_tps, paged_tps = bench.row(ctx, B)
            print(f"{ctx:8d} {B:5d} {dense_tps:12.1f} {paged_tps:12.1f} {paged_tps / dense_tps:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
