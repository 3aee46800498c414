"""The CLI as a new user meets it: bad input is one line before the model loads, flags that would do nothing are
refused, help is grouped, sizes take units, hub downloads draw progress on stderr (issue 24, item 5).

Typer's runner runs the commands in-process (the demo model loads in about a second); the server's start-up
(address, port) runs as a real ``mlxkv serve`` process.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlxkv.cli.main import app
from mlxkv.cli.options import parse_size
from typer.testing import CliRunner

runner = CliRunner()


def flat(text: str) -> str:
    """Rich's boxed, wrapped error text as one line."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").replace("─", " ").split())


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# ---------------------------------------------------------------------------------- text that is not UTF-8
def test_non_utf8_stdin_is_one_line():
    result = runner.invoke(app, ["generate", "-"], input=b"Hi \xff there")
    assert "not UTF-8" in one_line_error(result) and "0xff" in result.stderr


def test_non_utf8_argv_is_one_line():
    # Python hands undecodable argv bytes to the program as lone surrogates (surrogateescape)
    result = runner.invoke(app, ["generate", "Hi \udcff"])
    assert "not UTF-8" in one_line_error(result)


def test_a_lone_surrogate_is_one_line_too():
    result = runner.invoke(app, ["generate", "Hi \ud800"])
    assert "U+D800" in one_line_error(result)


def test_non_utf8_bytes_through_a_real_pipe():
    proc = subprocess.run([sys.executable, "-m", "mlxkv", "generate", "-"], input=b"Hi \xff", capture_output=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.decode().strip().startswith("error: standard input is not UTF-8")
    assert b"Traceback" not in proc.stderr and proc.stdout == b""


def test_non_utf8_system_message_is_refused():
    result = runner.invoke(app, ["generate", "--system", "be \udcff", "hi"])
    assert result.exit_code == 2 and "not valid UTF-8" in flat(result.output)


# ---------------------------------------------------------------------------------- the model's context
def test_a_prompt_longer_than_the_context_is_refused_in_one_line():
    # 1200 tokens: the demo model holds 1024
    result = runner.invoke(app, ["generate", "--raw", "-n", "2", "word " * 600])
    line = one_line_error(result)
    assert "context of 1024 tokens" in line and result.stdout == ""


def test_a_prompt_near_the_end_of_the_context_says_so():
    result = runner.invoke(app, ["generate", "--raw", "-n", "80", "word " * 480])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "context of 1024 tokens" in result.stderr


# ---------------------------------------------------------------------------------- validation before the load
@pytest.mark.parametrize("command, args, fragment", [
    ("generate", ["--max-kv-size", "4"], "> 4"),
    ("serve", ["--max-kv-size", "4", "--kv-backend", "dense"], "> 4"),
    ("serve", ["--kv-block-size", "3"], "power of two"),
    ("serve", ["--kv-disk-cache-size", "1GB"], "needs --kv-disk-cache"),
    ("serve", ["--log-level", "bogus"], "not one of critical, error, warning, info, debug, trace"),
    ("serve", ["--kv-cache-budget", "8XB"], "is not a size"),
    ("serve", ["--chat-template", "/no/such/template.jinja"], "no such file"),
    ("generate", ["--chat-template", "/no/such/template.jinja"], "no such file"),
    ("serve", ["--kv-backend", "dense", "--host-cache-size", "8GB"], "applies to the paged backend"),
    ("serve", ["--kv-backend", "dense", "--kv-cache-budget", "1GB"], "applies to the paged backend"),
    ("serve", ["--max-kv-size", "256"], "applies to the dense backend"),
    ("serve", ["--kv-group-size", "32"], "applies to a quantized KV cache"),
    ("generate", ["--kv-block-size", "32"], "applies to the paged backend"),
    ("generate", ["--kv-group-size", "32"], "applies to a quantized KV cache"),
    ("generate", ["--seed", "1"], "no effect at --temp 0"),
    ("generate", ["--num-draft-tokens", "4"], "needs a drafting mode"),
    ("generate", ["--ngram-size", "2"], "applies to --prompt-lookup only"),
    ("generate", ["--draft-model", "./x", "--ngram-size", "2"], "applies to --prompt-lookup only"),
    ("generate", ["--chat", "--raw"], "exclude each other"),
    ("generate", ["--revision", "v1"], "needs --model owner/name"),
    ("generate", ["-m", "o/n@v1", "--revision", "v2"], "applies to a Hugging Face repo id"),
])
def test_bad_options_fail_before_the_model_loads(command, args, fragment, monkeypatch):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    result = runner.invoke(app, [command, *args] + (["hello"] if command == "generate" else []))
    assert result.exit_code == 2, result.output
    text = flat(result.output)
    assert fragment in text, text
    assert "secondary_" not in text and "Traceback" not in text  # names what the user typed, not internals


def test_kv_disk_cache_on_a_file_is_refused(tmp_path):
    afile = tmp_path / "tier"
    afile.write_text("not a folder")
    result = runner.invoke(app, ["serve", "--kv-disk-cache", str(afile)])
    assert result.exit_code == 2 and "is a file, not a folder" in flat(result.output)


def test_a_missing_draft_model_is_named_as_the_draft(monkeypatch):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the target loaded before the draft check"))
    result = runner.invoke(app, ["generate", "--draft-model", "./no/such/draft", "hi"])
    assert one_line_error(result).startswith("error: --draft-model ./no/such/draft: model not found")


def test_seed_with_sampling_is_accepted():
    result = runner.invoke(app, ["generate", "--temp", "0.7", "--seed", "1", "-n", "3", "hi"])
    assert result.exit_code == 0, result.output


def test_a_multi_line_load_error_is_kept_whole(tmp_path, test_model_dir):
    """transformers' error for a folder without tokenizer files runs over several lines: all of it, on one."""
    import shutil

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(test_model_dir("llama"), folder)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "vocab", "merges")):
            path.unlink()
    line = one_line_error(runner.invoke(app, ["generate", "-m", str(folder), "hi"]))
    assert "Couldn't instantiate the backend tokenizer from one of: (1)" in line and "(3)" in line


