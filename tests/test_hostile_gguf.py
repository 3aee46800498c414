"""Crafted GGUF files end in one readable line and a non-zero exit, quickly and without large allocations: from
``mlxkv generate -m FILE`` and ``mlxkv convert FILE OUT`` (which then writes nothing), and under a structural fuzz
of over 1,000 mutations of every header field and tensor table entry, each of which loads or fails with one line
in bounded time and memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlxkv.cli.main import app
from testkit.gguf_files import patched, scalar_fields, write_gguf
from typer.testing import CliRunner

pytest.importorskip("gguf")
runner = CliRunner()

CRAFTED = {
    "alignment_zero": {"general.alignment": 0},
    "block_count_huge": {"llama.block_count": 100_000},
    "head_count_zero": {"llama.attention.head_count": 0},
    "context_length_max": {"llama.context_length": 2**32 - 1},
}


@pytest.fixture(scope="module")
def base(test_model_dir, tmp_path_factory) -> tuple[bytes, dict]:
    """A valid GGUF of the test llama (recording ``general.alignment`` = 32) and its scalar fields' offsets."""
    path = write_gguf(test_model_dir("llama"), tmp_path_factory.mktemp("gguf") / "base.gguf",
                      extra_metadata={"general.alignment": 32})
    return path.read_bytes(), scalar_fields(path)


def crafted(base, tmp_path: Path, name: str, values: dict) -> Path:
    data, fields = base
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(patched(data, fields, values))
    return path


def assert_one_line(returncode: int, stderr: str, *fragments: str) -> None:
    line = stderr.strip()
    assert returncode == 1, stderr[-2000:]
    assert line.startswith("error: ") and "\n" not in line and len(line) < 400, line[:2000]
    for fragment in fragments:
        assert fragment in line, line


def test_alignment_zero_is_one_line_from_the_cli_process(base, tmp_path):
    # A subprocess: a native crash would kill the test runner itself.
    path = crafted(base, tmp_path, "align", CRAFTED["alignment_zero"])
    result = subprocess.run([sys.executable, "-m", "mlxkv", "generate", "-m", str(path), "--raw", "-n", "2", "hi"],
                            capture_output=True, text=True, timeout=60)
    assert_one_line(result.returncode, result.stderr, "general.alignment")


@pytest.mark.parametrize("name", [n for n in CRAFTED if n != "alignment_zero"])
@pytest.mark.parametrize("command", ["generate", "convert"])
def test_a_crafted_header_is_one_line_and_a_non_zero_exit(base, tmp_path, name, command):
    path = crafted(base, tmp_path, name, CRAFTED[name])
    out = tmp_path / "out"
    args = ["generate", "-m", str(path), "--raw", "-n", "2", "hi"] if command == "generate" else \
        ["convert", str(path), str(out)]
    start = time.monotonic()
    result = runner.invoke(app, args)
    assert time.monotonic() - start < 10
    assert_one_line(result.exit_code, result.stderr, next(iter(CRAFTED[name])))
    assert not out.exists()


def test_alignment_zero_is_refused_by_convert_before_mlx_reads_it(base, tmp_path):
    path = crafted(base, tmp_path, "align", CRAFTED["alignment_zero"])
    result = runner.invoke(app, ["convert", str(path), str(tmp_path / "out")])
    assert_one_line(result.exit_code, result.stderr, "general.alignment")
    assert not (tmp_path / "out").exists()


TESTS = Path(__file__).resolve().parent
FIELD_KINDS = ("magic", "version", "tensor_count", "kv_count", ".key_length", ".type", ".value", ".string_length",
               ".array_type", ".array_count", ".name_length", ".n_dims", ".dim0", ".dim1", ".offset", "truncated")


def test_a_header_fuzz_of_over_1000_cases_is_one_line_each_in_bounded_time_and_memory(base, tmp_path):
    """testkit/gguf_fuzz.py in its own process: every header field and tensor table entry mutated (boundary values,
    combinations, truncations); each case loads or is refused with one line (GGUFError), within 1 s and 64 MB of
    peak RSS growth, the process under 768 MB in all; every 10th refused case is refused by ``convert`` too, which
    writes nothing."""
    path = tmp_path / "base.gguf"
    path.write_bytes(base[0])
    out = tmp_path / "fuzz.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "testkit.gguf_fuzz", str(path), str(out), "10"], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]  # a native crash (SIGFPE, SIGSEGV) ends here
    result = json.loads(out.read_text())
    records = result["records"]
    assert len(records) >= 1000
    for kind in FIELD_KINDS:
        assert any(kind in r["case"] for r in records), kind
    assert [r for r in records if r["outcome"] == "crash"] == []
    refused = [r for r in records if r["outcome"] == "refused"]
    assert len(refused) > 0.8 * len(records)
    for r in refused:
        assert r["message"] and "\n" not in r["message"] and len(r["message"]) < 400, r
    assert max(r["seconds"] for r in records) < 1.0
    assert max(r["rss_growth_mb"] for r in records) < 64 and result["peak_rss_mb"] < 768
    converted = [r["convert"] for r in records if "convert" in r]
    assert len(converted) >= 100 and set(converted) == {"refused"}
    assert elapsed < 60, elapsed
