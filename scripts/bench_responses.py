"""Stored conversations vs resent ones: ``/v1/responses`` with ``previous_response_id`` against the same
conversations resent whole through ``/v1/chat/completions``, on a KV budget that holds about 3 of them.

``--conversations`` (8) conversations of ``--turns`` (10) turns each, taken round-robin (turn 1 of every
conversation, then turn 2 of every one, ...), one request at a time, so between two turns of a conversation the
other seven run. Each conversation opens with its own document (``--doc-tokens``), then asks a question per turn
(greedy replies of ``--max-tokens``). Three runs, each on a fresh server with the same KV budget (``--fit``
conversations at their full length, in bytes, from the model's KV shape):

- **responses**: ``mlxkv serve`` ``/v1/responses``, each turn sending only its question and the previous response's
  id; the stored responses' blocks are retained (``--responses-kv-budget``: ``--retain-share`` of the pool), so
  the pool evicts other blocks first;
- **chat**: ``mlxkv serve`` ``/v1/chat/completions``, each turn resending the whole conversation (what a stateless
  client does); its blocks are cached at the default priority, least recently used evicted first;
- **mlx-lm** (``--peer``): ``mlx_lm.server`` on the same weights (the float32 folder converted from the GGUF), the
  conversations resent whole, its prompt cache capped at the same bytes (``--prompt-cache-bytes``).

Reported per run: the cache hit rate (prompt tokens served from the cache over all prompt tokens, turns 2 to the
last, from each answer's ``cached_tokens``), the median TTFT at each turn and at the last one, side by side.

    python scripts/bench_responses.py                  # 8 x 10, SmolLM2-135M-Instruct (GGUF, float32)
    python scripts/bench_responses.py --peer           # and mlx_lm.server on the resent conversations
    python scripts/bench_responses.py --conversations 2 --turns 3 --fit 2   # a quick look
    python scripts/bench_responses.py --report a.json b.json    # the report of runs saved with --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import add_model_args, ensure_openblas, model_spec, print_header  # noqa: E402
from bench_serve import free_port, http_client, served_models, start_server, stop_server  # noqa: E402

INSTRUCTIONS = "You are a helpful assistant. Answer questions about the document in one or two sentences."
TOPICS = ("harbour", "orchard", "railway", "library", "glacier", "market", "observatory", "vineyard")
WORDS = ("north south river bridge stone market winter summer lantern ship harbour tower garden road field clock "
         "bell window door mill baker school letter map island coast forest hill valley lake boat rope").split()
QUESTIONS = ["What is the document about?", "Who is mentioned first?", "Where does it happen?",
             "What happens in winter?", "Which building is oldest?", "What do people trade?", "How do they travel?",
             "What is the weather like?", "What changes at the end?", "Summarise it in one line."]


def document(c: int, tokens: int, count) -> str:
    """Conversation ``c``'s opening document: about ``tokens`` tokens of its own (no prefix shared with others)."""
    rng = random.Random(c)
    lines = [f"Document {c}: notes on the {TOPICS[c % len(TOPICS)]} (record {rng.randrange(10**6)})."]
    while count("\n".join(lines)) < tokens:
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))).capitalize() + ".")
    return "\n".join(lines)


def first_input(doc: str, turn: int) -> str:
    return f"{doc}\n\n{QUESTIONS[turn % len(QUESTIONS)]}" if turn == 0 else QUESTIONS[turn % len(QUESTIONS)]


def sse(response):
    """``(event, data)`` pairs of a server-sent event stream (``event`` None when the stream names none)."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, line[6:]
            event = None


def ask_responses(url: str, http, model: str, text: str, previous: str | None, max_tokens: int) -> dict:
    body = {"model": model, "input": text, "instructions": INSTRUCTIONS, "max_output_tokens": max_tokens,
            "temperature": 0.0, "stream": True, **({"previous_response_id": previous} if previous else {})}
    start, ttft, out = time.perf_counter(), None, {}
    with http.stream("POST", url + "/v1/responses", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for _, data in sse(r):
            event = json.loads(data)
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                out = event["response"]
    usage = out["usage"]
    text = "".join(p["text"] for i in out["output"] if i["type"] == "message" for p in i["content"])
    return {"ttft": ttft or time.perf_counter() - start, "prompt": usage["input_tokens"],
            "cached": usage["input_tokens_details"]["cached_tokens"], "id": out["id"], "text": text}


def ask_chat(url: str, http, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, usage = time.perf_counter(), None, [], {}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for _, data in sse(r):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    text.append(choice["delta"]["content"])
                    ttft = ttft or time.perf_counter() - start
    return {"ttft": ttft or time.perf_counter() - start, "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "text": "".join(text)}


def replay(kind: str, url: str, model: str, docs: list[str], turns: int, max_tokens: int) -> list[list[dict]]:
    """Every conversation's turns, round-robin, one request at a time; ``[turn][conversation]`` figures."""
    http = http_client()
    previous: list[str | None] = [None] * len(docs)
    history: list[list[dict]] = [[{"role": "system", "content": INSTRUCTIONS}] for _ in docs]
    rows = []
    for t in range(turns):
        row = []
        for c, doc in enumerate(docs):
            text = first_input(doc, t)
            if kind == "responses":
                r = ask_responses(url, http, model, text, previous[c], max_tokens)
                previous[c] = r["id"]
            else:
                history[c].append({"role": "user", "content": text})
                r = ask_chat(url, http, model, history[c], max_tokens)
                history[c].append({"role": "assistant", "content": r["text"]})
            row.append(r)
        rows.append(row)
        print(f"  {kind:9s} turn {t + 1:2d}: TTFT median {statistics.median(r['ttft'] for r in row):.3f} s, "
              f"cached {sum(r['cached'] for r in row)}/{sum(r['prompt'] for r in row)} prompt tokens", flush=True)
    http.close()
    return rows


