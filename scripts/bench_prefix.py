"""Shared-prefix workload: time to first token with and without prefix caching, and sequences per KV budget.

Workload: ``--groups`` groups of ``--requests`` prompts; the prompts of a group share a ``--system``-token
system prompt and differ in a ``--user``-token tail (scaled to a 2-core CPU by default). Every request is
prefilled and yields one token (TTFT = prefill + first sample). Sides, in one process under one BLAS:

- dense: mlxkv's dense layouts, each request prefilled in full (no prefix reuse).
- paged, no reuse: paged storage with ``enable_block_reuse=False``.
- paged + prefix cache: the second and later requests of a group prefill only their tail.
- mlx-lm prompt cache: the system prompt prefilled once per group into mlx-lm caches, ``copy.deepcopy``'d per
  request, the tail prefilled on the copy (the first request of a group pays the system prefill). It runs the
  model ``mlx_lm.utils.load`` builds from the folder bench_common prepares (for a GGUF: the float32 folder
  ``mlxkv.gguf.convert(..., dequantize=True)`` writes), the same weights as mlxkv's sides.

Capacity: how many sequences of this workload (prompt + ``--gen`` tokens) fit one KV budget. Dense reserves
``--max-context`` rows per sequence, as a dense server must; paged takes blocks as used, the shared system
prompt's blocks once per group (measured with the real block manager, opening sequences until it refuses).

    python scripts/bench_prefix.py                    # the reference model, SmolLM2-135M-Instruct
    python scripts/bench_prefix.py --model random     # a random llama, hidden 256, 4 layers, 8 / 2 KV heads
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from bench_common import (
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    load_peer_model,
    print_header,
)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 256, 4 layers, 8 heads / 2 KV heads")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--user", type=int, default=64)
    parser.add_argument("--gen", type=int, default=256, help="tokens generated per sequence (capacity)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=4096, help="dense: rows reserved per sequence")
    parser.add_argument("--budget-mib", type=int, default=1024)
    return parser, parser.parse_args()


def workload(args, vocab: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """``(system prompts, [(group, prompt)])``: requests interleave the groups (g0 g1 g2 g0 g1 g2 ...)."""
    systems = [[(37 * i + 101 * g + 11) % (vocab - 10) + 5 for i in range(args.system)] for g in range(args.groups)]
    requests = [(g, systems[g] + [(13 * i + 7 * r + 3 * g + 1) % (vocab - 10) + 5 for i in range(args.user)])
                for r in range(args.requests) for g in range(args.groups)]
    return systems, requests


def ttft_sides(model, theirs, args, systems, requests) -> dict:
    """Each side as ``name -> callable`` returning the TTFT of every request, in order."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.config import KvCacheConfig
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.kv.store import CachePool

    one = SamplingParams(max_tokens=1)
    blocks_needed = args.groups * args.requests * -(-(args.system + args.user + 8) // args.block_size) + 8

    def ttft(engine, prompt):
        start = time.perf_counter()
        list(engine.generate_tokens(prompt, one))
        return time.perf_counter() - start

    def run_engine(pool):
        engine = DirectEngine(model, None, pool=pool)
        ttft(engine, requests[0][1][: args.user])  # warm-up on unrelated tokens
        return [ttft(engine, p) for _, p in requests]

    def run_mlx_lm():
        base = {}
        times = []
        for g, prompt in requests:
            start = time.perf_counter()
            if g not in base:
                base[g] = make_prompt_cache(theirs)
                mx.eval(theirs(mx.array(systems[g])[None], cache=base[g]))
                mx.eval([c.state for c in base[g]])
            cache = copy.deepcopy(base[g])
            steps = generate_step(mx.array(prompt[args.system:]), theirs, max_tokens=1, prompt_cache=cache)
            next(steps)
            times.append(time.perf_counter() - start)
        return times

    def paged(reuse: bool):
        config = KvCacheConfig(backend="paged", block_size=args.block_size, enable_block_reuse=reuse)
        return CachePool(model, backend="paged", num_blocks=blocks_needed, kv_config=config)

    return {
        "dense (mlxkv layouts, no reuse)": lambda: run_engine(CachePool(model, max_sequences=1)),
        "paged, no prefix reuse": lambda: run_engine(paged(False)),
        "paged + prefix cache": lambda: run_engine(paged(True)),
        "mlx-lm prompt cache (deepcopy)": run_mlx_lm,
    }


def report_ttft(sides: dict, groups: int) -> None:
    """Run every side once and print its mean TTFT (all, first of a group, later ones), then the ratios."""
    print(f"{'side':34s} {'mean TTFT':>10s} {'first/group':>12s} {'later':>10s}")
    results = {}
    for name, run in sides.items():
        t = run()
        first, later = t[:groups], t[groups:]
        results[name] = statistics.mean(t)
        print(f"{name:34s} {statistics.mean(t) * 1e3:8.1f}ms {statistics.mean(first) * 1e3:10.1f}ms "
              f"{statistics.mean(later) * 1e3 if later else float('nan'):8.1f}ms", flush=True)
    base = results["dense (mlxkv layouts, no reuse)"]
    for name, v in results.items():
        print(f"  {name}: mean TTFT x{base / v:.2f} vs dense")


def fit_paged(args, systems, vocab: int, num_blocks: int) -> int:
    """Sequences of this workload the real block manager admits in ``num_blocks`` blocks, sharing prefixes."""
    from mlxkv.kv.blocks import KVCacheManager

    manager = KVCacheManager(num_blocks, args.block_size)
    fit = 0
    while True:
        g, r = fit % args.groups, fit // args.groups
        prompt = systems[g] + [(17 * i + 5 * r + g) % (vocab - 10) + 5 for i in range(args.user)]
        res = manager.open(prompt)
        ok = manager.allocate_slots(res.seq_id) is not None
        if ok:
            manager.commit(res.seq_id)
            for k in range(args.gen):
                if manager.allocate_slots(res.seq_id, token_ids=[k % 100 + 3]) is None:
                    ok = False
                    break
                manager.commit(res.seq_id)
        if not ok:
            manager.free(res.seq_id)
            break
        fit += 1
    manager.check_invariants()
    return fit


def report_capacity(model, args, systems, vocab: int) -> None:
    """Sequences per KV budget: dense reservations, paged without sharing, paged sharing the system prompts."""
    from mlxkv.kv.paged import probe_block_bytes

    bytes_per_block = sum(probe_block_bytes(model, args.block_size))
    bytes_per_token = bytes_per_block // args.block_size
    budget = args.budget_mib << 20
    dense_fit = budget // (args.max_context * bytes_per_token)
    fit = fit_paged(args, systems, vocab, budget // bytes_per_block)
    prompt_len = args.system + args.user
    unshared = budget // (-(-(prompt_len + args.gen) // args.block_size) * bytes_per_block)
    print(f"\nKV budget {args.budget_mib} MiB, {bytes_per_token} B/token, sequences of {prompt_len} + {args.gen} "
          "tokens:")
    print(f"  dense (reserves {args.max_context} rows each): {dense_fit} sequences")
    print(f"  paged, blocks as used, no sharing:        {unshared} sequences")
    print(f"  paged + shared system prompt ({args.groups} groups): {fit} sequences "
          f"(x{fit / max(dense_fit, 1):.1f} vs dense)")


def main() -> None:
    parser, args = parse_args()
    blas = ensure_openblas()  # first: it may re-exec the script
    loaded, folder = bench_model(parser, args, hidden=256, layers=4, vocab=8192, heads=8, kv_heads=2)
    theirs = load_peer_model(folder, loaded.model)
    print_header(blas, describe(loaded), folder or "the same model object (random weights)")
    vocab = loaded.config["vocab_size"]
    systems, requests = workload(args, vocab)
    print(f"{args.groups} groups x {args.requests} requests, system {args.system} + user {args.user} tokens")
    report_ttft(ttft_sides(loaded.model, theirs, args, systems, requests), args.groups)
    report_capacity(loaded.model, args, systems, vocab)


if __name__ == "__main__":
    main()
