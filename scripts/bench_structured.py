"""Constrained decoding's cost in ``mlxkv serve``: decode tok/s of a batch of concurrent requests with and without a
``json_schema`` ``response_format``, and what the first constrained request of a server pays.

One ``mlxkv serve`` subprocess (the reference model SmolLM2-135M-Instruct, ``--dequantize``: float32 on the CPU
backend, OpenBLAS preloaded) serves every round. A round sends ``--batch`` (8) streamed chat requests at once, all
with the same prompt, greedy, ``--max-tokens`` each; rounds alternate free / constrained (``--rounds`` of each), so
a slow patch of this shared machine hits both. The token counts are made equal without touching the free requests'
sampling (a logit bias or a penalty would take them off the batch's shared-argmax fast path, hiding part of the
cost): the prompt asks for a long list the model writes on past ``--max-tokens``, and the schema is an object
holding an array of at least 500 integers, a document that cannot be complete (so EOS is never allowed) before
``--max-tokens``; the script checks that every request generated exactly ``--max-tokens`` tokens and says so.

Decode tok/s: the server's own time per output token (``mlxkv_time_per_output_token_seconds`` from ``/metrics``:
a request's time from its first to its last token over its tokens after the first), averaged over a round's
requests, as ``batch / mean time per output token``; medians over rounds; the ratio constrained / free.

Before the rounds, the server's first constrained request (it builds llguidance's view of the 49K-token vocabulary)
is sent while a free request streams: reported are that request's time to first token, the same for the next
constrained request (vocabulary built), and the longest gap between the free stream's tokens meanwhile.

    python scripts/bench_structured.py                     # 8 requests, 48 tokens, 2 rounds of each
    python scripts/bench_structured.py --batch 8 --max-tokens 96 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import default_model, ensure_openblas  # noqa: E402
from bench_serve import free_port, http_client, start_server, stop_server  # noqa: E402

PROMPT = "Write the whole numbers from 1 to 500 as a JSON object: {\"numbers\": [1, 2, 3, ...]}."
SCHEMA = {"type": "object", "properties": {"numbers": {"type": "array", "minItems": 500, "items": {
    "type": "integer", "minimum": 0, "maximum": 999}}}, "required": ["numbers"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA, "strict": True}}
TPOT = "mlxkv_time_per_output_token_seconds"


def body(max_tokens: int, constrained: bool, prompt: str = PROMPT) -> dict:
    out = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
           "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        out["response_format"] = FORMAT
    return out


def stream(url: str, payload: dict, arrivals: list[float] | None = None) -> tuple[float, int]:
    """Stream one chat completion: (seconds to the first content, completion tokens); content arrival times are
    appended to ``arrivals``."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    with http_client() as http, http.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in data.get("choices") or ()):
                now = time.perf_counter()
                ttft = now - start if ttft is None else ttft
                if arrivals is not None:
                    arrivals.append(now)
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


def tpot_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's time-per-output-token histogram."""
    import httpx

    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(TPOT + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(TPOT + "_count"):
            count = float(line.split()[-1])
    return total, count


def one_round(url: str, batch: int, max_tokens: int, constrained: bool) -> dict:
    """``batch`` requests at once; the round's decode tok/s from the server's time per output token."""
    before = tpot_totals(url)
    results: list[tuple[float, int]] = [(0.0, 0)] * batch

    def run(i: int) -> None:
        results[i] = stream(url, body(max_tokens, constrained))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = tpot_totals(url)
    mean_tpot = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return {"constrained": constrained, "tokens": [n for _, n in results], "wall_s": wall,
            "mean_tpot_s": mean_tpot, "decode_tok_s": batch / mean_tpot if mean_tpot else 0.0,
            "ttft_p50_s": statistics.median(t for t, _ in results)}


def first_constrained(url: str, max_tokens: int) -> dict:
    """The server's first constrained request, sent while a free request streams."""
    arrivals: list[float] = []
    free = threading.Thread(target=stream, args=(url, body(max_tokens, False, "Tell me a long story."), arrivals))
    free.start()
    while len(arrivals) < 4:  # the free stream is decoding
        time.sleep(0.01)
    sent = time.perf_counter()
    cold, _ = stream(url, body(4, True))
    warm, _ = stream(url, body(4, True))
    free.join()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= sent]
    return {"cold_ttft_s": cold, "warm_ttft_s": warm, "free_gap_median_s": statistics.median(gaps),
            "free_gap_max_while_building_s": max(during) if during else 0.0}


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model(), help="GGUF file or model folder (default: SmolLM2)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests per round")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind, alternating")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    blas = ensure_openblas()
    print(f"model {args.model}; BLAS {blas}; load average {load_average()} (1, 5, 15 min; {os.cpu_count()} CPUs)")
    port = free_port()
    proc = start_server("mlxkv", args.model, port, args.batch, extra=["--dequantize"])
    url = f"http://127.0.0.1:{port}"
    try:
        first = first_constrained(url, 48)
        print(f"first constrained request: TTFT {first['cold_ttft_s']:.2f} s (vocabulary built), next one "
              f"{first['warm_ttft_s']:.2f} s; a free stream's token gap: median {first['free_gap_median_s']:.2f} s, "
              f"longest while the vocabulary was built {first['free_gap_max_while_building_s']:.2f} s")
        stream(url, body(args.max_tokens, False))  # warm-up: compiled kernels, the prompt's prefix cached
        rounds = [one_round(url, args.batch, args.max_tokens, constrained=k % 2 == 1) for k in range(2 * args.rounds)]
    finally:
        stop_server(proc)
    for r in rounds:
        equal = all(n == args.max_tokens for n in r["tokens"])
        print(f"{'json_schema' if r['constrained'] else 'free':>11}: decode {r['decode_tok_s']:.2f} tok/s "
              f"(mean time per output token {r['mean_tpot_s'] * 1e3:.0f} ms), TTFT p50 {r['ttft_p50_s']:.2f} s, "
              f"wall {r['wall_s']:.1f} s, tokens {'all ' + str(args.max_tokens) if equal else r['tokens']}")
    free = statistics.median(r["decode_tok_s"] for r in rounds if not r["constrained"])
    constrained = statistics.median(r["decode_tok_s"] for r in rounds if r["constrained"])
    print(f"batch {args.batch}: free {free:.2f} tok/s, json_schema {constrained:.2f} tok/s, ratio "
          f"{constrained / free:.3f} (cost {100 * (1 - constrained / free):.1f}%); load average {load_average()}")
    if args.json:
        args.json.write_text(json.dumps({"first_constrained": first, "rounds": rounds, "free_tok_s": free,
                                         "constrained_tok_s": constrained}, indent=2))


if __name__ == "__main__":
    main()
