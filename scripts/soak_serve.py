"""Soak ``mlxkv serve`` on loopback: many requests of random lengths, random disconnects, then check for leaks.

Runs the server in this process (uvicorn on a background thread, 127.0.0.1, a free port) so the engine's own
stats can be checked at the end: no running or open sequences, no KV bytes held. Prints the process RSS
after warm-up and at the end. Bounded in request count and wall time.

    python scripts/soak_serve.py --requests 80 --concurrency 8 --max-seconds 120

``--restart-mid-soak`` runs ``mlxkv serve`` as a child process with a disk KV tier instead and, once half the
requests have ended, stops it with SIGTERM while the rest are in flight and starts it again on the same port.
Requests the stop ended (the shutdown error event, a 503, a refused connection while it restarts) are sent
again; the soak passes when none is lost (every request completes or is disconnected by its client), both
servers exit 0 without a traceback, the restarted one ends holding no sequence and no KV bytes, and it served
the repeated prompts from the disk tier.

    python scripts/soak_serve.py --restart-mid-soak --requests 60 --max-seconds 120
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit: the tiny test models

WORDS = ("the import statement binds names in a module namespace while generators yield values lazily and "
         "context managers release what they hold when the block ends").split()


def rss_mb() -> float:
    """Resident set size of this process, from /proc (Linux) or getrusage's peak elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


#: Prompts that come back (``--repeat-prob``): long enough to be served from the prefix cache.
REPEATED = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40 + 10 * i)) for i in range(4)]


def one_request(url: str, rng: random.Random, disconnect_prob: float, repeat_prob: float, deadline: float) -> str:
    """Send one random request; returns its outcome: completed | disconnected | http_<status> | error."""
    import httpx

    if time.monotonic() > deadline:
        return "skipped"
    if rng.random() < repeat_prob:  # a prompt asked before: cached but for its last token, it joins the decode
        prompt = REPEATED[rng.randrange(len(REPEATED))]
    else:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    chat = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(1, 96), "temperature": rng.choice([0.0, 0.8]),
                  "stream": rng.random() < 0.6, "n": rng.choice([1, 1, 1, 2])}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    disconnect = rng.random() < disconnect_prob
    try:
        if body["stream"]:
            with httpx.Client(timeout=60) as http, http.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    return f"http_{r.status_code}"
                cut = rng.randint(1, 8) if disconnect else None
                lines = r.iter_lines()
                for i, line in enumerate(lines):
                    if cut is not None and i >= cut:
                        return "disconnected"  # leaving the with-blocks closes the connection mid-stream
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            return "shutdown" if event["error"].get("code") == "server_shutting_down" else "error"
            return "completed"
        timeout = httpx.Timeout(60, read=rng.uniform(0.005, 0.05)) if disconnect else 60
        r = httpx.post(url + path, json=body, timeout=timeout)
        if r.status_code != 200:
            return f"http_{r.status_code}"
        r.json()["usage"]
        return "completed"
    except httpx.ReadTimeout:
        return "disconnected" if disconnect else "error"
    except httpx.ConnectError:  # no server listening (a restart)
        return "refused"
    except Exception as exc:  # noqa: BLE001 - a soak counts failures, it does not stop on them
        print(f"request error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return "error"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: a freshly written tiny llama test model)")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--disconnect-prob", type=float, default=0.3)
    p.add_argument("--max-sequences", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-backend", choices=["paged", "dense"], default="paged")
    p.add_argument("--kv-cache-budget", type=int, default=None, help="paged KV bytes (small: forces preemption)")
    p.add_argument("--batched-prefill", action="store_true", help="the engine's opt-in batched prefill")
    p.add_argument("--repeat-prob", type=float, default=0.25,
                   help="chance a request repeats one of four earlier prompts (its last token joins a decode step)")
    p.add_argument("--restart-mid-soak", action="store_true",
                   help="a real server process with a disk KV tier, restarted (SIGTERM) half-way through")
    args = p.parse_args()
    if args.restart_mid_soak:
        from soak_restart import restart_soak

        return restart_soak(args, one_request)

    import httpx

    from mlxkv.config import EngineConfig, KvCacheConfig, RunConfig
    from mlxkv.server.runner import ServerThread, build

    tmp = None
    model = args.model
    if model is None:
        from testkit.models import write_test_model

        tmp = tempfile.TemporaryDirectory()
        model = str(write_test_model("llama", Path(tmp.name) / "llama"))
    engine = EngineConfig(max_sequences=args.max_sequences, max_queue_depth=args.requests,
                          batched_prefill=args.batched_prefill)
    kv = KvCacheConfig(backend=args.kv_backend, kv_cache_budget=args.kv_cache_budget or "auto")
    parts = build(RunConfig(model=model, kv=kv, engine=engine))
    with ServerThread(parts.app, host="127.0.0.1") as srv:
        warm = httpx.post(srv.url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=60)
        warm.raise_for_status()
        rss_start = rss_mb()
        start = time.monotonic()
        deadline = start + args.max_seconds
        rngs = [random.Random(args.seed * 100003 + i) for i in range(args.requests)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = list(pool.map(
                lambda r: one_request(srv.url, r, args.disconnect_prob, args.repeat_prob, deadline), rngs))
        elapsed = time.monotonic() - start
        settle = time.monotonic() + 30
        stats = httpx.get(srv.url + "/v1/cache/stats").json()
        busy = ("pool_sequences", "running", "prefilling", "preempted")
        while any(stats.get(k, 0) for k in busy) and time.monotonic() < settle:
            time.sleep(0.05)
            stats = httpx.get(srv.url + "/v1/cache/stats").json()
        rss_end = rss_mb()
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    leaked = stats["pool_sequences"] + stats["running"] + stats["prefilling"] + stats.get("preempted", 0)
    print(f"requests: {len(outcomes)} in {elapsed:.1f}s  outcomes: {counts}")
    print(f"engine: finished {stats['finished_total']}, cancelled {stats['cancelled_total']}, "
          f"failed {stats['failed_total']}, tokens generated {stats['generation_tokens_total']}, "
          f"max batch {stats['max_batch']}, batched steps {stats['batched_steps_total']}, "
          f"batched prefills {stats['batched_prefills_total']}, "
          f"prompts joining a decode step {stats.get('prefills_joined_decode_total', 0)}, "
          f"preemptions {stats.get('preemptions', 0)}, KV blocks used {stats['kv_blocks'].get('used', 0)}")
    print(f"leaked sequences: {leaked}  KV bytes held: {stats['kv_bytes']}  "
          f"RSS: start {rss_start:.1f} MB, end {rss_end:.1f} MB  (MLX active {stats['mlx_active_bytes'] / 1e6:.1f} MB, "
          f"MLX buffer cache {stats['mlx_cache_bytes'] / 1e6:.1f} MB)")
    if tmp is not None:
        tmp.cleanup()
    bad = leaked or stats["kv_bytes"] or stats["kv_blocks"].get("used", 0) or counts.get("error", 0) or any(k.startswith("http_") for k in counts)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
