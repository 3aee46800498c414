"""``mlxkv cache ls / clear / stats`` through Typer's CliRunner (stats against a real loopback HTTP server)."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from mlxkv.cli.cache import cache_app
from test_tier_store import FP, OTHER_FP, h, make_block
from typer.testing import CliRunner

from mlxkv.kv.tier import DiskStore, HostMemoryStore, SecondaryTier, make_fingerprint

runner = CliRunner(env={"COLUMNS": "200"})


def fill(folder):
    s = DiskStore(folder, FP, 1 << 20)
    for i in range(3):  # one chain of three blocks
        s.put(make_block(i, priority=50))
    s.put(make_block(10, priority=80))  # a chain of one (its parent is absent)
    DiskStore(folder, OTHER_FP, 1 << 20).put(make_block(0))
    return s


def test_ls_shows_chains_per_model(tmp_path):
    fill(tmp_path)
    result = runner.invoke(cache_app, ["ls", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "llama" in line]
    assert len(rows) == 3  # chain of 3, chain of 1, the other model's chain of 1
    three = next(r for r in rows if h(0).hex()[:12] in r and FP["digest"][:8] in r)
    assert " 3 " in three and " 12 " in three and " 50 " in three  # blocks, tokens, priority
    assert any(" 80 " in r for r in rows) and any(OTHER_FP["digest"][:8] in r for r in rows)
    assert "5 blocks" in result.output


def test_clear_removes_only_our_files(tmp_path):
    fill(tmp_path)
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "fake.mlxkvblk").write_bytes(b"not our magic at all")
    result = runner.invoke(cache_app, ["clear", str(tmp_path), "--yes"])
    assert result.exit_code == 0 and "removed 5 file(s)" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.mlxkvblk", "notes.txt"]
    assert len(DiskStore(tmp_path, FP, 1 << 20)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.mlxkvblk", "notes.txt"]  # the scan spares them too


def test_ls_and_clear_reject_a_missing_folder(tmp_path):
    for cmd in ("ls", "clear"):
        result = runner.invoke(cache_app, [cmd, str(tmp_path / "nope")])
        assert result.exit_code == 1 and "is not a folder" in result.output


@pytest.fixture
def stats_server(tmp_path):
    tier = SecondaryTier(35, memory=HostMemoryStore(1 << 20), disk=DiskStore(tmp_path, FP, 1 << 20))
    tier.offload(make_block(1, priority=60))
    tier.offload(make_block(2, priority=10))
    tier.take((0, h(1)))
    body = json.dumps({
        "running": 0, "blocks_by_priority": {"35": 7, "60": 2},
        "tier": {"prompt_blocks": 20, "primary_hit_blocks": 5, "secondary_hit_blocks": 1,
                 "primary_hit_rate": 0.25, "secondary_hit_rate": 0.05, "secondary": tier.stats()},
    }).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/v1/cache/stats"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if ok else b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stats_renders_hit_rates_and_priorities(stats_server):
    result = runner.invoke(cache_app, ["stats", "--url", stats_server])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    primary = next(line for line in lines if "primary" in line and "25.0%" in line)
    memory = next(line for line in lines if line.strip().startswith("│ memory") or " memory " in line)
    assert primary and "5.0%" in memory  # 1 memory hit of 20 prompt blocks
    assert "dropped 1 below priority 35" in result.output
    prio60 = next(line for line in lines if "│       60 │" in line or line.split("│")[1:2] == ["       60 "])
    assert "2" in prio60


def test_stats_connection_error_is_one_line_and_nonzero():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block exits: nothing listens there
    result = runner.invoke(cache_app, ["stats", "--url", f"http://127.0.0.1:{port}"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("error: cannot read")


def test_fingerprint_digest_changes_with_weights():
    a = make_fingerprint("llama", "sample", "1" * 64)
    assert a["digest"] != make_fingerprint("llama", "sample", "2" * 64)["digest"]
    assert a["digest"] != make_fingerprint("qwen3", "sample", "1" * 64)["digest"]


def test_stats_defaults_to_the_port_serve_listens_on():
    import inspect

    from mlxkv.cli.cache import stats
    from mlxkv.cli.serve import serve

    url = inspect.signature(stats).parameters["url"].default.default
    port = inspect.signature(serve).parameters["port"].default.default
    assert url == f"http://127.0.0.1:{port}"
