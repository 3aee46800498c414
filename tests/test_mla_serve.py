"""``MLXKV_MLA_ABSORBED=1 mlxkv serve`` on the DeepSeek V2/V3 test models (latent pages): concurrent greedy requests
through the official openai client equal sequential ``mlxkv generate`` runs (same flag, dense latent caches), decode
runs batched, and prefix hits are reported in the usage and in /v1/cache/stats."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from testkit.deepseek import ARCHS, build_deepseek
from testkit.models import write_model
from testkit.serve_process import serve_process
from typer.testing import CliRunner

from mlxkv.cli.main import app as cli
from mlxkv.env import reload as reload_flags

pytestmark = pytest.mark.server

SHARED = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 2  # 2+ blocks of 16 tokens
PROMPTS = [SHARED + tail for tail in ("and then", "so the bird sings a", "yet", "because of the rain it")]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tmp_path_factory):
    """(openai client, expected texts, config): the server under MLXKV_MLA_ABSORBED=1, ``mlxkv generate``'s answers."""
    model, config = build_deepseek(request.param)
    path = write_model(model, config, tmp_path_factory.mktemp(request.param))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXKV_MLA_ABSORBED", "1")
        reload_flags()
        runner = CliRunner()
        expected = []
        for prompt in PROMPTS:  # sequential generate, dense latent caches
            result = runner.invoke(cli, ["generate", "-m", str(path), "--raw", "-n", str(MAX_TOKENS), prompt])
            assert result.exit_code == 0, result.output
            expected.append(result.stdout.removesuffix("\n"))
        # V2's server also prefills requests admitted together in one forward (latent batched prefill)
        extra = ["--batched-prefill"] if request.param == "deepseek_v2" else []
        with serve_process("-m", str(path), "--max-sequences", "4", *extra) as client:
            yield client, expected, config
    reload_flags()


def stats(client) -> dict:
    return httpx.get(str(client.base_url) + "cache/stats", timeout=30).json()


def complete(client, prompt: str):
    return client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)


def test_concurrent_greedy_requests_equal_sequential_generate(served):
    client, expected, config = served
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(client, p), PROMPTS))
    assert [a.choices[0].text for a in answers] == expected
    s = stats(client)
    assert s["kv_backend"] == "paged" and s["batched_decode"], s
    assert s["batched_steps_total"] > 0 and s["max_batch"] > 1
    assert s["batched_prefill"] == (config["model_type"] == "deepseek_v2"), s["batched_prefill_reason"]
    assert s["kv_blocks"]["used"] == 0 and s["kv_blocks"]["cached"] > 0
    latent_row = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4  # float32
    assert s["kv_blocks"]["bytes_per_block"] == s["kv_blocks"]["block_size"] * latent_row  # what the budget counts


def test_a_repeated_prompt_hits_all_but_its_last_token(served):
    client, expected, _ = served
    before = stats(client)["prefix_cache"]["hits"]
    first = complete(client, PROMPTS[1])
    again = complete(client, PROMPTS[1])
    assert first.choices[0].text == again.choices[0].text == expected[1]
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert stats(client)["prefix_cache"]["hits"] - before >= n - 1
