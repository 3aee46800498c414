"""``mlxkv serve``'s KV pool grows as requests need blocks and gives them back after ``--kv-idle-release`` seconds
idle; ``--kv-preallocate`` takes the whole budget at start. Seen through /v1/cache/stats and ``mlxkv cache stats``;
the options reach the pool's config from the command line and contradictory ones are refused."""

from __future__ import annotations

import time

import httpx
import pytest
from typer.testing import CliRunner

from cli.main import app
from mlxkv.config import EngineConfig

pytestmark = pytest.mark.server
runner = CliRunner()
PROMPT = [(13 * i + 7) % 1000 + 10 for i in range(1200)]  # 75 blocks of 16: more than the first chunk (64)


def blocks(url: str) -> dict:
    return httpx.get(f"{url}/v1/cache/stats", timeout=30).json()["kv_blocks"]


def test_the_pool_grows_for_a_long_prompt_and_gives_chunks_back_when_idle(llama_dir):
    from testkit.run_config import run_config
    from testkit.serve_thread import openai_client, serve_in_thread

    config = run_config(llama_dir, engine=EngineConfig(max_sequences=4), kv_backend="paged",
                        kv_idle_release=2)
    with serve_in_thread(config) as srv:
        start = blocks(srv.url)
        assert start["total"] == 1024 and start["allocated"] == 64 and not start["preallocated"]  # a 16th: 64 blocks
        assert start["allocated_bytes"] == 65 * 8192 and start["budget_bytes"] == 1024 * 8192
        client = openai_client(srv.url)
        first = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
        grown = blocks(srv.url)
        assert grown["allocated"] >= len(PROMPT) // 16 and grown["total"] == 1024
        again = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
        assert again.choices[0].text == first.choices[0].text  # a prefix hit on the grown pool, the same text
        assert again.usage.prompt_tokens_details.cached_tokens == len(PROMPT) - 1
        deadline = time.monotonic() + 20
        while blocks(srv.url)["allocated"] > 64:  # idle for 2 s: back to the first chunk
            assert time.monotonic() < deadline, blocks(srv.url)
            time.sleep(0.1)
        result = runner.invoke(app, ["cache", "stats", "--url", srv.url], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "KV pool (grows as used): 64 of 1024 blocks allocated" in result.output
        third = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
        assert third.choices[0].text == first.choices[0].text  # the released blocks computed again: same text


def test_a_preallocated_pool_holds_its_whole_budget_from_the_start(llama_dir):
    from testkit.run_config import run_config
    from testkit.serve_thread import serve_in_thread

    config = run_config(llama_dir, engine=EngineConfig(max_sequences=4), kv_backend="paged",
                        kv_preallocate=True)
    with serve_in_thread(config) as srv:
        stats = blocks(srv.url)
        assert stats["preallocated"] and stats["allocated"] == stats["total"] == 1024
        result = runner.invoke(app, ["cache", "stats", "--url", srv.url], env={"COLUMNS": "200"})
        assert "KV pool (preallocated): 1024 of 1024 blocks allocated" in result.output


@pytest.fixture
def seen_kv(monkeypatch):
    """The KvCacheConfig ``mlxkv serve`` builds (the server stops before loading the model)."""
    import mlxkv.server.runner

    seen = []

    def build(run, **kwargs):
        seen.append(run.kv)
        raise ValueError("stopped before the model loads")

    monkeypatch.setattr(mlxkv.server.runner, "build", build)
    return seen


def test_the_options_reach_the_pool_config(seen_kv):
    result = runner.invoke(app, ["serve", "--port", "0", "--kv-idle-release", "30"])
    assert "stopped before the model loads" in result.stderr
    assert (seen_kv[-1].idle_release_s, seen_kv[-1].preallocate) == (30, False)
    runner.invoke(app, ["serve", "--port", "0", "--kv-preallocate"])
    assert seen_kv[-1].preallocate is True
    runner.invoke(app, ["serve", "--port", "0"])
    assert (seen_kv[-1].idle_release_s, seen_kv[-1].preallocate) == (300, False)


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-preallocate", "--kv-idle-release", "5"], "a preallocated pool keeps its memory"),
    (["--kv-backend", "dense", "--kv-preallocate"], "applies to the paged backend only"),
    (["--kv-backend", "dense", "--kv-idle-release", "5"], "applies to the paged backend only"),
    (["--kv-idle-release", "-1"], "greater than or equal to 0"),
])
def test_contradictory_options_are_refused_in_one_line(seen_kv, args, message):
    result = runner.invoke(app, ["serve", "--port", "0", *args])
    assert result.exit_code == 2 and message in result.stderr and not seen_kv
