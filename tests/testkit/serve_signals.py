"""A ``mlxkv serve`` process a test can signal, kill and restart (persistence and shutdown tests)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from typing import Iterator

import openai

from testkit.serve_process import free_port, wait_for_health

MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 12}]  # ~290 tokens


class Server:
    """A ``python -m mlxkv serve`` process (the demo model unless ``-m``) and an official client for it."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "serve", *args, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=120)
        wait_for_health(f"http://127.0.0.1:{self.port}", self.proc)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
        """Send ``sig``; the exit status and everything the process wrote."""
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def cached_tokens(self, messages=MESSAGES) -> int:
        r = self.client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens


@contextlib.contextmanager
def server(*args: str) -> Iterator[Server]:
    s = Server(*args)
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(timeout=30)
