"""Serving benchmark: ``mlxkv serve`` vs ``mlx_lm.server`` on the same weights, same shared-prefix workload.

Both servers run as subprocesses on 127.0.0.1, started once; at each concurrency level they take turns, round by
round (``--rounds``, mlxkv first in even rounds, mlx-lm first in odd ones), so only one is busy at a time and a
slow patch of this shared machine hits both. The workload: chat requests that share a long system prompt and
differ in the user question, streamed, greedy, ``--max-tokens`` each. In a round at a concurrency level (1, 4, 8
clients by default) every client sends ``--requests-per-client`` requests back to back, each on its own loopback
connection (one httpx client per client thread, built before the clock starts; ``--client-per-request`` restores
the old timing, which counted httpx's ~30 ms TLS-context setup in every TTFT). Reported: time to first token
(TTFT: request sent -> first content chunk) p50/p95 over all the level's requests, aggregate output tok/s (the
median round's), and mlxkv/mlx-lm ratios; a PNG plot when matplotlib is installed.

The model (``--model``, default: the reference model SmolLM2-135M-Instruct Q4_1): mlxkv serve loads the GGUF
itself with ``--dequantize`` (float32 on the CPU backend), mlx_lm.server the float32 folder
``mlxkv.gguf.convert(..., dequantize=True)`` writes (kept under ~/.cache/mlxkv-bench), so both run the same
weights; ``--keep-quantized`` runs both quantized. The warm-up request, one per server, is checked to get the
same greedy text from both (a warning says when it does not). ``--model random`` writes a random llama (hidden
256, 4 layers) with the test tokenizer that both servers load.

Both servers reuse shared prompt prefixes: mlx_lm.server through its prompt cache, mlxkv serve through the
paged pool's prefix cache (``--kv-backend paged``, the default; ``--kv-backend dense`` has no prefix cache).

    python scripts/bench_serve.py                      # the reference model, ~200-token shared system prompt
    python scripts/bench_serve.py --prefix-repeat 20 --max-tokens 64 --requests-per-client 2
                                                       # a ~4K-token shared system prompt
    ... --workload shared-unique                       # the same, every user question asked once
    python scripts/bench_serve.py --model random --prefix-repeat 10 --context 8192   # a random llama
    python scripts/bench_serve.py --model path/to/model --max-tokens 64 --json out.json
    ... --baseline-python ../base/.venv/bin/python    # a third server: another checkout's mlxkv serve
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_common import (  # noqa: E402
    add_model_args,
    describe_model,
    ensure_openblas,
    gguf_types,
    model_spec,
    peer_folder,
    print_header,
    resolve_spec,
    side_env,
    side_tree,
    stored_note,
    versions,
)
from testkit.serve_process import free_port, wait_for_health  # noqa: E402

PREFIX = ("You are a patient teacher of the Python language. Answer with short, correct explanations and one "
          "example. The import statement binds names in a module namespace; generators yield values lazily; "
          "context managers release resources when their block ends; classes bundle data and behaviour. ") * 4
SHARED = [PREFIX]  # the shared system prompt (``--prefix-repeat`` copies of PREFIX)
MODEL_NAME = ["default"]  # mlx_lm.server loads whatever `model` names: send its own folder (mlxkv ignores it)
QUESTIONS = ["What is a tuple?", "How does import work?", "What is a generator?", "Explain the with statement.",
             "What is a decorator?", "How do exceptions propagate?", "What is a list comprehension?",
             "What does yield from do?", "How are arguments passed?", "What is a closure?"]


def write_model(out: Path, hidden: int, layers: int, seed: int = 0, context: int = 4096) -> Path:
    """A random-weight float32 llama with the test tokenizer (``context`` positions), saved where both servers
    can load it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, save_config
    from testkit.archs import TEST_VOCAB_SIZE, get_config
    from testkit.tokenizer import write_tokenizer

    config = get_config("llama")
    heads = max(1, hidden // 64)
    config.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 3,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  max_position_embeddings=context)
    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    params = [(k, mx.random.normal(v.shape) * (2.0 / v.shape[-1] ** 0.5) if v.ndim > 1 else mx.ones(v.shape))
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    write_tokenizer(out, vocab_size=TEST_VOCAB_SIZE, model_max_length=config["max_position_embeddings"])
    return out


def model_tokenizer(model: str):
    """The tokenizer both servers load from ``model`` (to report the shared prompt's length in tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def start_server(name: str, model: str, port: int, max_sequences: int, kv_backend: str = "paged",
                 kv_budget: int | None = None, extra: list[str] | None = None,
                 timeout: float = 180, python: str | None = None) -> subprocess.Popen:
    """Start server ``name`` ("mlxkv", "baseline" or "mlx-lm") on ``model`` with ``extra`` options of its own and
    wait until it answers /v1/models (at most ``timeout`` seconds). "baseline" is ``mlxkv serve`` run by ``python``,
    another checkout's interpreter (which imports its own tree)."""
    if name in ("mlxkv", "baseline"):
        cmd = [sys.executable if name == "mlxkv" else python, "-m", "mlxkv.server", "--model", model, "--host",
               "127.0.0.1", "--port", str(port), "--max-sequences", str(max_sequences), "--max-queue-depth", "256",
               "--log-level", "warning", "--kv-backend", kv_backend] + (
                   ["--kv-cache-budget", str(kv_budget)] if kv_budget else [])
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "WARNING"]
    cmd += extra or []
    env, cwd = side_env(python if name == "baseline" else None)
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop_server; not a pipe (nobody reads it)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, log, timeout=timeout, path="/v1/models")
    except RuntimeError as exc:
        proc.kill()
        raise RuntimeError(f"{name}: {exc}") from None
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.log.close()