def hit_rate(rows: list[list[dict]]) -> float:
    later = [r for row in rows[1:] for r in row]
    return sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))


def kv_bytes_per_token(folder: str) -> int:
    """float32 K and V bytes of one token across the model's layers (the CPU backend runs float32)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", heads) * head_dim * 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "hidden 256, 4 layers")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--doc-tokens", type=int, default=300, help="each conversation's opening document")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per reply")
    p.add_argument("--fit", type=float, default=3.0, help="conversations (at their last turn) the KV pool holds")
    p.add_argument("--retain-share", type=float, default=0.75,
                   help="share of the pool the stored responses may retain (--responses-kv-budget)")
    p.add_argument("--peer", action="store_true", help="also run mlx_lm.server on the resent conversations")
    p.add_argument("--only", choices=["responses", "chat", "mlx-lm"], action="append", default=None,
                   help="run only these (repeatable; default: all)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    model_spec(p, args, hidden=256, layers=4)
    args.context = 8192
    return args


def main() -> None:
    args = parse_args()
    blas = ensure_openblas()
    with tempfile.TemporaryDirectory() as tmp:
        models, extra, model_line = served_models(args, Path(tmp))
        print_header(blas, model_line, models["mlx-lm"] if args.peer else None, " ".join([models["mlxkv"], *extra]))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(models["mlx-lm"])
        count = lambda text: len(tokenizer.encode(text))  # noqa: E731
        docs = [document(c, args.doc_tokens, count) for c in range(args.conversations)]
        # a conversation at its last turn: the document, every question and reply, ~12 tokens of turn markers each
        full = count(INSTRUCTIONS) + args.doc_tokens + sum(
            count(QUESTIONS[t % len(QUESTIONS)]) + args.max_tokens + 12 for t in range(args.turns))
        per_token = kv_bytes_per_token(models["mlx-lm"])
        budget = int(args.fit * full * per_token)
        retain = int(args.retain_share * budget)
        print(f"{args.conversations} conversations x {args.turns} turns, round-robin, one request at a time; "
              f"document ~{args.doc_tokens} tokens; {args.max_tokens}-token greedy replies; ~{full} tokens per "
              f"conversation at its last turn; KV budget {budget / 2**20:.0f} MiB = {args.fit:g} conversations "
              f"({per_token} B/token); stored responses retain up to {retain / 2**20:.0f} MiB", flush=True)
        runs = {"responses": ("mlxkv", ["--responses-kv-budget", str(retain)]), "chat": ("mlxkv", [])}
        if args.peer:
            runs["mlx-lm"] = ("mlx-lm", ["--prompt-cache-bytes", str(budget)])
        results = {}
        for kind, (server, options) in runs.items():
            if args.only and kind not in args.only:
                continue
            port = free_port()
            proc = start_server(server, models[server], port, 1, kv_budget=budget if server == "mlxkv" else None,
                                extra=(extra + options) if server == "mlxkv" else options)
            try:
                model = models["mlx-lm"] if server == "mlx-lm" else "m"
                results[kind] = replay("responses" if kind == "responses" else "chat", f"http://127.0.0.1:{port}",
                                       model, docs, args.turns, args.max_tokens)
            finally:
                stop_server(proc)
    report(args, results)


def report(args, results: dict[str, list[list[dict]]]) -> None:
    names = list(results)
    print(f"\n{args.conversations} conversations x {args.turns} turns on a KV budget of {args.fit:g} conversations")
    print(" turn | " + " | ".join(f"{n:>9s} TTFT  cached/prompt" for n in names))
    for t in range(args.turns):
        cells = []
        for n in names:
            row = results[n][t]
            cells.append(f"{statistics.median(r['ttft'] for r in row):12.3f} s {sum(r['cached'] for r in row):6d}/"
                         f"{sum(r['prompt'] for r in row):<6d}")
        print(f" {t + 1:4d} | " + " | ".join(cells))
    print(f"\n run        hit rate (turns 2+) | turn {args.turns}: TTFT median, all | conversations served from "
          "cache (>= 80% of the prompt): how many, their TTFT median | the others' TTFT median")
    for n in names:
        last = results[n][-1]
        kept = [r["ttft"] for r in last if r["cached"] >= 0.8 * r["prompt"]]
        rest = [r["ttft"] for r in last if r["cached"] < 0.8 * r["prompt"]]
        print(f" {n:10s} {hit_rate(results[n]):8.1%}            | {statistics.median(r['ttft'] for r in last):8.3f} s"
              f"         | {len(kept)} of {len(last)}, {statistics.median(kept) if kept else float('nan'):.3f} s"
              f" | {statistics.median(rest) if rest else float('nan'):.3f} s")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": {n: [[{k: v for k, v in r.items() if k != "text"} for r in row]
                                                         for row in rows] for n, rows in results.items()}}, indent=1))


def report_files(paths: list[Path]) -> None:
    """The report of runs written by ``--json`` (several files: their runs side by side, e.g. one run per file)."""
    results, settings = {}, None
    for path in paths:
        data = json.loads(path.read_text())
        settings = settings or data["settings"]
        results.update(data["results"])
    args = argparse.Namespace(conversations=int(settings["conversations"]), turns=int(settings["turns"]),
                              fit=float(settings["fit"]), json=None)
    report(args, results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:  # python scripts/bench_responses.py --report a.json b.json
        report_files([Path(p) for p in sys.argv[2:]])
    else:
        main()
