"""Speculative serving benchmark: ``mlxkv serve --prompt-lookup`` (and ``--draft-model``) vs ``mlxkv serve`` vs
``mlx_lm.server`` (and ``mlx_lm.server --draft-model`` on the same draft) on an edit workload.

The workload is what coding agents and editors send: a prompt holding a few hundred tokens of code (pieces of
this project's own source, ~300-600 tokens each) and an instruction to return it with one small change (a name
replaced), greedy, streamed, ``--max-tokens`` each. The answer repeats most of its prompt, the case prompt-lookup
speculation accelerates.

The three servers run as subprocesses on 127.0.0.1 on the same weights (the reference model by default:
SmolLM2-135M-Instruct; mlxkv loads the GGUF with ``--dequantize``, mlx_lm.server the float32 folder
:mod:`bench_common` converts from it), started once and kept up. At each concurrency level (``--clients``, 1 and 4
by default) they take turns, round by round (``--rounds``; the order rotates each round), so only one is busy at a
time and a slow patch of this shared machine hits all of them. In a round every client sends
``--requests-per-client`` requests back to back (distinct documents, so no answer is a prefix-cache hit of another).

Reported per server and level: aggregate output tok/s (the median round's), per-request decode tok/s (tokens after
the first over the time after the first, median), TTFT p50, and for mlxkv with speculation the acceptance rate and
tokens per verification row (from each response's ``usage.speculative``); then the ratios the targets name. The
machine's load average is printed before and after: the machine is shared.

``--draft-model D`` adds ``mlxkv+draft`` (``mlxkv serve --draft-model D``) and ``mlx-lm+draft`` (``mlx_lm.server
--draft-model D``), both with ``--num-draft-tokens``; ``D`` is an mlx-lm folder, or ``quantized``: the peer's float32
folder converted to 4-bit by mlx-lm into a temporary folder (same tokenizer and vocabulary, built offline).
``--servers`` keeps only the named servers.

    python scripts/bench_speculative_serve.py                       # SmolLM2, 1 and 4 clients, 2 rounds
    python scripts/bench_speculative_serve.py --clients 1 4 8 --max-tokens 300 --num-draft-tokens 6
    python scripts/bench_speculative_serve.py --clients 1 --draft-model quantized --servers mlxkv mlxkv+draft \
        mlx-lm+draft
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_common import add_model_args, ensure_openblas, model_spec, print_header  # noqa: E402
from bench_serve import MODEL_NAME, http_client, served_models, start_server, stop_server  # noqa: E402
from testkit.serve_process import free_port  # noqa: E402

#: Source files the documents are cut from (this project's own code: stable, real, and new to the model).
SOURCES = ["mlxkv/engine/drafters.py", "mlxkv/engine/verify.py", "mlxkv/engine/rewind.py",
           "mlxkv/engine/decode_loop.py", "mlxkv/engine/prefill_batch.py", "mlxkv/engine/speculation.py"]
INSTRUCTION = ("Return the following Python code exactly as it is, with one change: rename `{old}` to `{new}` "
               "everywhere. Reply with the complete code only.\n\n```python\n{code}\n```")


def documents(count: int, chars: int) -> list[tuple[str, str, str]]:
    """``count`` pieces of code of about ``chars`` characters each (whole lines, from a ``def`` or ``class``
    line on), each with a name it uses and its replacement: ``(code, old, new)``."""
    import re

    docs = []
    for path in SOURCES:
        lines = (ROOT / path).read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if re.match(r"\s*(def|class) ", line)]
        for start in starts:
            piece, size = [], 0
            for line in lines[start:]:
                if size + len(line) > chars:
                    break
                piece.append(line)
                size += len(line) + 1
            code = "\n".join(piece)
            names = re.findall(r"\b([a-z]+_[a-z_]+)\b", code)
            if size < chars * 0.7 or not names:
                continue
            old = max(set(names), key=names.count)
            docs.append((code, old, old.replace("_", "") + "_v2"))
            if len(docs) == count:
                return docs
    return docs


def one_request(url: str, doc: tuple[str, str, str], max_tokens: int, http, extra: dict) -> dict:
    """Stream one chat completion; its TTFT, completion tokens, decode seconds and ``usage.speculative``."""
    code, old, new = doc
    body = {"model": MODEL_NAME[0], "messages": [{"role": "user", "content": INSTRUCTION.format(old=old, new=new,
                                                                                                 code=code)}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    start = time.perf_counter()
    first = last = None
    usage: dict = {}
    chunks = 0
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                chunks += 1
                last = time.perf_counter()
                first = first or last
    tokens = usage.get("completion_tokens", chunks)
    first = first or time.perf_counter()
    return {"ttft": first - start, "tokens": tokens, "decode_s": (last or first) - first,
            "speculative": usage.get("speculative")}


def run_level(url: str, clients: int, per_client: int, docs: list, max_tokens: int, extra: dict) -> dict:
    """One round: every client sends ``per_client`` requests back to back (document ``c * per_client + i``)."""
    results: list[dict] = []
    lock = threading.Lock()
    https = [http_client() for _ in range(clients)]

    def client(c: int) -> None:
        for i in range(per_client):
            out = one_request(url, docs[(c * per_client + i) % len(docs)], max_tokens, https[c], extra)
            with lock:
                results.append(out)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for http in https:
        http.close()
    return {"results": results, "wall_s": wall, "tok_s": sum(r["tokens"] for r in results) / wall}


def summary(rounds: list[dict]) -> dict:
    """A server's figures at one level over its rounds."""
    results = [r for rnd in rounds for r in rnd["results"]]
    decode = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0 and r["tokens"] > 1]
    spec = [r["speculative"] for r in results if r["speculative"]]
    proposed = sum(s["proposed_tokens"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    return {"tok_s": statistics.median(r["tok_s"] for r in rounds), "tok_s_rounds": [r["tok_s"] for r in rounds],
            "decode_tok_s": statistics.median(decode) if decode else 0.0,
            "ttft_p50": statistics.median(r["ttft"] for r in results),
            "tokens": sum(r["tokens"] for r in results), "requests": len(results),
            "acceptance": accepted / proposed if proposed else None, "proposed": proposed, "accepted": accepted}


def quantized_draft(folder: str, tmp: Path) -> str:
    """``folder`` (an mlx-lm float32 model) converted by mlx-lm to 4-bit weights in ``tmp``: a draft model with the
    served model's tokenizer and vocabulary, built offline."""
    from mlx_lm import convert

    out = tmp / "draft-4bit"
    convert(folder, mlx_path=str(out), quantize=True, q_bits=4)
    return str(out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, "hidden 256, 4 layers")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--doc-chars", type=int, default=1400, help="characters of code per prompt (~350 tokens)")
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--ngram-size", type=int, default=3)
    parser.add_argument("--max-sequences", type=int, default=8)
    parser.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    parser.add_argument("--draft-model", help="an mlx-lm folder, or 'quantized' (the peer folder in 4 bits): adds "
                                              "mlxkv+draft and mlx-lm+draft")
    parser.add_argument("--servers", nargs="+", help="only these servers (mlxkv+lookup, mlxkv, mlx-lm, mlxkv+draft, "
                                                     "mlx-lm+draft)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    args.model = model_spec(parser, args, 256, 4)
    args.context = 4096
    return args


def main() -> None:
    args = parse_args()
    blas = ensure_openblas()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        models, extra, model_line = served_models(args, Path(tmp))
        print_header(blas, model_line, models["mlx-lm"], " ".join([models["mlxkv"], *extra]))
        MODEL_NAME[0] = models["mlx-lm"]
        need = max(args.clients) * args.requests_per_client * args.rounds
        docs = documents(need * 2, args.doc_chars)
        spec_flags = ["--prompt-lookup", "--num-draft-tokens", str(args.num_draft_tokens),
                      "--ngram-size", str(args.ngram_size)]
        servers = {"mlxkv+lookup": ("mlxkv", models["mlxkv"], extra + spec_flags),
                   "mlxkv": ("mlxkv", models["mlxkv"], extra)}
        if not args.no_mlx_lm:
            servers["mlx-lm"] = ("mlx-lm", models["mlx-lm"], [])
        if args.draft_model:
            draft = args.draft_model
            if draft == "quantized":
                draft = quantized_draft(models["mlx-lm"], Path(tmp))
            print(f"draft model: {draft}", flush=True)
            draft_flags = ["--draft-model", draft, "--num-draft-tokens", str(args.num_draft_tokens)]
            servers["mlxkv+draft"] = ("mlxkv", models["mlxkv"], extra + draft_flags)
            if not args.no_mlx_lm:
                servers["mlx-lm+draft"] = ("mlx-lm", models["mlx-lm"], draft_flags)
        if args.servers:
            servers = {name: servers[name] for name in args.servers}
        procs, urls = {}, {}
        try:
            for name, (kind, model, flags) in servers.items():
                port = free_port()
                procs[name] = start_server(kind, model, port, args.max_sequences, extra=flags, timeout=900)
                urls[name] = f"http://127.0.0.1:{port}"
            print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
                  f"({os.cpu_count()} CPUs, shared)", flush=True)
            for name, url in urls.items():  # warm-up, and the greedy texts compared
                with http_client() as http:
                    one_request(url, docs[-1], 16, http, {})
            rounds: dict[tuple[str, int], list[dict]] = {}
            offset = 0
            for clients in args.clients:
                for rnd in range(args.rounds):
                    order = list(urls)[rnd % len(urls):] + list(urls)[: rnd % len(urls)]
                    level_docs = docs[offset:] + docs[:offset]
                    for name in order:
                        out = run_level(urls[name], clients, args.requests_per_client, level_docs, args.max_tokens, {})
                        rounds.setdefault((name, clients), []).append(out)
                        print(f"  {clients} client(s), round {rnd}, {name}: {out['tok_s']:.1f} tok/s", flush=True)
                    offset += clients * args.requests_per_client
        finally:
            for proc in procs.values():
                stop_server(proc)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    figures = {f"{name}@{clients}": summary(r) for (name, clients), r in rounds.items()}
    print(f"\nedit workload: {args.doc_chars}-character code pieces, max_tokens {args.max_tokens}, greedy, "
          f"K={args.num_draft_tokens}, ngram {args.ngram_size}")
    print(f"{'server':14s} {'clients':>7s} {'tok/s':>8s} {'decode tok/s':>13s} {'TTFT p50':>9s} {'accept':>7s}")
    for key, f in figures.items():
        name, clients = key.split("@")
        accept = f"{f['acceptance']:.2f}" if f["acceptance"] is not None else "-"
        print(f"{name:14s} {clients:>7s} {f['tok_s']:8.1f} {f['decode_tok_s']:13.1f} {f['ttft_p50'] * 1000:7.0f}ms "
              f"{accept:>7s}")
    for clients in args.clients:
        for mine, others in (("mlxkv+lookup", ("mlxkv", "mlx-lm")),
                             ("mlxkv+draft", ("mlxkv", "mlx-lm", "mlx-lm+draft"))):
            ours = figures.get(f"{mine}@{clients}")
            for other in others:
                theirs = figures.get(f"{other}@{clients}")
                if ours and theirs:
                    print(f"{clients} client(s): {mine} / {other}: {ours['tok_s'] / theirs['tok_s']:.2f}x aggregate, "
                          f"{ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x per-request decode")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
