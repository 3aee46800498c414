"""Crafted GGUF files end in one readable line and a non-zero exit, quickly and without large allocations: from
``mlxkv generate -m FILE`` and ``mlxkv convert FILE OUT`` (which then writes nothing), and under a fuzz of the
header's fields, which either loads or fails with one line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlxkv.cli.main import app
from mlxkv.gguf import GGUFError
from mlxkv.gguf.load import build_model, translate
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


SMALL_INTS = st.sampled_from([0, 1, 2, 3, 4, 7, 16, 31, 32, 33, 63, 64, 1000, 1023, 1024, 2**16, 2**31 - 1, 2**32 - 1])
FLOATS = st.sampled_from([0.0, -1.0, 1e-6, 1.0, 1e4, 3.4e38, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_header_fuzz_loads_or_fails_with_one_line(base, tmp_path, data):
    fields = {k: v for k, v in base[1].items() if v[1] in ("I", "f")}
    keys = data.draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True))
    values = {k: data.draw(FLOATS if fields[k][1] == "f" else SMALL_INTS, label=k) for k in keys}
    path = crafted(base, tmp_path, "fuzz", values)
    start = time.monotonic()
    try:
        t = translate(path)
        build_model(t.config, t.weights)
    except GGUFError as exc:
        message = str(exc)
        assert message and "\n" not in message and len(message) < 400, message[:2000]
    assert time.monotonic() - start < 2, values
