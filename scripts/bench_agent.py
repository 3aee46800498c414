"""Agent replay: scripted coding-agent conversations against ``mlxkv serve`` and ``mlx_lm.server``, same weights.

Each conversation is what a coding agent sends: a long system prompt (agent instructions, ``--system-tokens``
of them, shared by every conversation) with tool definitions (``tools``), then ``--turns`` turns; each turn adds a
user message, the assistant's tool call (scripted, OpenAI ``tool_calls`` shape), the tool's result (a file, a test
log, a search hit: ``--result-tokens`` of them, different in every conversation), and asks the server for the
assistant's reply (streamed, greedy, ``--max-tokens``), which joins the history for the next turn.
``--conversations`` run at once (one thread each, turns back to back). Reported per server: total wall time of
the replay, TTFT per turn (median over conversations) and prompt tokens served from the server's cache per turn
(``usage.prompt_tokens_details.cached_tokens``, which both servers report), then the ratios.

Both servers start once (bench_serve's launcher) and take turns, round by round (``--rounds``; mlxkv first in
even rounds, mlx-lm first in odd ones), each round with new tool results (the system prompt stays the same, as
for an agent's sessions). Before timing, one request per server warms it (the system prompt is then cached on
both, as it is on a running server) and checks both answer the same greedy text. Both servers render the
conversation with the same chat template (``--chat-template``, default: the tests' ChatML template that renders
tools, since SmolLM2's own template ignores them). Model and BLAS as in bench_serve: SmolLM2-135M-Instruct, the
GGUF dequantized to float32 for both.

    python scripts/bench_agent.py                                   # 4 conversations x 10 turns, ~4K-token system
    python scripts/bench_agent.py --conversations 1 --turns 3 --system-tokens 1000 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import add_model_args, ensure_openblas, model_spec, print_header  # noqa: E402
from bench_serve import free_port, http_client, served_models, start_server, stop_server  # noqa: E402

TOOLS_TEMPLATE = ROOT / "tests" / "testkit" / "templates" / "tools_chatml.jinja"

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(props)}}}
    for name, description, props in [
        ("read_file", "Read a file of the repository and return its text with line numbers.",
         {"path": {"type": "string", "description": "a path relative to the repository root"}}),
        ("write_file", "Replace the whole text of a file (create it if missing).",
         {"path": {"type": "string"}, "text": {"type": "string", "description": "the new contents"}}),
        ("search_code", "Search the repository for a regular expression; returns matching lines with paths.",
         {"pattern": {"type": "string"}, "glob": {"type": "string", "description": "e.g. src/**/*.py"}}),
        ("run_tests", "Run the test suite or a subset of it and return the last lines of its output.",
         {"selector": {"type": "string", "description": "a pytest node id or expression"}}),
        ("list_dir", "List a folder's entries, folders first.", {"path": {"type": "string"}}),
        ("run_shell", "Run a shell command in the repository root (no network) and return its output.",
         {"command": {"type": "string"}, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}}),
    ]
]

GUIDELINES = [
    "You are a careful software engineer working in a user's repository through the tools below. Read before you "
    "write: open the files a change touches, and the tests that cover them, before proposing an edit.",
    "Keep changes small and focused. Explain what you change and why in one or two sentences, then make the change "
    "with write_file. Never invent an API: search the code for the function you want to call first.",
    "Run the relevant tests after every change with run_tests, and read failures to the end: the last assertion "
    "is usually the one that matters. When a test fails, fix the code, not the test, unless the test is wrong.",
    "Prefer the standard library and the project's existing helpers. Match the surrounding style: names, "
    "docstrings, line length, the way errors are raised and logged. Do not reformat code you did not change.",
    "When the user's request is ambiguous, say which reading you chose. When a command could destroy work (a "
    "force push, deleting files, rewriting history), ask first. Never print secrets found in files.",
    "Answer in plain text. Quote code with its path and line numbers. When you are done, summarise the change, the "
    "tests you ran and their result, and anything you noticed but left alone.",
]

USER_TURNS = [
    "The CSV export drops the last row when the file has no trailing newline. Find out why.",
    "Show me where the reader is constructed.", "What does the test for the export cover?",
    "Fix it, please.", "Run the export tests.", "One still fails: look at the log.",
    "Is the same bug in the JSON exporter?", "Add a regression test for the CSV case.",
    "Run the whole suite once more.", "Summarise what changed.",
]
CALLS = [("search_code", {"pattern": "def export_csv"}), ("read_file", {"path": "src/export/csv_writer.py"}),
         ("read_file", {"path": "tests/test_export.py"}), ("write_file", {"path": "src/export/csv_writer.py",
                                                                          "text": "..."}),
         ("run_tests", {"selector": "tests/test_export.py"}), ("read_file", {"path": "build/test-log.txt"}),
         ("search_code", {"pattern": "class JsonExporter"}), ("write_file", {"path": "tests/test_export.py",
                                                                             "text": "..."}),
         ("run_tests", {"selector": "tests"}), ("run_shell", {"command": "git diff --stat"})]
WORDS = ("row reader writer buffer newline field quote delimiter header export record stream encoding value "
         "index offset line column parse flush close open path test assert expected actual error count").split()


def system_prompt(tokens: int, count) -> str:
    """The agent instructions, the guideline paragraphs cycled until they reach ``tokens`` tokens."""
    parts: list[str] = []
    i = 0
    while count("\n\n".join(parts)) < tokens:
        parts.append(f"{i + 1}. {GUIDELINES[i % len(GUIDELINES)]}")
        i += 1
    return "\n\n".join(parts)


def tool_result(rng: random.Random, tokens: int, count) -> str:
    """A file-like tool output of about ``tokens`` tokens, numbered lines of words from ``rng``."""
    lines: list[str] = []
    while count("\n".join(lines)) < tokens:
        lines.append(f"{len(lines) + 1:4d}  " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))))
    return "\n".join(lines)


def conversation_turns(seed: int, turns: int, result_tokens: int, count) -> list[list[dict]]:
    """The messages each turn adds (user message, the assistant's tool call, the tool's result)."""
    rng = random.Random(seed)
    out = []
    for t in range(turns):
        name, arguments = CALLS[t % len(CALLS)]
        call_id = f"call_{seed}_{t}"
        out.append([{"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": json.dumps(arguments)}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": tool_result(rng, result_tokens, count)}])
    return out


def ask(url: str, http, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """Stream one chat completion; (seconds to the first chunk with content, the text, usage)."""
    body = {"model": MODEL[0], "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for choice in data.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    text.append(content)
                    if ttft is None:
                        ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(text), usage


MODEL = ["default"]  # mlx_lm.server loads what `model` names: send its own folder (mlxkv ignores it)


def replay(url: str, system: str, conversations: list[list[list[dict]]], max_tokens: int) -> dict:
    """All conversations at once, each turn after the previous one's reply; per-turn figures and the wall time."""
    turns = len(conversations[0])
    ttft = [[0.0] * len(conversations) for _ in range(turns)]
    cached = [[0] * len(conversations) for _ in range(turns)]
    prompt = [[0] * len(conversations) for _ in range(turns)]
    errors: list[BaseException] = []

    def run(c: int) -> None:
        try:
            http = http_client()
            history = [{"role": "system", "content": system}]
            for t, added in enumerate(conversations[c]):
                history += added
                seconds, text, usage = ask(url, http, history, max_tokens)
                history.append({"role": "assistant", "content": text})
                ttft[t][c] = seconds
                prompt[t][c] = usage.get("prompt_tokens", 0)
                cached[t][c] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            http.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(len(conversations))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return {"wall_s": time.perf_counter() - start, "ttft": [statistics.median(row) for row in ttft],
            "cached": [statistics.median(row) for row in cached], "prompt": [statistics.median(row) for row in prompt]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "hidden 256, 4 layers")
    p.add_argument("--conversations", type=int, default=4, help="conversations replayed at once")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-tokens", type=int, default=4000, help="length of the shared agent instructions")
    p.add_argument("--result-tokens", type=int, default=200, help="length of each tool result")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per assistant reply")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chat-template", type=Path, default=TOOLS_TEMPLATE,
                   help="a Jinja chat template both servers use (default: the tests' tools template)")
    p.add_argument("--mlxkv-arg", action="append", default=[], help="an extra option for mlxkv serve (repeatable)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    model_spec(p, args, hidden=256, layers=4)
    args.context = 8192
    if not args.chat_template.is_file():
        p.error(f"--chat-template {args.chat_template}: no such file")
    return args


def main() -> None:
    args = parse_args()
    blas = ensure_openblas()
    template = args.chat_template.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        models, extra, model_line = served_models(args, Path(tmp))
        print_header(blas, model_line, models["mlx-lm"], " ".join([models["mlxkv"], *extra]))
        MODEL[0] = models["mlx-lm"]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(models["mlx-lm"])
        count = lambda text: len(tokenizer.encode(text))  # noqa: E731
        system = system_prompt(args.system_tokens, count)
        options = {"mlxkv": [*extra, "--chat-template", str(args.chat_template), "--max-sequences",
                             str(max(8, args.conversations)), *args.mlxkv_arg],
                   "mlx-lm": ["--chat-template", template]}
        print(f"{args.conversations} conversations x {args.turns} turns; system prompt {count(system)} tokens + "
              f"{len(TOOLS)} tools; tool results ~{args.result_tokens} tokens; {args.max_tokens} tokens per reply; "
              f"greedy; chat template {args.chat_template.name}", flush=True)
        names, procs, urls = ("mlxkv", "mlx-lm"), {}, {}
        try:
            for name in names:
                port = free_port()
                procs[name] = start_server(name, models[name], port, max(8, args.conversations),
                                           extra=options[name])
                urls[name] = f"http://127.0.0.1:{port}"
            warm = {}
            for name in names:
                http = http_client()
                _, warm[name], _ = ask(urls[name], http, [{"role": "system", "content": system},
                                                          {"role": "user", "content": "Which tools do you have?"}],
                                       args.max_tokens)
                http.close()
            same = warm["mlxkv"] == warm["mlx-lm"]
            print(f"warm-up: {'both servers answer the same greedy text' if same else 'TEXTS DIFFER'}: "
                  f"{warm['mlxkv'][:80]!r}" + ("" if same else f" vs {warm['mlx-lm'][:80]!r}"), flush=True)
            results: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(args.rounds):
                convs = [conversation_turns(1000 * (r + 1) + c, args.turns, args.result_tokens, count)
                         for c in range(args.conversations)]
                for name in names if r % 2 == 0 else names[::-1]:
                    out = replay(urls[name], system, convs, args.max_tokens)
                    results[name].append(out)
                    print(f"  round {r} {name:6s}: {out['wall_s']:6.1f} s; TTFT per turn (s) "
                          f"{' '.join(f'{x:.2f}' for x in out['ttft'])}; cached tokens per turn "
                          f"{' '.join(str(int(x)) for x in out['cached'])}", flush=True)
        finally:
            for proc in procs.values():
                stop_server(proc)
    report(args, results, same)


def report(args, results: dict[str, list[dict]], same: bool) -> None:
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in results.items()}
    turns = len(results["mlxkv"][0]["ttft"])
    ttft = {name: [statistics.median(r["ttft"][t] for r in rs) for t in range(turns)] for name, rs in results.items()}
    cached = {name: [statistics.median(r["cached"][t] for r in rs) for t in range(turns)]
              for name, rs in results.items()}
    prompt = [statistics.median(r["prompt"][t] for r in results["mlxkv"]) for t in range(turns)]
    print(f"\nmedian of {args.rounds} rounds; {args.conversations} conversations at once")
    print(" turn  prompt  | TTFT mlxkv  mlx-lm  | cached mlxkv  mlx-lm")
    for t in range(turns):
        print(f" {t:4d}  {prompt[t]:6.0f}  | {ttft['mlxkv'][t]:9.2f}  {ttft['mlx-lm'][t]:6.2f}  | "
              f"{cached['mlxkv'][t]:11.0f}  {cached['mlx-lm'][t]:6.0f}")
    print(f"total: mlxkv {wall['mlxkv']:.1f} s, mlx-lm {wall['mlx-lm']:.1f} s: mlx-lm / mlxkv = "
          f"{wall['mlx-lm'] / wall['mlxkv']:.2f}x faster")
    if not same:
        print("WARNING: the warm-up texts differed: the servers may not compute the same thing")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "same_warmup_text": same}, indent=1))


if __name__ == "__main__":
    main()
