"""A real ``mlxkv serve`` process on a free loopback port, for tests that go through the product's own door."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from typing import Iterator


def free_port() -> int:
    """A loopback port nothing listens on (the moment it is asked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(*args: str, start_timeout: float = 120) -> Iterator["object"]:
    """``python -m mlxkv serve ARGS --port P``; yields an official ``openai`` client once ``/v1/models`` answers,
    and stops the server afterwards. A server that exits before answering fails the test with its output."""
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=60)