def http_client():
    """An HTTP client for one benchmark thread. No keep-alive: every request opens its own loopback connection
    on both servers (mlx_lm.server closes connections after each response anyway)."""
    import httpx

    return httpx.Client(timeout=300, limits=httpx.Limits(max_keepalive_connections=0))


def one_request(url: str, question: str, max_tokens: int, system: str | None = None,
                http=None, text: list[str] | None = None) -> tuple[float, int]:
    """Stream one chat completion; return (seconds to the first content, completion tokens).

    The clock starts when the request is sent. ``http``: the thread's client (``None``: build one inside the
    timed region, the old timing: httpx's TLS context setup, ~30 ms of client CPU, then lands in every TTFT).
    ``text``: the streamed content pieces are appended to it.
    """
    body = {"model": MODEL_NAME[0], "messages": [{"role": "system", "content": system or SHARED[0]},
                                                 {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    own = http is None
    http = http_client() if own else http
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]["completion_tokens"]
            for choice in data.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunks += 1
                    if text is not None:
                        text.append(content)
                    if ttft is None:
                        ttft = time.perf_counter() - start
    if own:
        http.close()
    return (ttft if ttft is not None else time.perf_counter() - start), (usage if usage is not None else chunks)


def system_prompt(workload: str, clients: int, k: int, round_: int = 0) -> str:
    """Request ``k``'s system prompt at the level with ``clients`` clients, in round ``round_``."""
    if workload == "distinct":  # a unique opening line defeats prefix reuse (mlx-lm's prompt cache) for every request
        return f"Session {clients}-{round_}-{k}. {SHARED[0]}"
    if workload == "cold-shared":  # shared within a level's round, new at each: its first wave finds nothing cached
        return f"Session {clients}-{round_}. {SHARED[0]}"
    return SHARED[0]


def question(workload: str, clients: int, k: int, round_: int = 0) -> str:
    """Request ``k``'s user question: one of ``QUESTIONS``, asked anew in every request for ``shared-unique``."""
    text = QUESTIONS[k % len(QUESTIONS)]
    if workload == "shared-unique":  # the prompt past the shared system prompt was never seen before
        return f"Ticket {clients}-{round_}-{k}: {text}"
    return text


def run_level(url: str, clients: int, per_client: int, max_tokens: int, workload: str,
              client_per_request: bool = False, round_: int = 0) -> dict:
    """One round at a level: every client sends ``per_client`` requests back to back; raw TTFTs, tokens, tok/s."""
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    https = [None if client_per_request else http_client() for _ in range(clients)]  # built before the clock

    def client(c: int) -> None:
        for i in range(per_client):
            k = c * per_client + i
            system = system_prompt(workload, clients, k, round_)
            t, n = one_request(url, question(workload, clients, k, round_), max_tokens, system, https[c])
            with lock:
                ttfts.append(t)
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for http in https:
        if http is not None:
            http.close()
    return {"ttfts": ttfts, "tokens": tokens[0], "tok_s": tokens[0] / wall, "wall_s": wall}  # one round


def pooled(clients: int, rounds: list[dict]) -> dict:
    """One side's figures at a level over its rounds: TTFT quantiles over every request, the median round's tok/s."""
    ttfts = [t for r in rounds for t in r["ttfts"]]
    q = statistics.quantiles(ttfts, n=20, method="inclusive") if len(ttfts) > 1 else ttfts * 19
    return {"clients": clients, "requests": len(ttfts), "ttft_p50": statistics.median(ttfts), "ttft_p95": q[18],
            "tokens": sum(r["tokens"] for r in rounds), "tok_s": statistics.median(r["tok_s"] for r in rounds),
            "tok_s_rounds": [r["tok_s"] for r in rounds], "wall_s": sum(r["wall_s"] for r in rounds)}


def check_same_text(urls: dict[str, str], max_tokens: int) -> bool:
    """The warm-up: one greedy request to each server; warn when their texts differ (then the two do not run
    the same model, tokenizer or chat template, and their figures compare different work)."""
    texts = {}
    for name, url in urls.items():
        pieces: list[str] = []
        one_request(url, "warm up", max_tokens, text=pieces)
        texts[name] = "".join(pieces)
    if len(set(texts.values())) == 1:
        print(f"warm-up: the servers answer the same greedy text: {texts['mlxkv'][:80]!r}", flush=True)
        return True
    print("WARNING: the servers answer the warm-up request with different greedy texts:", flush=True)
    for name, text in texts.items():
        print(f"  {name:6s} {text[:300]!r}", flush=True)
    return False


def bench(models: dict[str, str], levels: list[int], per_client: int, max_tokens: int, workload: str, rounds: int,
          kv_backend: str = "paged", kv_budget: int | None = None, client_per_request: bool = False,
          extra: list[str] | None = None, baseline: str | None = None) -> tuple[dict[str, list[dict]], bool]:
    """Every server up at once (an idle server takes no CPU), ``models[name]`` each; at each level they take turns
    round by round, the order rotating each round (two servers: mlxkv first in even rounds, mlx-lm first in odd
    ones), so a slow patch of the machine hits all. ``baseline``: another checkout's python, whose ``mlxkv serve``
    runs as a third server. Returns the figures and whether the warm-up texts agreed."""
    names = ("mlxkv", "baseline", "mlx-lm") if baseline else ("mlxkv", "mlx-lm")
    if baseline:
        for name, python in (("mlxkv", sys.executable), ("baseline", baseline)):
            print(f"{name}: mlxkv from {side_tree(python)}", flush=True)
    procs, urls = {}, {}
    try:
        for name in names:
            port = free_port()
            procs[name] = start_server(name, models[name if name != "baseline" else "mlxkv"], port, max(levels),
                                       kv_backend, kv_budget, extra if name != "mlx-lm" else None, python=baseline)
            urls[name] = f"http://127.0.0.1:{port}"
        same = check_same_text(urls, max_tokens)
        results: dict[str, list[dict]] = {name: [] for name in names}
        for clients in levels:
            per_round: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    per_round[name].append(run_level(urls[name], clients, per_client, max_tokens, workload,
                                                     client_per_request, r))
            for name in names:
                p = pooled(clients, per_round[name])
                results[name].append(p)
                print(f"  {name:6s} clients={clients}: TTFT p50 {p['ttft_p50'] * 1e3:7.1f} ms  p95 "
                      f"{p['ttft_p95'] * 1e3:7.1f} ms  {p['tok_s']:7.1f} tok/s (rounds: "
                      f"{', '.join(f'{t:.0f}' for t in p['tok_s_rounds'])})  ({p['tokens']} tokens, "
                      f"{p['wall_s']:.1f}s)", flush=True)
        return results, same
    finally:
        for proc in procs.values():
            stop_server(proc)


def plot(results: dict, path: Path, title: str = "") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        x = [r["clients"] for r in rows]
        a.plot(x, [r["ttft_p50"] * 1e3 for r in rows], marker="o", label=f"{name} p50")
        a.plot(x, [r["ttft_p95"] * 1e3 for r in rows], marker="x", linestyle="--", label=f"{name} p95")
        b.plot(x, [r["tok_s"] for r in rows], marker="o", label=name)
    a.set(xlabel="concurrent clients", ylabel="TTFT (ms)", title="Time to first token")
    b.set(xlabel="concurrent clients", ylabel="output tok/s", title="Aggregate throughput")
    a.legend()
    b.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, random_shape="hidden 256, 4 layers, with the test tokenizer")
    p.add_argument("--context", type=int, default=None,
                   help="--model random only: the random llama's context length (positions; default 4096)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per concurrency level; the two servers alternate round by round")
    p.add_argument("--workload", choices=["shared", "shared-unique", "cold-shared", "distinct"], default="shared",
                   help="shared: one long system prompt for all requests, the user questions drawn from ten (a "
                        "question comes back across rounds and levels: the whole prompt then hits the cache); "
                        "shared-unique: the same, every question asked once; cold-shared: one per concurrency "
                        "level (its first concurrent wave finds it uncached); distinct: each request's prompt "
                        "differs from its first tokens (no prefix reuse on either side)")
    p.add_argument("--prefix-repeat", type=int, default=1,
                   help="the shared system prompt is this many copies of the default one (~200 tokens each "
                        "with SmolLM2's tokenizer, ~400 with the random llama's test tokenizer)")
    p.add_argument("--kv-backend", choices=["paged", "dense"], default="paged", help="mlxkv serve's KV storage")
    p.add_argument("--kv-cache-budget", type=int, default=None, help="mlxkv serve's paged KV bytes (default: its own)")
    p.add_argument("--client-per-request", action="store_true",
                   help="old timing: build an httpx client inside every timed request (its ~30 ms TLS setup is then "
                        "counted in every TTFT, for both servers)")
    p.add_argument("--mlxkv-arg", action="append", default=[],
                   help="extra option for mlxkv serve, repeatable (e.g. --mlxkv-arg=--switch-interval-ms=5)")
    p.add_argument("--baseline-python", default=None,
                   help="another checkout's python (e.g. a venv over an older tree): its mlxkv serve takes turns too")
    p.add_argument("--plot", default="bench_serve.png", help="PNG path (needs matplotlib)")
    p.add_argument("--json", help="also write every figure (and the settings) to this JSON file")
    args = p.parse_args()
    spec = model_spec(p, args, hidden=256, layers=4)
    if spec != "random" and args.context is not None:
        p.error("--context sets the random llama's positions: add --model random")
    args.context = args.context or 4096
    return args


def served_models(args, tmp: Path) -> tuple[dict[str, str], list[str], str]:
    """``({server: what it loads}, mlxkv serve's extra options, one line on the model)``.

    A GGUF: mlxkv serve loads the file (``--dequantize`` unless ``--keep-quantized``), mlx_lm.server the folder
    bench_common converts from it. A folder: mlx_lm.server loads it as it is, or a float32 copy when it holds
    half-precision tensors (mlxkv runs those as float32 on the CPU backend). ``random``: both load the folder
    written into ``tmp``.
    """
    if args.model == "random":
        folder = write_model(tmp / "llama", args.hidden, args.layers, context=args.context)
        line = describe_folder(folder, f"random-weight llama (hidden {args.hidden}, {args.layers} layers, "
                                       f"context {args.context}, test tokenizer)")
        return {"mlxkv": str(folder), "mlx-lm": str(folder)}, [], line
    dequantize = not args.keep_quantized
    path = resolve_spec(args.model)
    peer = peer_folder(path, dequantize=dequantize)
    extra = ["--dequantize"] if path.is_file() and dequantize else []
    source = stored_note(path)
    if path.is_file():
        source = f"GGUF {gguf_types(path)}" + (", mlxkv serve --dequantize" if extra else "")
    name = "mlxkv demo model" if args.model == "demo" else path.name
    return {"mlxkv": str(path), "mlx-lm": str(peer)}, extra, describe_folder(peer, name, source)


def describe_folder(folder: Path, name: str, source: str = "") -> str:
    """:func:`bench_common.describe_model` of the folder's model, built lazily (no weight is read)."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(folder), lazy=True)
    return describe_model(model, f"{name} ({config.get('model_type', 'unknown')})", source)


def report(args, results: dict, models: dict[str, str], same: bool, model_line: str) -> None:
    """The ratios, the shared prompt's length, the JSON file and the plot."""
    print(f"\nworkload: {args.workload} prefix x{args.prefix_repeat}, {args.max_tokens} tokens per request, "
          f"{args.rounds} alternating rounds; mlxkv {args.kv_backend} KV; ratios mlxkv / mlx-lm (TTFT: lower is "
          "better; tok/s: higher is better)")
    for other in ("mlx-lm", "baseline"):
        if other not in results:
            continue
        print(f" mlxkv / {other}:")
        for ours, theirs in zip(results["mlxkv"], results[other]):
            print(f"  clients={ours['clients']}: TTFT p50 x{ours['ttft_p50'] / theirs['ttft_p50']:.2f}  "
                  f"p95 x{ours['ttft_p95'] / theirs['ttft_p95']:.2f}  tok/s x{ours['tok_s'] / theirs['tok_s']:.2f}")
    if not same:
        print("WARNING: the warm-up texts differed (see above): the servers may not compute the same thing")
    shared_tokens = len(model_tokenizer(models["mlx-lm"]).encode(SHARED[0]))
    title = (f"{args.workload} system prompt of ~{shared_tokens} tokens, {args.max_tokens} tokens per request\n"
             f"{model_line.split(':')[0]}, CPU")
    print(f"shared system prompt: {shared_tokens} tokens")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "model": model_line, "versions": versions(),
                                               "served": models, "same_warmup_text": same,
                                               "shared_prompt_tokens": shared_tokens, "results": results}, indent=1))
    if plot(results, Path(args.plot), title):
        print(f"plot: {args.plot}")
    else:
        print("plot: skipped (matplotlib not installed)")


def main() -> None:
    args = parse_args()
    blas = ensure_openblas()  # both server processes inherit it
    with tempfile.TemporaryDirectory() as tmp:
        models, extra, model_line = served_models(args, Path(tmp))
        print_header(blas, model_line, models["mlx-lm"], " ".join([models["mlxkv"], *extra]))
        MODEL_NAME[0] = models["mlx-lm"]
        SHARED[0] = PREFIX * args.prefix_repeat
        results, same = bench(models, args.clients, args.requests_per_client, args.max_tokens, args.workload,
                              args.rounds, args.kv_backend, args.kv_cache_budget, args.client_per_request,
                              extra + args.mlxkv_arg, args.baseline_python)
        report(args, results, models, same, model_line)


if __name__ == "__main__":
    main()
