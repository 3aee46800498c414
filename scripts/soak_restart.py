"""``soak_serve.py --restart-mid-soak``: the soak against a real ``mlxkv serve`` process restarted half-way.

See soak_serve.py's docstring for what passes. The server is a child process (a restart is a new process, as in
production); requests the graceful stop ended are retried until they complete or the soak's deadline passes.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RETRYABLE = ("shutdown", "http_503", "refused")


def _start(model: str, port: int, folder: str, args) -> subprocess.Popen:
    from testkit.serve_process import wait_for_health

    cmd = [sys.executable, "-m", "mlxkv", "serve", "-m", model, "--port", str(port), "--kv-disk-cache", folder,
           "--kv-disk-write-interval", "0.5", "--max-sequences", str(args.max_sequences),
           "--max-queue-depth", str(args.requests), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    return proc


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def restart_soak(args, one_request) -> int:
    """Run the restart soak; the process exit code (0: nothing lost or leaked)."""
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from testkit.serve_process import free_port

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from testkit.models import write_test_model

        model = str(write_test_model("llama", Path(tmp.name) / "llama"))
    folder = str(Path(tmp.name) / "tier")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = _start(model, port, folder, args)
    ended = 0
    lock = threading.Lock()
    retries: list[str] = []
    deadline = time.monotonic() + args.max_seconds

    def request(rng: random.Random) -> str:
        nonlocal ended
        while True:
            state = rng.getstate()  # a retry sends the same request again
            outcome = one_request(url, rng, args.disconnect_prob, args.repeat_prob, deadline)
            if outcome not in RETRYABLE or time.monotonic() > deadline:
                break
            with lock:
                retries.append(outcome)
            rng.setstate(state)
            time.sleep(0.2)
        with lock:
            ended += 1
        return outcome

    restarted: dict = {}

    def restarter() -> None:
        while ended < args.requests // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        restarted["rc"], restarted["log"] = _stop(first)
        restarted["proc"] = _start(model, port, folder, args)

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    start = time.monotonic()
    rngs = [random.Random(args.seed * 100003 + i) for i in range(args.requests)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        outcomes = list(pool.map(request, rngs))
    thread.join(120)
    second = restarted.get("proc")
    if second is None:
        print("the restart did not happen (raise --max-seconds)")
        return 1
    settle = time.monotonic() + 30
    stats = httpx.get(url + "/v1/cache/stats").json()
    while any(stats.get(k, 0) for k in ("pool_sequences", "running", "prefilling", "preempted")) \
            and time.monotonic() < settle:
        time.sleep(0.05)
        stats = httpx.get(url + "/v1/cache/stats").json()
    rc2, log2 = _stop(second)
    tmp.cleanup()
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    lost = sum(n for k, n in counts.items() if k not in ("completed", "disconnected"))
    leaked = stats["pool_sequences"] + stats["running"] + stats["prefilling"] + stats.get("preempted", 0)
    disk_hits = (stats.get("tier") or {}).get("secondary", {}).get("hits_disk", 0)
    tracebacks = restarted["log"].count("Traceback") + log2.count("Traceback")
    print(f"requests: {len(outcomes)} in {time.monotonic() - start:.1f}s  outcomes: {counts}  "
          f"retried after the restart: {len(retries)} ({ {k: retries.count(k) for k in set(retries)} })")
    print(f"lost: {lost}  leaked sequences: {leaked}  KV bytes held: {stats['kv_bytes']}  exit codes: "
          f"{restarted['rc']}, {rc2}  tracebacks: {tracebacks}  disk-tier hits after the restart: {disk_hits} blocks")
    bad = lost or leaked or stats["kv_bytes"] or restarted["rc"] or rc2 or tracebacks or not disk_hits
    return 1 if bad else 0
