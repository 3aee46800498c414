"""Time to first token after a restart: cold vs warm from the disk KV tier, on a real ``mlxkv serve`` process.

1. start ``mlxkv serve --kv-disk-cache DIR`` (empty folder), stream one chat request with a long prompt: the
   cold TTFT (the whole prompt is prefilled);
2. stop the server with SIGTERM (the graceful stop writes the cached blocks to DIR), start it again;
3. stream the same request: the TTFT after the restart (the prompt's blocks come back from disk).

The model defaults to the project's reference GGUF (SmolLM2-135M-Instruct, dequantized to float32; OpenBLAS
preloaded when installed); ``--model demo`` runs the embedded demo model.

    python scripts/bench_restart.py --prompt-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_common import default_model, ensure_openblas  # noqa: E402

import openai  # noqa: E402
from testkit.serve_process import free_port, wait_for_health  # noqa: E402

SENTENCE = "The engine keeps every prompt's key and value blocks so that a later request can skip its prefill. "


def start(model: str, folder: str, port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "mlxkv", "serve", "--kv-disk-cache", folder, "--port", str(port),
            "--max-sequences", "1", "--log-level", "warning"]
    if model != "demo":
        args += ["-m", model, "--dequantize"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, timeout=300)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    return proc


def ttft(port: int, messages: list[dict]) -> tuple[float, int, int]:
    """(seconds to the first content chunk, prompt tokens, cached prompt tokens) of one streamed request."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    first = None
    usage = None
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    return first if first is not None else time.perf_counter() - t0, usage.prompt_tokens, \
        usage.prompt_tokens_details.cached_tokens


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file, 'demo', or a model path (default: reference GGUF)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="approximate prompt length")
    args = parser.parse_args()
    blas = ensure_openblas()
    model = args.model or os.path.expanduser(default_model())
    sentence_tokens = 20  # about, for SmolLM2's tokenizer; the figure printed is the real count
    messages = [{"role": "user", "content": SENTENCE * max(1, args.prompt_tokens // sentence_tokens)}]
    proc = None
    with tempfile.TemporaryDirectory(prefix="mlxkv-restart-") as folder:
        try:
            port = free_port()
            proc = start(model, folder, port)
            cold, n_prompt, cached_cold = ttft(port, messages)
            rc1, log1 = stop(proc)
            files = len(list(Path(folder).glob("*.mlxkvblk")))
            t0 = time.perf_counter()
            proc = start(model, folder, port)
            restart_s = time.perf_counter() - t0
            warm, _, cached_warm = ttft(port, messages)
            primary, _, _ = ttft(port, messages)  # the same prompt again: a primary-pool hit, for reference
            rc2, _ = stop(proc)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    saved = next((line for line in log1.splitlines() if "KV tier saved" in line), "")
    result = {"model": Path(model).name, "blas": blas, "prompt_tokens": n_prompt,
              "cold_ttft_s": round(cold, 4), "restart_ttft_s": round(warm, 4),
              "primary_hit_ttft_s": round(primary, 4), "speedup": round(cold / warm, 1),
              "cached_tokens_cold": cached_cold, "cached_tokens_after_restart": cached_warm,
              "tier_files": files, "restart_seconds": round(restart_s, 1), "exit_codes": [rc1, rc2],
              "flush": saved.strip()}
    print(json.dumps(result, indent=2))
    return 0 if rc1 == rc2 == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
