"""``mlxkv top`` against a real server on loopback: ``--once --json`` over a pipe, one-line errors, and the live view
in a real terminal (tmux) that quits on q and on Ctrl-C."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from testkit.run_config import run_config
from testkit.serve_process import free_port
from testkit.serve_thread import serve_in_thread
from testkit.terminal import EXIT_MARK, TMUX, Terminal

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parent.parent
KEY = "top-key"
PROMPT = "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def srv(llama_dir):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="tiny", api_key=KEY) as s:
        yield s


def top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxkv", "top", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MLXKV_API_KEY": ""})


def complete(srv) -> None:
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text


def test_once_json_prints_one_snapshot_over_a_pipe(srv):
    complete(srv)
    complete(srv)
    out = top("--url", srv.url, "--api-key", KEY, "--once", "--json", "--interval", "0.1")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)  # one JSON document, nothing else on stdout
    assert snap["requests"] == {"running": 0, "prefilling": 0, "waiting": 0, "preempted": 0}
    pool = snap["pool"]
    assert pool["paged"] and pool["total"] == len(pool["states"]) > 0
    assert pool["free"] + pool["cached"] + pool["in_use"] + pool["shared"] == pool["total"] and pool["cached"] >= 3
    assert snap["prefix_cache"]["hits"] > 0 and 0 < snap["prefix_cache"]["hit_rate"] <= 1
    assert any(n["hits"] >= 1 for n in snap["tree"]["nodes"])
    assert snap["tokens_per_second"] is not None and snap["tier"]["enabled"] is False
    assert snap["overflow"] == {"dropped_blocks": 0, "restored_blocks": 0} and snap["state_snapshots"] is None


def test_cache_salt_shows_only_that_tenants_blocks(srv):
    """``--cache-salt`` names one's own blocks; an API key sees every other tenant's as ``others``."""
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                                       "cache_salt": "mine"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200
    snap = json.loads(top("--url", srv.url, "--api-key", KEY, "--cache-salt", "mine", "--once", "--json").stdout)
    assert [t["label"] for t in snap["pool"]["tenants"]][1:] == ["others"] and snap["pool"]["tenants"][0]["own"]
    assert snap["pool"]["owners"].count(0) >= 3 and snap["pool"]["owners"].count(1) >= 3
    assert all(n["owner"] == 0 for n in snap["tree"]["nodes"])


def test_errors_are_one_line_and_a_non_zero_exit(srv):
    bad = top("--url", srv.url, "--api-key", "wrong", "--once", "--json")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "401" in bad.stderr and "invalid API key" in bad.stderr
    down = top("--url", f"http://127.0.0.1:{free_port()}", "--once", "--json")
    assert down.returncode == 1 and down.stderr.count("\n") == 1 and down.stderr.startswith("error: cannot read")
    for args, why in ((["--json"], "--json"), (["--once", "--cache-salt", ""], "--cache-salt")):
        out = top("--url", srv.url, *args)
        assert out.returncode != 0 and why in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.terminal
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux)")
@pytest.mark.parametrize("leave", ["q", "C-c"])
def test_live_view_in_a_terminal_quits_on_q_and_ctrl_c(srv, leave):
    complete(srv)
    term = Terminal(["top", "--url", srv.url, "--api-key", KEY, "--interval", "0.2"], {"PYTHONPATH": str(ROOT)}, ROOT)
    try:
        screen = term.wait_for(r"pool: \d+ blocks of 16 tokens", timeout=60)
        for part in ("mlxkv top", "q quits", "running", "waiting", "hit rate", "tok/s", "tier"):
            assert part in screen, screen
        assert "▪" in screen  # cached blocks in the pool map
        term.key(leave)
        screen = term.wait_for(r"\[exited 0\]", timeout=20)
        assert "Traceback" not in screen and EXIT_MARK in screen
    finally:
        term.close()
