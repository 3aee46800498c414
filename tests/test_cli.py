"""The CLI through Typer's runner and as a real subprocess."""

import os
import subprocess
import sys

import pytest
from mlxkv.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()


def test_generate_streams_text_with_a_test_model(llama_dir):
    result = runner.invoke(app, ["generate", "--model", llama_dir, "--raw", "-n", "8", "The import statement"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_generate_reads_the_prompt_from_stdin_and_applies_chat(llama_dir):
    result = runner.invoke(app, ["generate", "-m", llama_dir, "-n", "5", "--chat", "--system", "Be brief.",
                                 "--verbose", "-"], input="What is a tuple?")
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.stderr and "KV cache" in result.stderr


def test_greedy_cli_output_equals_mlx_lm_generate(llama_dir):
    from mlx_lm import generate, load

    model, tokenizer = load(llama_dir)
    prompt = tokenizer.encode("Lists are mutable sequences")
    expected = generate(model, tokenizer, prompt, max_tokens=12)
    result = runner.invoke(app, ["generate", "-m", llama_dir, "--raw", "-n", "12", "Lists are mutable sequences"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == expected


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--top-p", "1.5"], "0<x<=1"),
        (["--temp", "-1"], "greater than or equal to 0"),
        (["--max-tokens", "0"], "greater than or equal to 1"),
        (["--kv-bits", "3"], "4, 8"),
        (["--min-p", "1"], "0<=x<1"),
    ],
)
def test_bad_values_name_the_valid_range(args, fragment):
    result = runner.invoke(app, ["generate", *args, "hello"])
    assert result.exit_code == 2
    flat = " ".join(result.output.replace("│", " ").split())  # undo rich's boxing and wrapping
    assert fragment in flat


def test_missing_model_path_is_one_line_and_non_zero():
    result = runner.invoke(app, ["generate", "--model", "./no/such/model", "hello"])
    assert result.exit_code == 1
    assert result.stderr.strip().count("\n") == 0 and "model not found" in result.stderr


def test_repo_id_not_cached_while_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    result = runner.invoke(app, ["generate", "--model", "someone/not-cached", "hello"])
    assert result.exit_code == 1
    assert "not in the local Hugging Face cache" in result.stderr


def test_unsupported_model_type(tmp_path, llama_dir):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (bad / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["generate", "--model", str(bad), "hello"])
    assert result.exit_code == 1 and "unsupported model_type 'no_such_arch'" in result.stderr


def _mlxkv(*args, **kwargs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mlxkv", *args], capture_output=True, text=True, env=env,
                          timeout=300, **kwargs)


def test_subprocess_default_model_prints_text():
    proc = _mlxkv("generate", "-n", "20", "The import statement")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) >= 3


def test_subprocess_bad_model_path_one_line():
    proc = _mlxkv("generate", "--model", "/definitely/not/here", "hi")
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


def test_missing_weights_is_one_line_and_verbose_adds_the_traceback(tmp_path, llama_dir):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(llama_dir, bare)
    for weights in bare.glob("*.safetensors"):
        weights.unlink()
    result = runner.invoke(app, ["generate", "--model", str(bare), "hello"])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: no model*.safetensors weights in {bare}"
    verbose = runner.invoke(app, ["generate", "--model", str(bare), "--verbose", "hello"])
    assert verbose.exit_code == 1 and "Traceback" in verbose.stderr


def test_paged_backend_and_prompt_lookup_give_the_dense_greedy_text(llama_dir):
    args = ["generate", "-m", llama_dir, "--raw", "-n", "16", "Lists are mutable sequences"]
    dense = runner.invoke(app, args)
    paged = runner.invoke(app, [*args, "--kv-backend", "paged", "--kv-block-size", "8"])
    lookup = runner.invoke(app, [*args, "--prompt-lookup", "--verbose"])
    assert dense.exit_code == paged.exit_code == lookup.exit_code == 0, paged.output + lookup.output
    assert paged.stdout == dense.stdout == lookup.stdout
    assert "acceptance" in lookup.stderr
