"""KV pool memory benchmark: what ``mlxkv serve`` holds idle and under load with the growing paged pool (the
default) vs ``--kv-preallocate``, next to ``mlx_lm.server`` on the same weights.

Reported, as resident memory (RSS, from /proc) of each server process:

1. ``mlx_lm.server`` alone: at start and after one warm-up request (``--peer-load``: also after one round of the
   load below; on a busy 2-core machine its ~16K prompt tokens can take minutes);
2. ``mlxkv serve`` growing (default options), ``mlxkv serve --kv-preallocate`` and, with ``--idle-release N``,
   ``mlxkv serve --kv-idle-release N`` (growing, giving its chunks back after N idle seconds): at start (after
   the engine's start-up probe), then round by round, taking turns (the order rotates each round, so a slow patch
   of this shared machine hits each), each round ``--clients`` concurrent clients sending one streamed chat
   request each, a ``--prompt-tokens``-token prompt of its own (new in every round: no prefix hit), greedy,
   ``--max-tokens`` tokens; TTFT p50/p95 over the rounds' requests and aggregate tok/s (median round) per
   server, and its RSS and pool figures (``/v1/cache/stats``: blocks allocated of the budget) after each round;
3. after the rounds: the growing server's RSS after ``POST /v1/cache/reset`` (evicts the cached blocks; the pool
   then gives its chunks back), and the idle-release server's once it has been idle for its N seconds.

The idle-release server gives its chunks back between its rounds (the others run meanwhile), so its rounds
pay for growing the pool again each time: the worst case of the growing pool.

Model: the reference SmolLM2-135M-Instruct GGUF (``--model``), loaded by mlxkv serve with ``--dequantize``
(float32 on the CPU backend) and by mlx_lm.server from the float32 folder bench_common converts from it.

    python scripts/bench_pool_memory.py                           # 8 clients x ~2K tokens, 3 rounds
    python scripts/bench_pool_memory.py --rounds 2 --max-tokens 16 --idle-release 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_common import (  # noqa: E402
    add_model_args,
    ensure_openblas,
    model_spec,
    peer_folder,
    print_header,
    resolve_spec,
)
from bench_serve import MODEL_NAME, http_client, model_tokenizer, one_request, start_server, stop_server  # noqa: E402
from testkit.serve_process import free_port  # noqa: E402

WORDS = ("river stone market letter garden window paper silver engine forest number winter signal harbor "
         "candle mirror valley ticket orange thunder pocket ladder copper island blanket rocket meadow lantern "
         "pencil circle bridge planet").split()


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def make_prompt(tokenizer, tokens: int, seed: str) -> str:
    """A text of about ``tokens`` tokens, its own for each ``seed`` (its first words already differ)."""
    rng = random.Random(seed)
    words = [f"Session {seed}."]
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(64)]
    return " ".join(words)


def pool_figures(url: str) -> dict:
    blocks = (http_client().get(url + "/v1/cache/stats").json().get("kv_blocks") or {})
    return {k: blocks.get(k) for k in ("allocated", "total", "allocated_bytes", "budget_bytes", "cached")}


def one_round(url: str, prompts: list[str], max_tokens: int) -> dict:
    """Every prompt sent at once by its own client; TTFTs, tokens and aggregate tok/s."""
    ttfts, tokens = [], [0]
    lock = threading.Lock()
    https = [http_client() for _ in prompts]

    failures = []

    def client(i: int) -> None:
        try:
            t, n = one_request(url, "Summarize the text above in one sentence.", max_tokens, prompts[i], https[i])
        except Exception as exc:  # noqa: BLE001 - counted and reported: a timed-out client is a result too
            failures.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            ttfts.append(t)
            tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for h in https:
        h.close()
    if failures:
        print(f"  {len(failures)} of {len(prompts)} requests failed: {failures[0]}", flush=True)
    if not ttfts:
        raise RuntimeError(f"every request of the round failed ({failures[0]})")
    return {"ttfts": ttfts, "tokens": tokens[0], "tok_s": tokens[0] / wall, "wall_s": wall, "failed": len(failures)}


def summary(rounds: list[dict]) -> dict:
    ttfts = sorted(t for r in rounds for t in r["ttfts"])
    q = statistics.quantiles(ttfts, n=20, method="inclusive") if len(ttfts) > 1 else ttfts * 19
    return {"ttft_p50": statistics.median(ttfts), "ttft_p95": q[18],
            "tok_s": statistics.median(r["tok_s"] for r in rounds), "tok_s_rounds": [r["tok_s"] for r in rounds]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, random_shape="not applicable")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer-load", action="store_true",
                   help="also run one round of the load on mlx_lm.server (its RSS after it)")
    p.add_argument("--idle-release", type=float, default=0.0,
                   help="also run a third mlxkv server with this --kv-idle-release (seconds; 0: none)")
    p.add_argument("--json", help="also write every figure to this JSON file")
    args = p.parse_args()
    if model_spec(p, args, hidden=0, layers=0) == "random":
        p.error("this benchmark compares against mlx_lm.server on a real model: give a GGUF or a folder")
    return args


def main() -> None:
    args = parse_args()
    blas = ensure_openblas()
    path = resolve_spec(args.model)
    dequantize = not args.keep_quantized
    peer = peer_folder(path, dequantize=dequantize)
    extra = ["--dequantize"] if path.is_file() and dequantize else []
    print_header(blas, f"{path.name}", peer, " ".join([str(path), *extra]))
    print("note: a shared machine (2 cores, other sessions running): short runs, read the ratios, not the absolutes")
    MODEL_NAME[0] = str(peer)
    tokenizer = model_tokenizer(str(peer))
    out: dict = {"settings": vars(args), "blas": blas}

    # 1. mlx_lm.server alone
    port = free_port()
    proc = start_server("mlx-lm", str(peer), port, args.clients, timeout=900)
    url = f"http://127.0.0.1:{port}"
    try:
        time.sleep(2)
        peer_rss = {"start": rss_mb(proc.pid)}
        one_request(url, "warm up", 4, http=http_client())
        peer_rss["warm"] = rss_mb(proc.pid)
        print(f"mlx_lm.server: RSS {peer_rss['start']:.0f} MB at start, {peer_rss['warm']:.0f} MB after a warm-up "
              "request", flush=True)
        if args.peer_load:
            prompts = [make_prompt(tokenizer, args.prompt_tokens, f"peer-{c}") for c in range(args.clients)]
            r = one_round(url, prompts, args.max_tokens)
            peer_rss["loaded"] = rss_mb(proc.pid)
            peer_rss["round"] = summary([r])
            print(f"mlx_lm.server: {peer_rss['loaded']:.0f} MB after {args.clients} clients x ~{args.prompt_tokens} "
                  f"tokens (TTFT p50 {peer_rss['round']['ttft_p50'] * 1e3:.0f} ms, "
                  f"{peer_rss['round']['tok_s']:.1f} tok/s)", flush=True)
    finally:
        stop_server(proc)
    out["mlx-lm"] = peer_rss

    # 2. the three mlxkv servers, taking turns
    arms = {"growing": [], "preallocated": ["--kv-preallocate"]}
    if args.idle_release:
        arms[f"idle-release {args.idle_release:g}s"] = ["--kv-idle-release", str(args.idle_release)]
    procs, urls, figures = {}, {}, {}
    try:
        for name, options in arms.items():
            port = free_port()
            procs[name] = start_server("mlxkv", str(path), port, args.clients, extra=extra + options, timeout=900)
            urls[name] = f"http://127.0.0.1:{port}"
        time.sleep(2)
        for name in arms:
            figures[name] = {"start_rss": rss_mb(procs[name].pid), "start_pool": pool_figures(urls[name]),
                             "rounds": [], "rss": [], "pool": []}
            print(f"mlxkv serve {name}: RSS {figures[name]['start_rss']:.0f} MB at start, pool "
                  f"{figures[name]['start_pool']}", flush=True)
        names = list(arms)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                prompts = [make_prompt(tokenizer, args.prompt_tokens, f"{name}-{r}-{c}") for c in range(args.clients)]
                result = one_round(urls[name], prompts, args.max_tokens)
                f = figures[name]
                f["rounds"].append(result)
                f["rss"].append(rss_mb(procs[name].pid))
                f["pool"].append(pool_figures(urls[name]))
                print(f"  round {r} {name:20s}: TTFT p50 {statistics.median(result['ttfts']) * 1e3:6.0f} ms, "
                      f"{result['tok_s']:6.1f} tok/s, RSS {f['rss'][-1]:.0f} MB, pool {f['pool'][-1]['allocated']} of "
                      f"{f['pool'][-1]['total']} blocks", flush=True)
        idle = names[2] if len(names) > 2 else None
        deadline = time.monotonic() + args.idle_release + 30
        while idle and pool_figures(urls[idle])["allocated"] > figures[idle]["start_pool"]["allocated"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if idle:
            figures[idle]["after_idle_rss"] = rss_mb(procs[idle].pid)
            figures[idle]["after_idle_pool"] = pool_figures(urls[idle])
        http_client().post(urls["growing"] + "/v1/cache/reset", json={})
        time.sleep(1)
        figures["growing"]["after_reset_rss"] = rss_mb(procs["growing"].pid)
        figures["growing"]["after_reset_pool"] = pool_figures(urls["growing"])
    finally:
        for proc in procs.values():
            stop_server(proc)

    print(f"\n{args.clients} clients x ~{args.prompt_tokens}-token prompts (new each round), {args.max_tokens} tokens "
          f"each, {args.rounds} rounds in turn; RSS in MB")
    print(f"  {'server':28s} {'idle':>6s} {'after rounds':>13s} {'TTFT p50':>9s} {'p95':>7s} {'tok/s':>7s}")
    if "round" in peer_rss:
        print(f"  {'mlx_lm.server':28s} {peer_rss['warm']:6.0f} {peer_rss['loaded']:13.0f} "
              f"{peer_rss['round']['ttft_p50'] * 1e3:7.0f}ms {peer_rss['round']['ttft_p95'] * 1e3:5.0f}ms "
              f"{peer_rss['round']['tok_s']:7.1f}   (one round)")
    else:
        print(f"  {'mlx_lm.server':28s} {peer_rss['warm']:6.0f}")
    for name in names:
        f = figures[name]
        f["summary"] = summary(f["rounds"])
        s = f["summary"]
        print(f"  {'mlxkv ' + name:28s} {f['start_rss']:6.0f} {max(f['rss']):13.0f} {s['ttft_p50'] * 1e3:7.0f}ms "
              f"{s['ttft_p95'] * 1e3:5.0f}ms {s['tok_s']:7.1f}")
    print(f"  idle mlxkv (growing) / idle mlx_lm.server (after its warm-up): "
          f"x{figures['growing']['start_rss'] / peer_rss['warm']:.2f}; preallocated: "
          f"x{figures['preallocated']['start_rss'] / peer_rss['warm']:.2f}")
    print(f"  mlxkv growing after POST /v1/cache/reset: {figures['growing']['after_reset_rss']:.0f} MB, pool "
          f"{figures['growing']['after_reset_pool']['allocated']} blocks")
    if idle:
        print(f"  mlxkv {idle}: RSS {figures[idle]['after_idle_rss']:.0f} MB once idle, pool "
              f"{figures[idle]['after_idle_pool']['allocated']} blocks")
    out["mlxkv"] = figures
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
