"""``mlxkv models``: the Hugging Face cache (a cache laid out as the hub leaves it) and the GGUF files given to
``-m`` before, with sizes; ``mlxkv models rm`` asks, ``--yes`` does not, unknown ids are one line (issue 24, item 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants
from mlxkv.cli.main import app
from mlxkv.cli.models import human_size
from test_hub_resolution import populate_hf_cache
from testkit.gguf_files import write_gguf
from typer.testing import CliRunner

runner = CliRunner()


@pytest.fixture
def hub(tmp_path, monkeypatch, test_model_dir) -> Path:
    """An HF cache holding two test models under repo ids, used by this process (and subprocesses)."""
    cache = tmp_path / "hub"
    for repo_id in ("someone/tiny-llama", "other/tiny-llama-2"):
        populate_hf_cache(cache, repo_id, test_model_dir("llama"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def models_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "home" / "models.json"
    monkeypatch.setenv("MLXKV_MODELS_FILE", str(path))
    return path


@pytest.fixture
def gguf_file(tmp_path, test_model_dir) -> Path:
    return write_gguf(test_model_dir("llama"), tmp_path / "tiny.Q8_0.gguf", "Q8_0")


def _rows(output: str) -> dict[str, list[str]]:
    lines = output.strip().splitlines()
    assert lines[0].split()[:3] == ["MODEL", "SIZE", "SOURCE"], output
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def _dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_lists_the_hub_cache_with_sizes(hub, models_file):
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    rows = _rows(result.stdout)
    assert list(rows) == ["other/tiny-llama-2", "someone/tiny-llama"]
    blobs = _dir_size(hub / "models--someone--tiny-llama" / "blobs")
    assert " ".join(rows["someone/tiny-llama"][:2]) == human_size(blobs)
    assert rows["someone/tiny-llama"][2:4] == ["hf", "cache"]


def test_an_empty_machine_says_how_models_arrive(tmp_path, models_file, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "no-cache-yet"))
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and result.stdout == ""
    assert "no models yet" in result.stderr


def test_a_gguf_file_used_with_m_is_listed_and_forgotten_not_deleted(hub, models_file, gguf_file):
    assert runner.invoke(app, ["models"]).stdout.count("gguf") == 0
    ran = runner.invoke(app, ["generate", "-m", str(gguf_file), "--raw", "-n", "2", "The import"])
    assert ran.exit_code == 0, ran.output
    recorded = json.loads(models_file.read_text())["gguf"]
    assert [e["path"] for e in recorded] == [str(gguf_file.resolve())]
    rows = _rows(runner.invoke(app, ["models"]).stdout)
    assert " ".join(rows[str(gguf_file.resolve())][:3]) == f"{human_size(gguf_file.stat().st_size)} gguf"

    kept = runner.invoke(app, ["models", "rm", str(gguf_file)], input="n\n")
    assert kept.exit_code == 1 and "forget" in kept.stderr  # the question, answered no
    assert str(gguf_file.resolve()) in _rows(runner.invoke(app, ["models"]).stdout)
    gone = runner.invoke(app, ["models", "rm", "--yes", str(gguf_file)])
    assert gone.exit_code == 0, gone.output
    assert str(gguf_file.resolve()) not in _rows(runner.invoke(app, ["models"]).stdout)
    assert gguf_file.is_file()  # forgotten, not deleted: it is the user's file


def test_a_missing_gguf_shows_as_missing(hub, models_file, gguf_file):
    from mlxkv import gguf_registry

    gguf_registry.remember(gguf_file)
    gguf_file.unlink()
    rows = _rows(runner.invoke(app, ["models"]).stdout)
    assert rows[str(gguf_file.resolve())][0] == "missing"


def test_rm_asks_and_a_no_keeps_the_repo(hub, models_file):
    result = runner.invoke(app, ["models", "rm", "someone/tiny-llama"], input="n\n")
    assert result.exit_code == 1 and "delete someone/tiny-llama" in result.stderr
    assert (hub / "models--someone--tiny-llama").is_dir()


def test_rm_yes_deletes_the_repo_from_the_cache(hub, models_file):
    result = runner.invoke(app, ["models", "rm", "someone/tiny-llama"], input="y\n")
    assert result.exit_code == 0, result.output
    assert "deleted someone/tiny-llama" in result.stdout
    assert not (hub / "models--someone--tiny-llama").exists()
    assert list(_rows(runner.invoke(app, ["models"]).stdout)) == ["other/tiny-llama-2"]


def test_rm_of_an_unknown_id_is_one_line(hub, models_file):
    result = runner.invoke(app, ["models", "rm", "--yes", "nobody/nothing"])
    assert result.exit_code == 1
    assert result.stderr.strip().count("\n") == 0 and "no model 'nobody/nothing'" in result.stderr


def test_a_corrupt_list_file_is_one_line(hub, models_file):
    models_file.parent.mkdir(parents=True)
    models_file.write_text("{not json")
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and "delete it" in result.stderr


def test_models_in_a_real_process(hub, models_file):
    """As a user runs it: the installed entry point, the cache named by HF_HUB_CACHE, rm --yes."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    listed = subprocess.run([sys.executable, "-m", "mlxkv", "models"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert list(_rows(listed.stdout)) == ["other/tiny-llama-2", "someone/tiny-llama"]
    rm = subprocess.run([sys.executable, "-m", "mlxkv", "models", "rm", "--yes", "other/tiny-llama-2"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert rm.returncode == 0, rm.stderr
    assert "deleted other/tiny-llama-2" in rm.stdout
