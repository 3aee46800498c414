"""Ctrl-C during a long prefill returns control within a second (issue 37, finding 2), with SmolLM2 on the CPU
where a ~3,000-token prompt takes minutes to prefill quantized: ``mlxkv generate -`` gets SIGINT as a terminal
sends it, and ``mlxkv chat`` in a real terminal (tmux) gets Ctrl-C while it prefills a pasted message; chat's
``--kv-bits 8`` on SmolLM2 (head_dim 48) answers (finding 3)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testkit.real_model import GGUF
from testkit.terminal import TMUX, Terminal

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
WORDS = "the cat sat on a mat while python programs ran over every loop and function call".split()


def _long_text(words: int = 3000) -> str:
    """About 3,000 SmolLM2 tokens of plain words (one token a word)."""
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {"PYTHONPATH": str(ROOT), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "HOME": str(tmp_path),
           "MLXKV_MODELS_FILE": str(tmp_path / "models.json")}
    if os.environ.get("LD_PRELOAD"):
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    return env


def test_ctrl_c_during_a_generate_prefill_returns_within_a_second(tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text(_long_text())
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv", "generate", "-m", str(GGUF), "--raw", "-"],
                            stdin=prompt.open("rb"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **_env(tmp_path)}, cwd=ROOT)
    newline = threading.Event()
    out = bytearray()

    def read() -> None:
        while chunk := proc.stdout.read(1):
            out.extend(chunk)
            newline.set()

    threading.Thread(target=read, daemon=True).start()
    time.sleep(20)  # the model loads (seconds) and the prefill of ~3,000 tokens is under way (minutes)
    assert proc.poll() is None and not out, "the prefill ended before Ctrl-C: the prompt is too short for the test"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert newline.wait(5)
    printed = time.monotonic() - sent
    proc.wait(10)
    exited = time.monotonic() - sent
    assert proc.returncode == 130 and bytes(out) == b"\n", (proc.returncode, bytes(out), proc.stderr.read())
    assert printed < 1.0 and exited < 1.5, (printed, exited)  # the shell's prompt is back on a line of its own


@pytest.mark.terminal
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux)")
def test_ctrl_c_during_a_chat_prefill_returns_to_the_prompt_within_a_second(tmp_path):
    term = Terminal(["chat", "-m", str(GGUF), "-n", "8"], _env(tmp_path), ROOT)
    try:
        term.wait_for(r"^>>>$", timeout=180)
        term.paste(_long_text())
        term.key("Enter")
        time.sleep(10)  # the paste is read and its prefill is under way (minutes)
        term.key("z")  # typed while the model works: not echoed into the output (Ctrl-C then flushes it)
        time.sleep(0.5)
        sent = time.monotonic()
        term.key("C-c")
        screen = term.wait_for(r"^\[stopped before the answer began: the message was not added\]\n>>>\Z",
                               timeout=10)
        elapsed = time.monotonic() - sent
        assert elapsed < 1.0, (elapsed, screen)
        assert not re.search(r"z\n\[stopped", screen) and "^C" not in screen
        stats = term.send("/stats")  # the chat goes on; the stopped message is not in the conversation
        assert re.search(r"context: \d+ tokens", stats), stats
        assert term.send("Hi") and "[stopped" not in term.screen().split(">>> Hi")[-1]
    finally:
        term.close()


def test_chat_with_a_quantized_kv_cache_answers(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mlxkv", "chat", "-m", str(GGUF), "--kv-bits", "8", "-n", "4"],
                          input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True,
                          env={**os.environ, **_env(tmp_path)}, cwd=ROOT, timeout=600)
    assert done.returncode == 0 and "error" not in done.stderr, done.stderr
    assert len([line for line in done.stdout.splitlines() if line.strip()]) == 2, done.stdout
