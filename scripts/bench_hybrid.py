"""Prefix caching on a recurrent hybrid: time to first token with recurrent-state snapshots vs without.

A random-weight hybrid of the test architectures (``--arch qwen3_next``: gated delta-net + attention, or
``nemotron_h``: Mamba-2 + attention), widened to ``--hidden`` and ``--layers``, runs in mlxkv's direct engine over
a paged pool (float32, CPU or Metal). Three workloads, each measured with snapshots (the default) and without
(``enable_block_reuse=False``: what a hybrid got before snapshots, no prefix reuse at all):

* repeated prompt: the same ``--tokens``-token prompt again (median of ``--repeats`` runs after one cold run);
* shared prefix: the same system prompt with a new 32-token question each time (``--state-snapshot-interval``);
* multi-turn: the previous prompt + its answer + a new 32-token question.

TTFT is the engine's prompt time (prefill up to and including the first sampled token). Also reported: the
bytes one snapshot takes, the pool blocks it costs, and KV bytes per cached token.

    python scripts/bench_hybrid.py                       # qwen3_next, hidden 256, 4 layers, 2K-token prompt
    python scripts/bench_hybrid.py --arch nemotron_h --tokens 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit: the test architectures


def widened(arch: str, hidden: int, layers: int) -> dict:
    """The test config of ``arch`` with ``hidden`` width and ``layers`` layers (same layer pattern repeated)."""
    from testkit.archs import get_config

    cfg = get_config(arch)
    scale = hidden // cfg["hidden_size"]
    cfg["hidden_size"] = hidden
    cfg["intermediate_size"] = 2 * hidden
    cfg["num_attention_heads"] *= scale
    cfg["num_key_value_heads"] *= scale
    if arch == "qwen3_next":
        cfg.update(num_hidden_layers=layers, linear_num_value_heads=4 * scale, linear_num_key_heads=2 * scale,
                   shared_expert_intermediate_size=hidden, mlp_only_layers=list(range(layers)))
    else:
        cfg.update(mamba_num_heads=4 * scale, hybrid_override_pattern=("M*-M" * layers)[: layers * 2])
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["qwen3_next", "nemotron_h"], default="qwen3_next")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--state-snapshot-interval", type=int, default=16, help="blocks between prompt snapshots")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    import mlx.core as mx
    from testkit.archs import build_from_config

    from mlxkv.config import KvCacheConfig
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.kv.layouts import install_attention_hook
    from mlxkv.kv.store import CachePool

    model, _ = build_from_config(widened(args.arch, args.hidden, args.layers))
    install_attention_hook(model)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.tokens)]
    params = SamplingParams(max_tokens=8)

    def question(q: int) -> list[int]:
        return [(31 * i + 17 * q) % 1000 + 10 for i in range(32)]

    def measure(reuse: bool) -> dict:
        kv = KvCacheConfig(backend="paged", block_size=args.block_size, kv_cache_budget=1 << 30,
                           enable_block_reuse=reuse, state_snapshot_interval=args.state_snapshot_interval)
        pool = CachePool(model, backend="paged", kv_config=kv, max_sequences=1)
        engine = DirectEngine(model, None, pool=pool)

        def ttft(tokens: list[int]) -> tuple[float, int, list[int]]:
            out = list(engine.generate_tokens(tokens, params))
            return engine.last_stats.prompt_seconds, engine.last_stats.cached_prompt_tokens, out

        cold, _, _ = ttft(prompt)
        rep = [ttft(prompt) for _ in range(args.repeats)]
        shared = [ttft(prompt + question(q)) for q in range(1, args.repeats + 1)]
        turns, conv = [], prompt
        for q in range(args.repeats):
            _, _, answer = ttft(conv)
            conv = conv + answer + question(100 + q)
            turns.append(ttft(conv))
        backend = pool.paged
        return {
            "cold_ms": cold * 1e3,
            "repeated_ms": statistics.median(t for t, _, _ in rep) * 1e3, "repeated_cached": rep[-1][1],
            "shared_prefix_ms": statistics.median(t for t, _, _ in shared) * 1e3, "shared_cached": shared[-1][1],
            "multi_turn_ms": statistics.median(t for t, _, _ in turns) * 1e3, "multi_turn_cached": turns[-1][1],
            "snapshot_bytes": backend.snapshot_bytes, "blocks_per_snapshot": backend.blocks_per_snapshot,
            "kv_bytes_per_token": backend.bytes_per_block / args.block_size,
            "snapshots": backend.snapshot_stats(),
        }

    warm = CachePool(model, backend="paged", kv_config=KvCacheConfig(backend="paged", kv_cache_budget=1 << 26))
    list(DirectEngine(model, None, pool=warm).generate_tokens(prompt[:64], params))  # first-use costs out of the way
    with_snap, without = measure(True), measure(False)
    print(f"{args.arch} hidden {args.hidden}, {args.layers} layers, {args.tokens}-token prompt, "
          f"block {args.block_size}, {mx.default_device()}")
    print(f"snapshot: {with_snap['snapshot_bytes']} bytes = {with_snap['blocks_per_snapshot']} blocks; "
          f"KV {with_snap['kv_bytes_per_token']:.0f} bytes/token; one snapshot per "
          f"{args.state_snapshot_interval * args.block_size} prompt tokens adds "
          f"{with_snap['snapshot_bytes'] / (args.state_snapshot_interval * args.block_size):.0f} bytes/token")
    print(f"{'workload':<16}{'without ms':>12}{'with ms':>10}{'cached':>8}{'speed-up':>10}")
    for name, key, cached in (("cold", "cold_ms", None), ("repeated", "repeated_ms", "repeated_cached"),
                              ("shared prefix", "shared_prefix_ms", "shared_cached"),
                              ("multi-turn", "multi_turn_ms", "multi_turn_cached")):
        a, b = without[key], with_snap[key]
        print(f"{name:<16}{a:>12.1f}{b:>10.1f}{with_snap[cached] if cached else 0:>8}{a / b:>9.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "with": with_snap, "without": without}, indent=1))


if __name__ == "__main__":
    main()
