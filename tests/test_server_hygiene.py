"""Server hygiene through ``mlxkv serve``: the operator's routes behind the API keys, slow clients dropped, start-up
errors as one line with nothing left behind, keys files checked at start, and every 500 with a JSON error body."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from testkit.run_config import run_config
from testkit.serve_signals import server
from testkit.serve_thread import serve_in_thread

pytestmark = pytest.mark.server

OPERATOR = ("/metrics", "/docs", "/openapi.json", "/redoc")


def serve_fails(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """``mlxkv serve ARGS`` expected to stop at start (``code``: Python run first, in the same process)."""
    main = "import sys; from mlxkv.cli.main import app; sys.argv[1:1] = ['serve']; app(prog_name='mlxkv')"
    cmd = [sys.executable, "-c", (code or "") + "\n" + main] if code else [sys.executable, "-m", "mlxkv", "serve"]
    return subprocess.run([*cmd, *args, "--port", "0"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# tenants\nalice: alice-key-1\nalice: alice-key-2\nbob : bob-key\n")
    with server("--api-keys-file", str(keys), "--header-timeout", "1", "--body-timeout", "1") as s:
        s.base = f"http://127.0.0.1:{s.port}"
        yield s


def test_the_operator_routes_need_an_api_key(keyed):
    for path in OPERATOR:
        assert httpx.get(keyed.base + path).status_code == 401, path
        r = httpx.get(keyed.base + path, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(keyed.base + path, headers={"Authorization": "Bearer bob-key"}).status_code == 200
    assert httpx.get(keyed.base + "/health").status_code == 200  # probes stay open


def test_public_metrics_opens_metrics_only():
    with server("--api-key", "k1", "--public-metrics") as s:
        base = f"http://127.0.0.1:{s.port}"
        assert httpx.get(base + "/metrics").status_code == 200
        for path in OPERATOR[1:]:
            assert httpx.get(base + path).status_code == 401, path
        assert httpx.get(base + "/v1/models").status_code == 401


def test_keys_file_tenants_share_within_and_not_across(keyed):
    prompt = [(7 * i + 3) % 200 + 10 for i in range(40)]

    def cached(key):
        r = httpx.post(keyed.base + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice-key-1") == 0
    assert cached("alice-key-2") > 0  # two keys of one tenant
    assert cached("bob-key") == 0


def test_a_client_trickling_its_headers_is_dropped(keyed):
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        start = time.monotonic()
        answer = b""
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # reset by the server
            time.sleep(0.1)
            if time.monotonic() - start > 6:
                break
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except OSError:
            pass
        elapsed = time.monotonic() - start
    assert elapsed < 3.5, elapsed  # the 1 s deadline, not the trickle's 4+ s
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_client_trickling_its_body_gets_408(keyed):
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bob-key\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(head + body[:5])
        answer = sock.recv(4096)
        elapsed = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408") and elapsed < 3.5, (answer, elapsed)
    # an idle kept-alive connection is closed as before, without an answer
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        assert sock.recv(4096) == b""  # closed by the server within its deadlines


@pytest.mark.parametrize("text, message", [
    ("alice alice-key\n", "line 1: expected 'TENANT: KEY'"),
    ("al ice: k\n", "line 1: the tenant name"),
    ("a: k1\nb: k1\n", "line 2: this key is already given"),
    ("# nothing\n\n", "no 'TENANT: KEY' line"),
    ("a: two words\n", "line 1: the key must be"),
])
def test_a_bad_keys_file_is_one_line_at_start(tmp_path, text, message):
    keys = tmp_path / "keys.txt"
    keys.write_text(text)
    out = serve_fails("--api-keys-file", str(keys))
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_contradicting_or_missing_key_options_are_one_line(tmp_path):
    out = serve_fails("--api-keys-file", str(tmp_path / "absent"))
    assert out.returncode == 1 and "cannot read it" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = serve_fails("--api-key", "k", "--public-metrics", "--metrics-key", "m")
    assert out.returncode == 1 and "contradict" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = serve_fails("--api-key", "k", "--api-key", "k")
    assert out.returncode == 1 and "given twice" in out.stderr


#: Every write into ``TARGET``'s parent fails as on a full disk (what a tiny tmpfs does, without mounting one).
FULL_DISK = """
import errno, os
_write, _target = os.write, os.environ["TARGET"]
def write(fd, data):
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        where = ""
    if where.startswith(_target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(fd, data)
os.write = write
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to find where a write goes")
def test_a_tier_folder_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = serve_fails("--kv-disk-cache", str(disk / "tier"), env={"TARGET": str(disk)}, code=FULL_DISK)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == f"error: cannot write the server's files (--kv-disk-cache {disk / 'tier'}): " \
                                 "No space left on device", out.stderr
    assert list(disk.iterdir()) == []  # no stray secret, no empty folder


def test_an_unwritable_tier_folder_is_one_line():
    out = serve_fails("--kv-disk-cache", "/proc/mlxkv-tier")  # not even root may make a folder there
    assert out.returncode == 1 and out.stderr.startswith("error: cannot write the server's files"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_every_500_has_a_json_error_body(llama_dir, monkeypatch):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="m") as srv:
        def broken(*args, **kwargs):
            raise RuntimeError("an engine fault")

        monkeypatch.setattr(srv.parts.engine, "stats", broken)
        monkeypatch.setattr(srv.parts.engine, "kv_events", broken)
        for path in ("/v1/cache/stats", "/v1/cache/events?stream=false"):
            r = httpx.get(srv.url + path, timeout=30)
            assert r.status_code == 500 and r.headers["content-type"] == "application/json", (path, r.text)
            assert r.json()["error"]["code"] == "internal_error"
