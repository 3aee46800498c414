"""TTFT of a repeated long prompt through the paged backend: cold vs disk-tier hit vs primary hit.

    python scripts/bench_tier.py [--tokens 2048]                  # the reference model, SmolLM2-135M-Instruct
    python scripts/bench_tier.py --model random [--hidden 512] [--layers 8]   # a random-weight float32 llama

One run each: *cold* prefills the whole prompt; *disk* first fills and then flushes the primary pool with
another prompt (so the first prompt's blocks live only in the disk tier), restores them and prefills the last
tokens; *primary* repeats the prompt while its blocks are still in the pool; *restart* restores from the same
folder into a fresh backend. TTFT = restore + open + prefill of the uncached tokens + first logits, in seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    add_model_args,
    bench_model,
    describe,
    ensure_openblas,
    print_header,
)

PREFILL_CHUNK = 512  # tokens per forward, as the engine prefills


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, random_shape="hidden 512, 8 layers")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    return parser, parser.parse_args()


def ttft(model, be, tokens) -> tuple[float, int]:
    """``(seconds, cached tokens)`` to open ``tokens`` in backend ``be`` and prefill what it did not hold."""
    import mlx.core as mx

    t0 = time.perf_counter()
    caches, seq = be.open(tokens)  # restores from the tier first (the backend's own hook)
    cached = seq.num_cached
    rest = tokens[cached:]
    for i in range(0, len(rest), PREFILL_CHUNK):
        logits = model(mx.array(rest[i:i + PREFILL_CHUNK], dtype=mx.uint32)[None], cache=caches)
        mx.eval(logits)
    dt = time.perf_counter() - t0
    seq.commit()
    be.release(seq)
    return dt, cached


def measure(model, n: int, block: int, vocab: int) -> dict:
    """Every case's ``(seconds, cached tokens)``, the disk tier's bytes and the restarted backend's tier stats."""
    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.paged import PagedBackend

    span = min(vocab - 20, 4000)  # token ids 10 .. span + 9
    prompt = [(7 * i + 3) % span + 10 for i in range(n)]
    other = [(11 * i + 5) % span + 10 for i in range(n + 3 * block)]
    num_blocks = n // block + 4  # the other prompt fills every usable block: all of the first is evicted
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        # The tier comes from the config, as the server's --kv-disk-cache / --kv-disk-cache-size set it.
        config = KvCacheConfig(backend="paged", block_size=block, secondary_disk_dir=folder,
                               secondary_disk_bytes=1 << 34)
        be = PagedBackend(model, config, num_blocks=num_blocks)
        ttft(model, be, other[:64])  # warm-up (kernels, allocator)
        out["cold"] = ttft(model, be, prompt)
        out["primary"] = ttft(model, be, prompt)
        ttft(model, be, other)  # flush the pool: the prompt's blocks go to disk
        out["disk"] = ttft(model, be, prompt)  # restoring evicts the other prompt's blocks: offload cost included
        out["disk_bytes"] = be.tier.tier.disk.nbytes
        be2 = PagedBackend(model, config, num_blocks=num_blocks)  # a restarted process, same folder
        out["restart"] = ttft(model, be2, prompt)  # empty pool, nothing to evict
        out["stats"] = be2.tier_stats()
    return out


def main() -> None:
    parser, args = parse_args()
    blas = ensure_openblas()  # first: it may re-exec the script
    loaded, _ = bench_model(parser, args, hidden=512, layers=8, vocab=4096, peer=False)
    print_header(blas, describe(loaded))
    r = measure(loaded.model, args.tokens, args.block_size, loaded.config["vocab_size"])
    (cold, c0), (primary, c1), (disk, c2), (restart, c3) = r["cold"], r["primary"], r["disk"], r["restart"]
    stats = r["stats"]
    print(f"prompt {args.tokens} tokens, block {args.block_size}; disk tier {r['disk_bytes'] / 2**20:.1f} MiB")
    print(f"cold     {cold * 1e3:8.1f} ms  (cached {c0})")
    print(f"disk hit {disk * 1e3:8.1f} ms  (cached {c2})  cold/disk    = {cold / disk:5.1f}x  "
          "(full pool: includes offloading the evicted blocks)")
    print(f"restart  {restart * 1e3:8.1f} ms  (cached {c3})  cold/restart = {cold / restart:5.1f}x  "
          "(disk hit into an empty pool)")
    print(f"primary  {primary * 1e3:8.1f} ms  (cached {c1})  cold/primary = {cold / primary:5.1f}x  "
          f"disk/primary = {disk / primary:4.1f}x")
    print(f"restarted backend tier_stats: primary_hit_blocks={stats['primary_hit_blocks']} "
          f"secondary_hit_blocks={stats['secondary_hit_blocks']} hits_disk={stats['secondary']['hits_disk']}")


if __name__ == "__main__":
    main()