# ---------------------------------------------------------------------------------- sizes, help, version
@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("512MB", 512_000_000), ("8GB", 8_000_000_000), ("8GiB", 8 << 30), ("8G", 8 << 30),
    ("1.5 KiB", 1536), ("2tb", 2 * 10 ** 12), (0, 0),
])
def test_sizes_take_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8XB", "GB", "-1GB", "1e9", ""])
def test_bad_sizes_name_the_units(text):
    import typer

    with pytest.raises(typer.BadParameter, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize("command, panels", [
    ("generate", ["Model", "Sampling", "KV cache", "Speculative decoding", "Output"]),
    ("serve", ["Model", "Server", "KV cache", "Sampling"]),
])
def test_help_groups_options_into_panels_and_shows_choices(command, panels):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for panel in panels:
        assert re.search(rf"╭─ {panel} ─", result.output), panel
    assert "[dense|paged]" in result.output or "[paged|dense]" in result.output
    assert "[4|8]" in result.output and "[32|64|128]" in result.output


def test_serve_sizes_reach_the_kv_config(monkeypatch, tmp_path):
    import mlxkv.server.runner

    seen = []

    def build(run, **kwargs):
        seen.append(run.kv)
        raise ValueError("stopped before the model loads")

    monkeypatch.setattr(mlxkv.server.runner, "build", build)
    result = runner.invoke(app, ["serve", "--port", "0", "--kv-cache-budget", "2GiB", "--host-cache-size", "1.5GB",
                                 "--kv-disk-cache", str(tmp_path / "tier"), "--kv-disk-cache-size", "10G"])
    assert result.exit_code == 1 and "stopped before the model loads" in result.stderr
    kv = seen[0]
    assert (kv.kv_cache_budget, kv.secondary_memory_bytes, kv.secondary_disk_bytes) == (2 << 30, 1_500_000_000, 10 << 30)


def test_serve_help_shows_size_units():
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert "--host-cache-size" in result.output and "SIZE" in result.output and "8GB" in result.output
    assert "[critical|error|warning|info|debug|trace]" in result.output


def test_version():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"mlxkv {version('mlxkv')}"


# ---------------------------------------------------------------------------------- hub ids: revision, progress
@pytest.fixture
def fake_hub(monkeypatch, tmp_path, test_model_dir):
    """``snapshot_download`` replaced by one that draws the byte bar as huggingface_hub does (total 0, then
    raised as sizes are known) with the ``tqdm_class`` it is given, and returns a test model."""
    import huggingface_hub

    monkeypatch.chdir(tmp_path)  # no local folder shadows the repo id
    calls = []

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, tqdm_class=None):
        calls.append({"repo_id": repo_id, "revision": revision, "tqdm_class": tqdm_class})
        bar = tqdm_class(total=0, initial=0, unit="B", unit_scale=True, desc="Downloading", disable=False,
                         mininterval=0, name="huggingface_hub.snapshot_download")
        bar.total += 2000
        bar.refresh()
        bar.update(1000)
        bar.update(1000)
        bar.close()
        return str(test_model_dir("llama"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_download_progress_goes_to_stderr_and_moves(fake_hub):
    result = runner.invoke(app, ["generate", "-m", "someone/model", "--raw", "-n", "3", "The import"])
    assert result.exit_code == 0, result.output
    assert fake_hub[0]["repo_id"] == "someone/model" and fake_hub[0]["revision"] is None
    assert "%" not in result.stdout and "Downloading" not in result.stdout
    assert " 50%" in result.stderr and "100%" in result.stderr and "2.00k" in result.stderr
    assert "TqdmExperimentalWarning" not in result.stderr


@pytest.mark.parametrize("args", [["-m", "someone/model@v1.0"], ["-m", "someone/model", "--revision", "v1.0"]])
def test_a_revision_reaches_the_hub(fake_hub, args):
    result = runner.invoke(app, ["generate", *args, "--raw", "-n", "2", "The import"])
    assert result.exit_code == 0, result.output
    assert [(c["repo_id"], c["revision"]) for c in fake_hub] == [("someone/model", "v1.0")]


def test_an_empty_revision_is_one_line(fake_hub):
    result = runner.invoke(app, ["generate", "-m", "someone/model@", "hi"])
    assert "expected owner/name@revision" in one_line_error(result) and fake_hub == []


# ---------------------------------------------------------------------------------- serve's start-up
def _serve(*args: str, timeout: float = 120) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "mlxkv", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _banner(proc: subprocess.Popen) -> str:
    for line in proc.stdout:
        if line.startswith("mlxkv serve:"):
            return line
    pytest.fail(f"serve exited ({proc.wait()}) without a banner")


def _stop(proc: subprocess.Popen) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.server
def test_port_0_and_ipv6_banner_names_the_bound_address():
    import httpx

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    proc = _serve("--host", "::1", "--port", "0")
    try:
        banner = _banner(proc)
        match = re.search(r"on http://\[::1\]:(\d+) ", banner)
        assert match, banner
        port = int(match.group(1))
        assert port != 0
        for _ in range(300):  # the banner comes just before uvicorn starts accepting
            try:
                assert httpx.get(f"http://[::1]:{port}/health", timeout=30).json()["status"] == "ok"
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        else:
            pytest.fail("the server never answered on the port its banner named")
    finally:
        _stop(proc)


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a model that does not exist: had the model been loaded first, that would be the error
        proc = _serve("--port", str(port), "-m", "./no/such/model")
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert out.strip() == f"error: cannot listen on http://127.0.0.1:{port}: address already in use"


def test_pull_downloads_without_running(fake_hub, test_model_dir):
    result = runner.invoke(app, ["pull", "someone/model", "--revision", "v1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"someone/model@v1: {test_model_dir('llama')}"
    assert fake_hub[-1]["repo_id"] == "someone/model" and fake_hub[-1]["revision"] == "v1"
    assert "Downloading" in result.stderr  # the progress, on stderr
