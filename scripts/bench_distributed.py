"""Distributed serving benchmark: one ``mlxkv serve`` process vs N tensor- or pipeline-parallel ranks (``--mode``)
under ``mlx.launch`` (ring backend over loopback), and ``mlx_lm.server`` under the same ``mlx.launch`` (with
``--pipeline`` in pipeline mode, which mlx-lm 0.32 supports for deepseek_v2/v3 only), on one workload.

Loopback on one machine measures correctness and memory, not speed: the ranks share this machine's cores and
every layer adds a loopback all-reduce, so tok/s here is a floor, not what N Macs over Thunderbolt give. Reported
per server: whether each greedy completion equals the single process's, KV bytes per token held by each rank
(mlxkv: from ``/v1/cache/stats``; mlx_lm.server keeps dense per-request caches and reports none), and aggregate
output tok/s for ``--requests`` concurrent completions of ``--max-tokens`` tokens.

The model (``--model``, default: the reference SmolLM2-135M-Instruct GGUF, dequantized to float32 on both
sides; mlx_lm.server loads the float32 folder ``mlxkv.gguf.convert`` writes). Its KV heads must divide
``--ranks`` in tensor mode (SmolLM2: 3 KV heads, so ``--ranks 3``); in pipeline mode any rank count up to its layer
count does.

    python scripts/bench_distributed.py --ranks 3 --requests 4 --max-tokens 16
    python scripts/bench_distributed.py --mode pipeline --ranks 2 --skip-mlx-lm
    python scripts/bench_distributed.py --model path/to/test-llama --ranks 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_common import add_model_args, ensure_openblas, model_spec, peer_folder, resolve_spec  # noqa: E402
from testkit.launch_process import ring_port  # noqa: E402
from testkit.serve_process import free_port, wait_for_health  # noqa: E402

PROMPTS = ["Tell me about the ocean.", "What is a prime number?", "Name three colors.", "Why is the sky blue?",
           "Write a haiku about rain.", "What do cats eat?", "Explain gravity briefly.", "Who wrote Hamlet?"]


class Server:
    """A server command in its own process group, with its output in a temporary file."""

    def __init__(self, name: str, cmd: list[str], port: int):
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})

    def wait(self, timeout: float = 600) -> None:
        try:
            wait_for_health(f"http://127.0.0.1:{self.port}", self.proc, Path(self.log.name), timeout,
                            path="/v1/models")
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: {exc}") from None

    def stats(self) -> dict | None:
        try:
            return json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/cache/stats", timeout=10))
        except OSError:
            return None

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
            time.sleep(1)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        os.unlink(self.log.name)


def workload(port: int, requests: int, max_tokens: int, model: str) -> tuple[list[str], float, int]:
    """``requests`` concurrent greedy completions; their texts, wall seconds and completion tokens."""
    def one(prompt: str) -> tuple[str, int]:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(req, timeout=1800))
        return out["choices"][0]["text"], out["usage"]["completion_tokens"]

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(one, prompts))
    return [t for t, _ in results], time.perf_counter() - start, sum(n for _, n in results)


def single_bytes_per_token(spec: str, dequantize: bool) -> float:
    """KV bytes per token of one process holding every head (the paged pool's block bytes / block size)."""
    from mlxkv.config import KvCacheConfig
    from mlxkv.kv import CachePool
    from mlxkv.models import load

    pool = CachePool(load(spec, progress=False, dequantize=dequantize).model, backend="paged",
                     kv_config=KvCacheConfig(backend="paged"), num_blocks=2)
    return pool.paged.bytes_per_block / pool.paged.block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, "not servable: pass a folder")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of each mlx.launch (default 2)")
    parser.add_argument("--requests", type=int, default=4, help="concurrent completions (default 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    parser.add_argument("--mode", choices=("tensor", "pipeline"), default="tensor",
                        help="--distributed mode of the mlxkv launch (default tensor)")
    parser.add_argument("--skip-mlx-lm", action="store_true", help="do not run mlx_lm.server under mlx.launch")
    args = parser.parse_args()
    blas = ensure_openblas()
    spec = model_spec(parser, args, hidden=256, layers=4)
    if spec == "random":
        parser.error("--model random is an in-memory model the server processes cannot load: pass a model folder "
                     "(e.g. one written by scripts/make_test_models.py) or a GGUF file")
    path = resolve_spec(spec)
    dequantize = not args.keep_quantized and path.suffix == ".gguf"
    ours = [str(path)] + (["--dequantize"] if dequantize else [])
    launch = ["mlx.launch", "-n", str(args.ranks), "--backend", "ring"]
    print(f"# bench_distributed: {path.name}, {args.mode} parallel, {args.ranks} ranks over loopback (ring), "
          f"{args.requests} concurrent greedy completions x {args.max_tokens} tokens; BLAS: {blas}")
    print("# loopback on one machine: correctness and memory, not speed (the ranks share these cores)")
    per_token = single_bytes_per_token(str(path), dequantize)
    rows = []
    runs = [("mlxkv serve (1 process)", lambda p: [sys.executable, "-m", "mlxkv", "serve", "-m", *ours,
                                                   "--port", str(p), "--log-level", "warning"], False),
            (f"mlxkv serve --distributed {args.mode} ({args.ranks} ranks)",
             lambda p: [*launch, "--starting-port", str(ring_port(args.ranks)), "--", sys.executable, "-m", "mlxkv",
                        "serve", "-m", *ours, "--distributed", args.mode, "--port", str(p), "--log-level", "warning"],
             True)]
    if not args.skip_mlx_lm:
        folder = peer_folder(path, dequantize=dequantize)
        pipeline = ["--pipeline"] if args.mode == "pipeline" else []
        runs.append((" ".join(["mlx_lm.server", *pipeline, f"({args.ranks} ranks)"]),
                     lambda p: [*launch, "--starting-port", str(ring_port(args.ranks)), "--", sys.executable, "-m",
                                "mlx_lm.server", "--model", str(folder), *pipeline, "--port", str(p)], True))
    reference = None
    for name, cmd, distributed in runs:
        port = free_port()
        server = Server(name, cmd(port), port)
        try:
            server.wait()
            model = "default_model" if name.startswith("mlx_lm") else "m"  # mlx_lm.server: the model it loaded
            workload(port, 1, 2, model)  # warm-up
            texts, seconds, tokens = workload(port, args.requests, args.max_tokens, model)
            stats = server.stats() or {}
        except (RuntimeError, OSError) as exc:
            rows.append((name, f"failed: {str(exc).splitlines()[0]}", "", ""))
            continue
        finally:
            server.stop()
        reference = texts if reference is None else reference
        same = sum(a == b for a, b in zip(texts, reference))
        dist = stats.get("distributed")
        if dist:
            kv = f"{dist['bytes_per_block_per_rank'] / stats['kv_blocks']['block_size']:.0f}"
        elif "kv_blocks" in stats and not distributed:
            kv = f"{per_token:.0f}"
        else:
            kv = "n/a (dense per-request caches)"
        rows.append((name, f"{same}/{len(texts)} equal to 1 process", kv, f"{tokens / seconds:.2f}"))
    print("\n| server | greedy outputs | KV bytes/token per rank | output tok/s |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
