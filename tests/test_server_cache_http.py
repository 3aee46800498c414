"""The KV cache seen over HTTP on a real ``mlxkv serve``: the events stream (SSE, resumable by sequence number,
AllBlocksCleared on reset), the tier section of /v1/cache/stats and ``mlxkv cache stats`` reading it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from testkit.serve_signals import server

pytestmark = pytest.mark.server


def read_sse(resp: httpx.Response, until: str, out: list[dict]) -> None:
    """Parse server-sent events from ``resp`` into ``out`` (with their ``id``) until an event of type ``until``."""
    event: dict = {}
    for line in resp.iter_lines():
        if line.startswith("id: "):
            event["id"] = int(line[4:])
        elif line.startswith("event: "):
            event["event"] = line[7:]
        elif line.startswith("data: "):
            event["data"] = json.loads(line[6:])
        elif line == "" and event:
            out.append(event)
            if event.get("event") == until:
                return
            event = {}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with server("--kv-disk-cache", str(tmp_path_factory.mktemp("tier")), "--kv-disk-write-interval", "0.2") as s:
        s.base = f"http://127.0.0.1:{s.port}/v1"
        yield s


def test_events_are_numbered_resumable_and_reset_clears_all(srv):
    base = srv.base
    before = httpx.get(f"{base}/cache/events", params={"stream": "false"}).json()
    srv.cached_tokens()
    after = httpx.get(f"{base}/cache/events", params={"stream": "false", "since": before["cursor"]}).json()
    stored = [e for e in after["events"] if e["type"] == "BlockStored"]
    assert len(stored) >= 17 and after["dropped"] == 0
    assert [e["seq"] for e in after["events"]] == list(range(before["cursor"] + 1, after["cursor"] + 1))
    assert all(len(e["block_hashes"][0]) == 64 and len(e["token_ids"]) == 16 for e in stored)  # sha256 hex
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][0]  # the chain

    got: list[dict] = []
    with httpx.stream("GET", f"{base}/cache/events", timeout=30,
                      headers={"Last-Event-ID": str(after["cursor"]), "Accept": "text/event-stream"}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        reader = threading.Thread(target=read_sse, args=(resp, "AllBlocksCleared", got), daemon=True)
        reader.start()
        time.sleep(0.3)
        assert httpx.post(f"{base}/cache/reset", timeout=30).json()["prefix_cache_blocks_freed"] >= 17
        reader.join(20)
    assert got and got[-1]["event"] == "AllBlocksCleared", got
    assert [e["id"] for e in got] == list(range(after["cursor"] + 1, after["cursor"] + 1 + len(got)))  # resumed
    assert {e["event"] for e in got[:-1]} == {"BlockRemoved"} and len(got) - 1 >= 17


@pytest.mark.parametrize("query", [{"since": "-1"}, {"since": "x"}, {"stream": "maybe"}])
def test_bad_event_cursors_are_400(srv, query):
    r = httpx.get(f"{srv.base}/cache/events", params=query)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    r = httpx.get(f"{srv.base}/cache/events", headers={"Last-Event-ID": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_tier_stats_and_the_cache_stats_command(srv):
    srv.cached_tokens([{"role": "user", "content": "Pack my box with five dozen liquor jugs. " * 12}])
    deadline = time.monotonic() + 20
    last = None
    while True:  # until the disk tier holds the prompt's blocks and its count stays put between two reads
        tier = httpx.get(f"{srv.base}/cache/stats").json()["tier"]
        blocks = tier["secondary"]["disk"]["blocks"]
        if blocks >= 17 and blocks == last:
            break
        last = blocks
        assert time.monotonic() < deadline, tier
        time.sleep(0.2)
    sec = tier["secondary"]
    assert tier["enabled"] and sec["writes"] >= 17 and sec["bytes"] == sec["disk"]["bytes"] > 0
    assert set(sec["drops"]) == {"low_priority", "no_room", "queue_full"}
    assert sec["write_queue"]["capacity_bytes"] > 0
    out = subprocess.run([sys.executable, "-m", "mlxkv", "cache", "stats", "--url", f"http://127.0.0.1:{srv.port}"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert out.returncode == 0, out.stderr
    disk = next(line for line in out.stdout.splitlines() if "│ disk" in line)
    assert str(sec["disk"]["blocks"]) in disk or str(sec["disk"]["blocks"] + 1) in disk
    assert "for a full write queue" in out.stdout and "write-behind queue" in out.stdout


SYSTEM = [(7 * i + 3) % 900 + 10 for i in range(64)]  # 4 blocks of 16: the shared system prompt
USER = [(11 * i + 5) % 900 + 10 for i in range(40)]


def cached(srv, prompt, **extra) -> int:
    r = srv.client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_per_range_salts_share_the_system_prompt_only(srv):
    prompt = SYSTEM + USER
    a = {"cache_salt_ranges": [{"start": len(SYSTEM), "salt": "tenant-a"}]}
    b = {"cache_salt_ranges": [{"start": len(SYSTEM), "end": None, "salt": "tenant-b"}]}
    assert cached(srv, prompt, **a) == 0
    assert cached(srv, prompt, **b) == len(SYSTEM)  # the same tokens: only the unsalted system blocks are shared
    assert cached(srv, prompt, **a) == len(prompt) - 1  # tenant A's own blocks: all but the last token
    assert cached(srv, prompt) == len(SYSTEM)  # no salt at all: the system prompt only
    assert cached(srv, prompt, cache_salt="t") == 0  # a whole-request salt covers the first block too


@pytest.mark.parametrize("ranges", [[{"start": 10, "end": 5, "salt": "x"}], [{"start": 500, "salt": "x"}],
                                    [{"start": 0, "salt": ""}], [{"start": 0, "salt": "x", "other": 1}]])
def test_bad_salt_ranges_are_400(srv, ranges):
    r = httpx.post(f"{srv.base}/completions", json={"model": "m", "prompt": SYSTEM, "max_tokens": 1,
                                                    "cache_salt_ranges": ranges})
    assert r.status_code == 400, r.text


def test_the_metrics_key_protects_the_operator_routes():
    with server("--metrics-key", "m-key", "--api-key", "a-key") as s:
        base = f"http://127.0.0.1:{s.port}"
        for path in ("/metrics", "/docs", "/openapi.json", "/redoc"):
            assert httpx.get(base + path).status_code == 401
            assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            for key in ("m-key", "a-key"):
                assert httpx.get(base + path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(base + "/health").status_code == 200  # probes stay open
        r = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer m-key"})
        assert r.status_code == 401  # the metrics key is not an API key
