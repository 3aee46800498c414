"""``serve`` as a Typer command: options, errors, and a real server process on loopback."""

import os
import signal
import subprocess
import sys

import httpx
import pytest
import typer
from mlxkv.cli.serve import serve
from testkit.serve_process import free_port, wait_for_health
from typer.testing import CliRunner

pytestmark = pytest.mark.server

app = typer.Typer()
app.command()(serve)
runner = CliRunner()


def test_help_lists_the_server_options():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for option in ("--model", "--host", "--port", "--max-sequences", "--max-queue-depth", "--prefill-chunk-size",
                   "--api-key", "--max-kv-size", "--kv-bits"):
        assert option in result.output, option


def test_bad_options_and_missing_model_fail_cleanly(tmp_path):
    assert runner.invoke(app, ["--kv-bits", "3"]).exit_code != 0
    assert runner.invoke(app, ["--max-sequences", "0"]).exit_code != 0
    result = runner.invoke(app, ["--model", str(tmp_path / "nowhere"), "--port", "1"])
    assert result.exit_code == 1 and "error:" in result.output


def test_serve_process_answers_and_requires_the_env_api_key(test_model_dir):
    port = free_port()
    env = {**os.environ, "MLXKV_API_KEY": "k3y", "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "mlxkv.server", "--model", str(test_model_dir("llama")), "--port", str(port),
           "--max-sequences", "2", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, timeout=60)
        assert httpx.get(base + "/v1/models").status_code == 401
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 3},
                       headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the server did not stop on SIGINT")
    assert proc.returncode == 0, out
