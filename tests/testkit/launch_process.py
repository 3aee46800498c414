"""``mlxkv serve --distributed`` under a real ``mlx.launch`` over loopback (ring backend), for tests."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

from testkit.serve_process import free_port


def launch_available() -> str | None:
    """Why ``mlx.launch`` cannot run here (None when it can)."""
    if shutil.which("mlx.launch") is None:
        return "mlx.launch is not installed"
    try:
        import mlx.core as mx
    except ImportError as exc:
        return f"mlx is not importable: {exc}"
    if not mx.distributed.is_available():
        return "this MLX build has no distributed backend"
    return None


@dataclass
class Launch:
    """A running launch: the official client of rank 0's server, the ``mlx.launch`` process and its output."""

    client: object
    url: str
    proc: subprocess.Popen
    log_path: str
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> pid, from the followers' ready lines

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def launch_serve(n: int, *args: str, start_timeout: float = 180) -> Iterator[Launch]:
    """``mlx.launch -n N --backend ring -- python -m mlxkv serve --distributed tensor ARGS --port P``; yields once
    ``/v1/models`` answers; stops every rank afterwards (its own process group: mlx.launch leaves its ranks running
    when it is terminated alone)."""
    import openai

    port, ring = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = ["mlx.launch", "-n", str(n), "--backend", "ring", "--starting-port", str(ring), "--",
           sys.executable, "-m", "mlxkv", "serve", "--distributed", "tensor", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    launch = Launch(client, url, proc, log.name)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert proc.poll() is None, launch.log()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the distributed server did not come up:\n" + launch.log()
                time.sleep(0.3)
        launch.ranks = {int(r): int(p) for r, p in re.findall(r"rank (\d+) of \d+ ready \(pid (\d+)", launch.log())}
        yield launch
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # any rank still there
        log.close()
        os.unlink(log.name)
