"""Quantized KV pages: how many sequences one KV budget holds, and decode speed at 8 clients, unquantized vs 8-bit vs
4-bit pages (``mlxkv serve --kv-bits``).

1. **Fit**: for each configuration, the paged pool ``--kv-cache-budget`` buys (``PagedBackend``'s block count, from
   the probed bytes per block: quantized pages count their packed values, scales and biases) and how many sequences
   of ``--seq-len`` tokens it holds at once (the null block aside).
2. **Decode**: one ``mlxkv serve`` per configuration (same budget, ``--max-sequences`` = ``--clients``), started
   once; round by round (``--rounds``) they take turns, the order rotating each round, so only one is busy at a
   time and a slow patch of this shared machine hits all of them. In a round ``--clients`` clients each stream one
   greedy completion of ``--max-tokens`` tokens for their own prompt (no shared prefix). Reported: aggregate decode
   tok/s (the sum over clients of tokens after the first / time from the first to the last token; the median
   round's) and the ratio to unquantized pages.

    python scripts/bench_kv_bits.py                                  # the reference model (SmolLM2-135M Q4_1)
    python scripts/bench_kv_bits.py --seq-len 512 --max-tokens 16 --rounds 1    # a quick run
    python scripts/bench_kv_bits.py --fit-only --kv-cache-budget 4GiB            # the fit alone (seconds)
    python scripts/bench_kv_bits.py --model path/to/model --kv-cache-budget 1GiB --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import (
    add_model_args,
    ensure_openblas,
    load_bench_model,
    model_spec,
    print_header,
)
from bench_serve import free_port, http_client, start_server, stop_server, write_model

CONFIGS = (None, 8, 4)  # kv_bits: unquantized, 8-bit, 4-bit pages
WORDS = ("river", "lantern", "orbit", "maple", "signal", "harbor", "copper", "meadow", "quartz", "ember")


def label(bits: int | None) -> str:
    return "unquantized" if bits is None else f"{bits}-bit"


def fit(model, budget: int, seq_len: int, block_size: int, group_size: int) -> list[dict]:
    """Blocks and sequences of ``seq_len`` tokens one budget holds, per configuration (no forward but the probe)."""
    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.paged import PagedBackend

    rows = []
    for bits in CONFIGS:
        cfg = KvCacheConfig(backend="paged", block_size=block_size, kv_cache_budget=budget, kv_bits=bits,
                            kv_group_size=group_size)
        be = PagedBackend(model, cfg)
        per_seq = -(-seq_len // block_size)
        rows.append({"kv_bits": bits, "bytes_per_block": be.bytes_per_block, "blocks": be.num_blocks,
                     "sequences": (be.num_blocks - 1) // per_seq})
    return rows


def stream(url: str, prompt: str, max_tokens: int, http) -> tuple[int, float, float]:
    """One streamed greedy completion: (tokens, time of the first, time of the last)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    times = []
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            done = not line.startswith("data: ") or line == "data: [DONE]"
            if not done and any(c.get("text") for c in json.loads(line[6:]).get("choices") or []):
                times.append(time.perf_counter())
    return len(times), times[0], times[-1]


def decode_round(url: str, clients: int, max_tokens: int, round_: int) -> float:
    """Aggregate decode tok/s of ``clients`` concurrent greedy completions (own prompts)."""
    https = [http_client() for _ in range(clients)]
    results: list = [None] * clients

    def client(i: int) -> None:
        words = " ".join(WORDS[(i + j + round_) % len(WORDS)] for j in range(12))
        results[i] = stream(url, f"Story {round_}-{i}: {words}. Once upon a time", max_tokens, https[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in https:
        h.close()
    return sum((n - 1) / (last - first) for n, first, last in results if n > 1 and last > first)


def main() -> None:
    from mlxkv.cli.options import parse_size

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, "hidden 256, 4 layers")
    parser.add_argument("--kv-cache-budget", type=parse_size, default=parse_size("512MiB"), metavar="SIZE",
                        help="the KV budget every configuration gets (default 512MiB)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence for the fit (default 1024)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fit-only", action="store_true", help="only the fit (no servers, no decoding)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    blas = ensure_openblas()
    spec = model_spec(parser, args, 256, 4)
    with tempfile.TemporaryDirectory() as tmp:
        if spec == "random":
            spec = str(write_model(Path(tmp) / "random", args.hidden, args.layers))
        loaded, _ = load_bench_model(spec, dequantize=not args.keep_quantized, peer=False)
        print_header(blas, loaded.name)
        fits = fit(loaded.model, args.kv_cache_budget, args.seq_len, args.block_size, args.group_size)
        base = fits[0]["sequences"]
        print(f"\nfit: --kv-cache-budget {args.kv_cache_budget} bytes, sequences of {args.seq_len} tokens, "
              f"blocks of {args.block_size}")
        for row in fits:
            ratio = row["sequences"] / base if base else float("nan")
            print(f"  {label(row['kv_bits']):>12}: {row['bytes_per_block']:>8} B/block  {row['blocks']:>6} blocks  "
                  f"{row['sequences']:>5} sequences  ({ratio:.2f}x)")
        if args.fit_only:
            if args.json:
                Path(args.json).write_text(json.dumps({"fit": fits, "args": vars(args)}, indent=2))
            return
        extra = ["--dequantize"] if Path(spec).is_file() and not args.keep_quantized else []
        servers = {}
        try:
            for bits in CONFIGS:
                flags = [*extra, "--kv-block-size", str(args.block_size)]
                if bits is not None:
                    flags += ["--kv-bits", str(bits), "--kv-group-size", str(args.group_size)]
                port = free_port()
                servers[bits] = (start_server("mlxkv", spec, port, args.clients, kv_budget=args.kv_cache_budget,
                                              extra=flags), f"http://127.0.0.1:{port}")
            for bits in CONFIGS:  # warm-up: compile and fault in every server's paths once
                decode_round(servers[bits][1], 1, 4, -1)
            rates: dict = {bits: [] for bits in CONFIGS}
            for r in range(args.rounds):
                order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
                for bits in order:
                    rates[bits].append(decode_round(servers[bits][1], args.clients, args.max_tokens, r))
        finally:
            for proc, _ in servers.values():
                stop_server(proc)
    medians = {bits: statistics.median(v) for bits, v in rates.items()}
    print(f"\ndecode: {args.clients} concurrent clients, {args.max_tokens} tokens each, median of {args.rounds} rounds")
    for bits in CONFIGS:
        print(f"  {label(bits):>12}: {medians[bits]:8.1f} tok/s aggregate  ({medians[bits] / medians[None]:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"fit": fits, "decode_tok_s": {label(b): medians[b] for b in CONFIGS},
                                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
