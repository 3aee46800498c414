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


def test_ls_and_clear_reject_a_missing_folder_or_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for cmd in ("ls", "clear"):
        result = runner.invoke(cache_app, [cmd, str(tmp_path / "nope")])
        assert result.exit_code == 1 and "does not exist yet: `mlxkv serve --kv-disk-cache" in result.output
        result = runner.invoke(cache_app, [cmd, str(afile)])
        assert result.exit_code == 1 and f"{afile} is a file, not a folder" in result.output


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


@pytest.fixture
def answers():
    """A loopback server answering ``GET path`` from ``routes[path] = (status, headers, body)`` (404 otherwise),
    recording each request's path and Authorization header in ``seen``."""
    routes: dict[str, tuple[int, dict, bytes]] = {}
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            status, headers, body = routes.get(self.path, (404, {}, b""))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", routes, seen
    server.shutdown()
    server.server_close()


def _stats_error(url, *extra):
    result = runner.invoke(cache_app, ["stats", "--url", url, *extra])
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_stats_sends_the_api_key_and_reports_a_refusal_with_the_servers_message(answers):
    base, routes, seen = answers
    refusal = json.dumps({"error": {"message": "invalid API key", "type": "authentication_error"}}).encode()
    routes["/v1/cache/stats"] = (401, {"Content-Type": "application/json"}, refusal)
    assert _stats_error(base, "--api-key", "k1") == (
        f"error: cannot read {base}/v1/cache/stats: HTTP 401 Unauthorized: invalid API key")
    assert seen == [("/v1/cache/stats", "Bearer k1")]
    routes["/v1/cache/stats"] = (200, {"Content-Type": "application/json"}, b'{"running": 0}')
    result = runner.invoke(cache_app, ["stats", "--url", base + "/"], env={"MLXKV_API_KEY": "k2"})
    assert result.exit_code == 0 and "no secondary tier" in result.stdout, result.output
    assert seen[-1] == ("/v1/cache/stats", "Bearer k2")


def test_stats_errors_are_one_line_naming_the_cause(answers):
    base, routes, seen = answers
    routes["/text/v1/cache/stats"] = (200, {"Content-Type": "text/plain"}, b"hello")
    routes["/list/v1/cache/stats"] = (200, {"Content-Type": "application/json"}, b"[1, 2]")
    routes["/moved/v1/cache/stats"] = (302, {"Location": "/v1/cache/stats"}, b"")
    assert _stats_error(base + "/missing") == f"error: cannot read {base}/missing/v1/cache/stats: HTTP 404 Not Found"
    assert _stats_error(base + "/text").startswith(f"error: cannot read {base}/text/v1/cache/stats: not JSON: ")
    assert _stats_error(base + "/list") == f"error: {base}/list/v1/cache/stats returned list, expected a JSON object"
    assert _stats_error(base + "/moved", "--api-key", "k") == (
        f"error: cannot read {base}/moved/v1/cache/stats: HTTP 302 Found")
    assert [path for path, _ in seen] == ["/missing/v1/cache/stats", "/text/v1/cache/stats", "/list/v1/cache/stats",
                                          "/moved/v1/cache/stats"]  # the redirect was not followed
    assert _stats_error("127.0.0.1:8080") == (
        "error: cannot read 127.0.0.1:8080/v1/cache/stats: the URL must start with http:// or https://")


def test_stats_as_json_is_the_servers_object(stats_server):
    result = runner.invoke(cache_app, ["stats", "--json", "--url", stats_server])
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    assert snap["blocks_by_priority"] == {"35": 7, "60": 2} and snap["tier"]["prompt_blocks"] == 20
