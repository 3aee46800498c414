"""What a disk-tier hit costs the streams already decoding: their longest token gap while a restarted server brings
a long prompt's blocks back from disk, and that request's time to first token.

Per side and round: start ``mlxkv serve --kv-disk-cache DIR``, send the long prompt (its blocks are cached), stop
gracefully (they are written to DIR), start again; open a decoding stream, and once it runs send the long prompt
again (a disk hit). Reported: the stream's longest gap between chunks while that hit was served, its median gap,
the hit's TTFT and cached tokens. ``--baseline-python`` names another checkout's interpreter (e.g. a venv over a
tree without the tier's read-ahead; repeatable) to run the same rounds beside this checkout's, alternately.

    python scripts/bench_tier_stall.py --prompt-tokens 2048 --baseline-python ../wt-base/.venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_common import default_model, ensure_openblas, side_env, side_tree  # noqa: E402

import openai  # noqa: E402
from testkit.serve_process import free_port, wait_for_health  # noqa: E402

SENTENCE = "The engine keeps every prompt's key and value blocks so that a later request can skip its prefill. "
STREAM_PROMPT = "Write a long story about a dragon who learns to cook."  # 160 tokens of SmolLM2 greedy: no early end


def start(python: str, model: str, folder: str, port: int) -> subprocess.Popen:
    args = [python, "-m", "mlxkv", "serve", "--kv-disk-cache", folder, "--kv-disk-write-interval", "3600",
            "--port", str(port), "--max-sequences", "4", "--log-level", "warning"]
    if model != "demo":
        args += ["-m", model, "--dequantize"]
    env, cwd = side_env(python)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, timeout=300)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    return proc


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return proc.returncode


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)


def hit(port: int, messages: list[dict]) -> tuple[float, float, int]:
    """(start, seconds to its first content chunk, cached prompt tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, cached = None, 0
    for chunk in client(port).chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return t0, first if first is not None else time.perf_counter() - t0, cached


def stream(port: int, arrivals: list[float], running: threading.Event) -> None:
    """A long greedy answer; ``arrivals`` gets each content chunk's time."""
    for chunk in client(port).chat.completions.create(
            model="m", messages=[{"role": "user", "content": STREAM_PROMPT}], max_tokens=160, temperature=0,
            stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 10:
                running.set()
    running.set()


def drop_page_cache() -> None:
    """Empty the kernel's page cache (Linux, root), so the disk hit really reads the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--drop-caches needs root on Linux: {exc}") from None


def one_round(python: str, model: str, messages: list[dict], drop_caches: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="mlxkv-stall-") as folder:
        port = free_port()
        proc = start(python, model, folder, port)
        try:
            hit(port, messages)  # cold: its blocks are cached, then written to disk by the graceful stop
        finally:
            stop(proc)
        proc = start(python, model, folder, port)
        try:
            arrivals: list[float] = []
            running = threading.Event()
            worker = threading.Thread(target=stream, args=(port, arrivals, running))
            worker.start()
            running.wait(300)
            if drop_caches:
                drop_page_cache()
            t0, ttft, cached = hit(port, messages)
            worker.join(600)
        finally:
            stop(proc)
    gaps = [(b - a, a) for a, b in zip(arrivals, arrivals[1:])]
    during = [g for g, at in gaps if t0 - 0.05 <= at <= t0 + ttft]
    if not arrivals or arrivals[-1] < t0 + ttft:
        raise SystemExit("the decoding stream ended before the disk hit was served: nothing to measure "
                         f"({len(arrivals)} chunks); try a shorter --prompt-tokens")
    return {"ttft_s": ttft, "cached_tokens": cached, "max_gap_during_hit_s": max(during, default=0.0),
            "median_gap_s": statistics.median(g for g, _ in gaps) if gaps else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file, 'demo', or a model path (default: reference GGUF)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="approximate length of the disk-hit prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-python", action="append", default=[],
                        help="another checkout's python, run alternately (repeatable)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="empty the page cache just before the hit (Linux, root): the tier's files come from disk")
    args = parser.parse_args()
    blas = ensure_openblas()
    model = args.model or os.path.expanduser(default_model())
    messages = [{"role": "user", "content": SENTENCE * max(1, args.prompt_tokens // 20)}]
    sides = {"this checkout": sys.executable}
    for python in args.baseline_python:
        sides[f"baseline {python}"] = python
    trees = {name: side_tree(python) for name, python in sides.items()}
    for name, tree in trees.items():
        print(f"{name}: mlxkv from {tree}", file=sys.stderr, flush=True)
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, python in sides.items():
            results[name].append(one_round(python, model, messages, args.drop_caches))
            print(f"{name}: {results[name][-1]}", file=sys.stderr, flush=True)
    summary = {}
    for name, rounds in results.items():
        summary[name] = {key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}
        summary[name]["rounds"] = [{k: round(v, 4) for k, v in r.items()} for r in rounds]
    print(json.dumps({"model": Path(model).name, "blas": blas, "prompt_tokens_approx": args.prompt_tokens,
                      "trees": trees, "results": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
