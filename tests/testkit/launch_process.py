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
    """A launch of ``mlxkv serve --distributed``: the official client of rank 0's server, the ``mlx.launch``
    process (in its own process group) and its output."""

    client: object
    url: str
    proc: subprocess.Popen
    log_path: str
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> pid, from the followers' ready lines

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 240) -> "Launch":
        """Return once rank 0's ``/v1/models`` answers (fails the test with the launch's output otherwise)."""
        import openai

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                self.client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the distributed server did not come up:\n" + self.log()
                time.sleep(0.3)
        self.ranks = {int(r): int(p) for r, p in re.findall(r"rank (\d+) of \d+ ready \(pid (\d+)", self.log())}
        return self

    def stop(self) -> None:
        """Stop every rank (the whole process group: mlx.launch terminated alone leaves its ranks running)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)  # rank 0 drains and tells the others to stop
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # any rank still there
        self.proc.wait(timeout=30)
        os.unlink(self.log_path)


def start_launch(n: int, *args: str, mode: str = "tensor") -> Launch:
    """Start ``mlx.launch -n N --backend ring -- python -m mlxkv serve --distributed MODE ARGS --port P`` (not
    waiting for it: see :meth:`Launch.wait_ready`)."""
    import openai

    port, ring = free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        cmd = ["mlx.launch", "-n", str(n), "--backend", "ring", "--starting-port", str(ring), "--",
               sys.executable, "-m", "mlxkv", "serve", "--distributed", mode, *args, "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    return Launch(client, url, proc, log.name)


@contextlib.contextmanager
def launch_serve(n: int, *args: str) -> Iterator[Launch]:
    """:func:`start_launch`, ready; stopped afterwards."""
    launch = start_launch(n, *args)
    try:
        yield launch.wait_ready()
    finally:
        launch.stop()
