"""A model folder whose config.json declares impossible sizes ends in one readable line and exit 1 from
``mlxkv generate -m FOLDER``, before any model is built: no ZeroDivisionError traceback for zero heads, no
hundred-thousand-layer build, no table sized by a four-billion-token context."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from mlxkv.cli.main import app
from typer.testing import CliRunner

from mlxkv.model_bounds import config_problem
from mlxkv.models import demo_model_path

runner = CliRunner()

BAD = {
    "heads_zero": ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    "layers_huge": ({"num_hidden_layers": 100_000}, "num_hidden_layers is 100000"),
    "context_huge": ({"max_position_embeddings": 2**32 - 1}, "max_position_embeddings is 4294967295"),
    "kv_heads_not_divisor": ({"num_key_value_heads": 3}, "num_key_value_heads is 3"),
    "kv_heads_zero": ({"num_key_value_heads": 0}, "num_key_value_heads is 0"),
    "hidden_string": ({"hidden_size": "192"}, "hidden_size is '192'"),
    "vocab_bool": ({"vocab_size": True}, "vocab_size is True"),
    "vocab_negative": ({"vocab_size": -1}, "vocab_size is -1"),
    "head_dim_float": ({"head_dim": 48.0}, "head_dim is 48.0"),
    "text_config_layers": ({"text_config": {"num_hidden_layers": 10**30}}, "text_config.num_hidden_layers"),
}


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")

    def make(name: str, changes: dict):
        folder = root / name
        shutil.copytree(demo_model_path(), folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    return make


@pytest.mark.parametrize("name", list(BAD))
def test_an_impossible_config_is_one_line_before_anything_is_built(folder_of, name):
    changes, fragment = BAD[name]
    folder = folder_of(name, changes)
    start = time.monotonic()
    result = runner.invoke(app, ["generate", "-m", str(folder), "--raw", "-n", "2", "hi"])
    assert time.monotonic() - start < 5
    line = result.stderr.strip()
    assert result.exit_code == 1 and "\n" not in line and line.startswith("error: "), result.stderr[-2000:]
    assert "config.json" in line and fragment in line and len(line) < 400, line


def test_the_demo_models_config_and_nulls_pass():
    config = json.loads((demo_model_path() / "config.json").read_text())
    assert config_problem(config) is None
    assert config_problem({**config, "head_dim": None, "text_config": {"vocab_size": 32000}}) is None
    assert config_problem({**config, "intermediate_size": [512, 1024, 512, 256]}) is None  # per-layer widths
    assert "intermediate_size" in config_problem({**config, "intermediate_size": [512, 0]})
    assert config_problem([1, 2]) == "it is a JSON list, not an object"
