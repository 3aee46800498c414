"""``mlxkv serve --kv-bits 8|4`` through its door: a real server process on loopback with the official ``openai``
client, over quantized paged KV pages — concurrent greedy answers equal sequential ones, prefix hits and the bits
are reported by ``/v1/cache/stats``; a group size that does not divide head_dim is one line at start, exit 1."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from testkit.archs import build_from_config, get_config
from testkit.models import write_model
from testkit.serve_process import free_port, serve_process

pytestmark = pytest.mark.server

PREFIX = "You are a careful assistant who answers briefly. " * 3
QUESTIONS = ["What is a tuple?", "What is a list?", "Name a colour.", "Count to three."]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """The test llama with head_dim 32 (hidden 128, 4 heads): quantization groups of 32 divide it."""
    return write_model(*build_from_config({**get_config("llama"), "hidden_size": 128}),
                       tmp_path_factory.mktemp("wide-llama"))


def stats_of(client) -> dict:
    with urllib.request.urlopen(str(client.base_url) + "cache/stats", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("bits", [8])
def test_serve_kv_bits_concurrent_equals_sequential_with_prefix_hits(wide_llama, bits):
    with serve_process("-m", str(wide_llama), "--kv-bits", str(bits), "--kv-group-size", "32", "--kv-block-size", "8",
                       "--max-sequences", "4", "--log-level", "warning") as client:

        def ask(q: str) -> str:
            r = client.completions.create(model="tiny", prompt=PREFIX + q, max_tokens=8, temperature=0)
            return r.choices[0].text

        sequential = [ask(q) for q in QUESTIONS]
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            concurrent = list(pool.map(ask, QUESTIONS))
        stats = stats_of(client)
    assert concurrent == sequential and len(set(sequential)) > 1
    blocks = stats["kv_blocks"]
    assert blocks["paged"] and blocks["kv_bits"] == bits and blocks["kv_group_size"] == 32
    assert stats["prefix_cache"]["hits"] > 0  # the shared prefix, and the repeated prompts, hit the cached pages
    assert stats["batched_steps_total"] > 0


def test_serve_kv_bits_group_size_not_dividing_head_dim_is_one_line_at_start(wide_llama, monkeypatch):
    """head_dim 32 with --kv-group-size 64: ``mlxkv serve`` (its CLI, in process) refuses before serving, in one
    line naming the group size that fits, exit 1; and ``generate --kv-backend paged`` says the same."""
    from typer.testing import CliRunner

    from mlxkv.cli.main import app
    from mlxkv.server import shutdown

    def never(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(shutdown, "serve_until_signalled", never)
    for command in (["serve", "--port", str(free_port())], ["generate", "Hi", "--raw", "--kv-backend", "paged"]):
        result = CliRunner().invoke(app, [*command, "-m", str(wide_llama), "--kv-bits", "8", "--kv-group-size", "64"])
        assert result.exit_code == 1 and result.stdout == "", result.output
        assert result.stderr.strip().splitlines() == [(
            "error: --kv-bits: the model's head_dim 32 is not divisible by the KV quantization group size 64; use "
            "--kv-group-size 32")], command


def test_generate_paged_kv_bits_8_prints_the_dense_kv_bits_8_text(wide_llama):
    """``mlxkv generate --kv-backend paged --kv-bits 8`` (the CLI, in process): the dense --kv-bits 8 tokens."""
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    base = ["generate", "Once upon a time", "-m", str(wide_llama), "--raw", "--max-tokens", "12", "--temp", "0",
            "--kv-bits", "8", "--kv-group-size", "32"]
    paged = CliRunner().invoke(app, [*base, "--kv-backend", "paged"])
    dense = CliRunner().invoke(app, [*base, "--kv-backend", "dense"])
    assert paged.exit_code == 0 and dense.exit_code == 0, paged.output + dense.output
    assert paged.stdout == dense.stdout and len(paged.stdout.strip()) > 3
