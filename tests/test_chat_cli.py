"""``mlxkv chat`` from a pipe and its bad inputs, through the CLI (the demo model): one readable line and a non-zero
exit for a bad session name or a missing session, commands answered line by line, and ``--verbose``'s per-turn line
showing that a later turn prefills only its new tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _chat(tmp_path: Path, *args: str, lines: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-m", "mlxkv", "chat", *args], input=lines, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_bad_session_names_and_missing_sessions_are_one_line(tmp_path):
    bad = _chat(tmp_path, "--resume", "../escape")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == ["error: bad session name '../escape': use 1-100 letters, digits, '_', "
                                               "'.' or '-' (starting with a letter, digit or '_')"]
    missing = _chat(tmp_path, "--resume", "nothing")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [f"error: no saved session 'nothing' in {tmp_path / 'sessions'} "
                                                   "(saved: none)"]
    group = _chat(tmp_path, "--kv-group-size", "48")
    assert group.returncode == 2 and "48 is not one of 32, 64, 128" in group.stderr
    for args, why in ((("--seed", "1"), "has no effect at --temp 0"),
                      (("--kv-group-size", "32"), "applies to a quantized KV cache only")):
        unused = _chat(tmp_path, *args)  # options that would do nothing (greedy; no --kv-bits) are refused
        assert unused.returncode == 2 and args[0] in unused.stderr and why in unused.stderr


def test_commands_from_a_pipe(tmp_path):
    lines = "\n".join(["Hello", "/system Be kind.", "/save one", "/sessions", "/reset", "/stats", "/nope",
                       "/load one", "/stats", "Bye", "/exit", "never read"]) + "\n"
    done = _chat(tmp_path, "-n", "6", lines=lines)
    assert done.returncode == 0, done.stderr
    # The answers alone on stdout (two turns, -n 6 each); the banner and the commands' replies on stderr.
    assert len(done.stdout.splitlines()) == 2 and "saved session" not in done.stdout, done.stdout
    out = done.stderr
    assert out.startswith("mlxkv chat with mlxkv-demo: ")
    assert "system message set\n" in out and "saved session one (" in out and "\none\n" in out
    assert "new conversation\ncontext: 0 tokens (limit 1024)" in out
    assert "unknown command /nope: /help lists the commands\n" in out
    assert "loaded session one: 3 messages" in out  # the system message, Hello and its answer
    assert "never read" not in out and (tmp_path / "sessions" / "one.safetensors").is_file()
    assert out.count("last turn:") == 2


def test_verbose_shows_that_a_later_turn_prefills_only_its_new_tokens(tmp_path):
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    lines = "\n".join(["Hello", "/stats", "Tell me more", "/stats"]) + "\n"
    done = CliRunner().invoke(app, ["chat", "-n", "6", "--verbose"], input=lines,
                              env={"MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "COLUMNS": "300"})
    assert done.exit_code == 0, done.output
    turns = [tuple(map(int, t)) for t in re.findall(
        r"\[turn: (\d+) prompt tokens, (\d+) cached, (\d+) prefilled \| first token [\d.]+ s \| (\d+) generated in",
        done.stderr)]
    contexts = [int(c) for c in re.findall(r"context: (\d+) tokens", done.stderr)]
    assert len(turns) == 2 and len(contexts) == 2, done.stderr
    (prompt1, cached1, prefilled1, generated1), (prompt2, cached2, prefilled2, _) = turns
    assert cached1 == 0 and prefilled1 == prompt1 and generated1 == 6
    # The engine's prefill of the second turn began where the first turn's cache ended: the whole first turn
    # (prompt and answer, as far as it was fed back) was reused and only the new message and its markers ran.
    assert prompt1 < cached2 == contexts[0] <= prompt1 + generated1
    assert prefilled2 == prompt2 - cached2 < 25
    assert f"last turn: {prompt2} prompt tokens, {cached2} cached, {prefilled2} prefilled" in done.stderr
