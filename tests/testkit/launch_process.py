"""``mlxkv serve --distributed`` under a real ``mlx.launch`` over loopback (ring backend), for tests."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from testkit.serve_process import free_port


def ring_port(ranks: int) -> int:
    """A ``--starting-port`` for a ring of ``ranks`` ranks: ``ranks`` consecutive loopback ports, all free now and
    below the kernel's ephemeral range. mlx.launch gives rank i the port ``start + i``; a port of
    :func:`free_port` is ephemeral, and its neighbour may be the source port of any connection the suite opens
    meanwhile (rank 1 then fails to bind, and mlx.launch stops rank 0 yet exits 0)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 49152  # IANA's dynamic range, macOS's default
    for _ in range(200):
        start = random.randrange(10000, ephemeral - ranks)
        try:
            with contextlib.ExitStack() as held:
                for port in range(start, start + ranks):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
    raise RuntimeError(f"no {ranks} consecutive free loopback ports below {ephemeral}")


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

    def stop(self) -> str:
        """Stop every rank (the whole process group: mlx.launch terminated alone leaves its ranks running); returns
        the launch's whole output. SIGTERM first: rank 0 drains, the ranks flush their KV tiers and exit."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 30  # rank 0 drains and tells the others to stop; each flushes its tier
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # any rank still there
        self.proc.wait(timeout=30)
        log = self.log()
        os.unlink(self.log_path)
        return log


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies left to an init that does not reap them do
    not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def start_launch(n: int, *args: str, mode: str = "tensor") -> Launch:
    """Start ``mlx.launch -n N --backend ring -- python -m mlxkv serve --distributed MODE ARGS --port P`` (not
    waiting for it: see :meth:`Launch.wait_ready`)."""
    import openai

    port, ring = free_port(), ring_port(n)
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
