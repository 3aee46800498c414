"""TTFT of a repeated long prompt through the paged backend: cold vs disk-tier hit vs primary hit.

    PYTHONPATH=. python scripts/bench_tier.py [--tokens 2048] [--hidden 512] [--layers 8]

One run each, on a random-weight float32 llama: *cold* prefills the whole prompt; *disk* first fills and then
flushes the primary pool with another prompt (so the first prompt's blocks live only in the disk tier),
restores them and prefills the last tokens; *primary* repeats the prompt while its blocks are still in the
pool; *restart* restores from the same folder into a fresh backend. TTFT = restore + open + prefill of the uncached tokens + first logits, in seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ensure_openblas, random_llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    blas = ensure_openblas()

    import mlx.core as mx

    from mlxkv.cache import install_attention_hook
    from mlxkv.config import KvCacheConfig
    from mlxkv.paged import PagedBackend

    model, params = random_llama(args.hidden, args.layers, vocab=4096)
    install_attention_hook(model)
    B, n = args.block_size, args.tokens
    prompt = [(7 * i + 3) % 4000 + 10 for i in range(n)]
    other = [(11 * i + 5) % 4000 + 10 for i in range(n + 3 * B)]
    num_blocks = n // B + 4  # the other prompt fills every usable block: all of the first is evicted

    def ttft(be, tokens) -> tuple[float, int]:
        t0 = time.perf_counter()
        caches, seq = be.open(tokens)  # restores from the tier first (the backend's own hook)
        cached = seq.num_cached
        rest = tokens[cached:]
        for i in range(0, len(rest), 512):  # chunked prefill, as the engine does
            logits = model(mx.array(rest[i:i + 512], dtype=mx.uint32)[None], cache=caches)
            mx.eval(logits)
        dt = time.perf_counter() - t0
        seq.commit()
        be.release(seq)
        return dt, cached

    with tempfile.TemporaryDirectory() as folder:
        # The tier comes from the config, as the server's --kv-disk-cache / --kv-disk-cache-size set it.
        config = KvCacheConfig(backend="paged", block_size=B, secondary_disk_dir=folder,
                               secondary_disk_bytes=1 << 34)
        be = PagedBackend(model, config, num_blocks=num_blocks)
        ttft(be, other[:64])  # warm-up (kernels, allocator)
        cold, c0 = ttft(be, prompt)
        primary, c1 = ttft(be, prompt)
        ttft(be, other)  # flush the pool: the prompt's blocks go to disk
        disk, c2 = ttft(be, prompt)  # restoring evicts the other prompt's blocks: offload cost included
        disk_bytes = be.tier.tier.disk.nbytes
        be2 = PagedBackend(model, config, num_blocks=num_blocks)  # a restarted process, same folder
        restart, c3 = ttft(be2, prompt)  # empty pool, nothing to evict
        stats = be2.tier_stats()
    print(f"model: llama hidden={args.hidden} layers={args.layers} ({params / 1e6:.1f}M params, float32); "
          f"BLAS: {blas}")
    print(f"prompt {n} tokens, block {B}; disk tier {disk_bytes / 2**20:.1f} MiB")
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
