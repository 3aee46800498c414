"""A real ``mlxkv serve`` process on a free loopback port, for tests and scripts that go through the product's door:
:func:`free_port`, :func:`wait_for_health` (any server process: mlxkv or mlx_lm.server) and :func:`serve_process`.
Standard library only, so every script can use it."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Iterator


def free_port() -> int:
    """A loopback port nothing listens on (the moment it is asked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _output(proc: subprocess.Popen, log: Path | IO[str] | None, alive: bool) -> str:
    """What the server wrote: its log (a path or an open file), else its piped stdout once it has exited."""
    if isinstance(log, (str, Path)):
        return Path(log).read_text()[-3000:]
    if log is not None:
        log.seek(0)
        return log.read()[-3000:]
    if not alive and proc.stdout is not None:
        return proc.stdout.read()[-3000:]
    return ""


def wait_for_health(url: str, proc: subprocess.Popen, log: Path | IO[str] | None = None, timeout: float = 120,
                    path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200.

    Args:
        url: the server's root, ``http://127.0.0.1:PORT``.
        proc: the server's process; its exit ends the wait.
        log: where its output goes (a path or an open file), quoted in the error; ``None``: its piped stdout.

    Raises:
        RuntimeError: the process exited first, or ``timeout`` seconds passed (the process is left running).
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {_output(proc, log, alive=False)}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # refused, reset, timed out, or an HTTPError such as a 503 while it loads
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up in {timeout:.0f} s: {_output(proc, log, alive=True)}")
        time.sleep(0.1)


@contextlib.contextmanager
def serve_process(*args: str, start_timeout: float = 120) -> Iterator["object"]:
    """``python -m mlxkv serve ARGS --port P``; yields an official ``openai`` client once ``/health`` answers, and
    stops the server afterwards. A server that exits before answering fails the test with its output."""
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, timeout=start_timeout)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
