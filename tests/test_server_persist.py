"""A real ``mlxkv serve`` process with a disk KV tier: a graceful stop (SIGTERM) saves the cache and exits 0, a
restart hits it; a crash (SIGKILL) after the write-behind interval keeps it; SIGTERM under load ends every open
stream with a final event and logs no traceback."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from testkit.real_model import GGUF
from testkit.serve_signals import server

pytestmark = pytest.mark.server


def tier_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.mlxkvblk"))


def test_sigterm_saves_the_cache_and_the_restart_hits_it(tmp_path):
    # a write interval longer than the test: only the flush at the graceful stop writes the blocks
    args = ("--kv-disk-cache", str(tmp_path), "--kv-disk-write-interval", "3600")
    with server(*args) as s:
        assert s.cached_tokens() == 0
        assert tier_files(tmp_path) == []
        rc, log = s.stop()
    assert rc == 0, log
    assert "Traceback" not in log and "KV tier saved" in log, log
    saved = len(tier_files(tmp_path))
    assert saved >= 17  # every full block of the ~290-token prompt
    with server(*args) as s:
        assert s.cached_tokens() >= 16 * (saved - 2)  # the restart's first request hits the disk tier
        stats = httpx.get(f"http://127.0.0.1:{s.port}/v1/cache/stats").json()
        assert stats["tier"]["secondary"]["hits_disk"] >= saved - 2
        # read on the tier's read-ahead thread, not the engine's
        assert stats["tier"]["secondary"]["disk"]["read_ahead"]["blocks"] >= saved - 2
        assert s.stop()[0] == 0


def test_a_crash_after_the_write_interval_loses_nothing(tmp_path):
    args = ("--kv-disk-cache", str(tmp_path), "--kv-disk-write-interval", "0.3")
    with server(*args) as s:
        assert s.cached_tokens() == 0
        deadline = time.monotonic() + 20
        while len(tier_files(tmp_path)) < 17:  # written behind while the server runs
            assert time.monotonic() < deadline, "write-behind wrote nothing"
            time.sleep(0.1)
        rc, _ = s.stop(signal.SIGKILL)
    assert rc == -signal.SIGKILL
    with server(*args) as s:
        assert s.cached_tokens() >= 16 * 16


def test_sigterm_under_load_ends_every_stream_and_exits_0(tmp_path):
    outcomes: list[str] = []
    started = threading.Semaphore(0)

    def stream(i: int) -> None:
        try:
            chunks = s.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"story {i}"}], max_tokens=900, temperature=1.0,
                seed=i, stream=True)
            first = True
            for chunk in chunks:
                if first:
                    started.release()
                    first = False
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcomes.append("finished")
            outcomes.append("ended")
        except openai.APIError as exc:  # the error event of a graceful stop
            outcomes.append("shutdown" if "shutting down" in str(exc) else f"error: {exc}")

    with server("--kv-disk-cache", str(tmp_path), "--max-sequences", "4") as s:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        rc, log = s.stop()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
    assert rc == 0, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert len([o for o in outcomes if o in ("shutdown", "ended")]) == 4, outcomes
    assert "shutdown" in outcomes, outcomes  # 900 tokens each: at least one was still streaming


@pytest.mark.real_model
def test_the_real_model_restarts_warm(tmp_path):
    """SmolLM2-135M: after SIGTERM and a restart, a ~200-token prompt comes back from disk with the same greedy
    answer as the cold run."""
    args = ("-m", str(GGUF), "--dequantize", "--kv-disk-cache", str(tmp_path), "--max-sequences", "1")
    messages = [{"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue. " * 12}]

    def ask(s):
        r = s.client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    with server(*args) as s:
        cold, cached, n = ask(s)
        assert cached == 0 and n > 160
        assert s.stop()[0] == 0
    with server(*args) as s:
        warm, cached, _ = ask(s)
        assert cached >= 16 * ((n - 1) // 16) and warm == cold
        assert s.stop()[0] == 0
