"""The ``kv_overflow`` request field: a request's own per-sequence KV budget policy, on a real server on loopback
(the official ``openai`` and ``anthropic`` clients), checked against ``mlxkv generate`` with the same flags."""

from __future__ import annotations

import anthropic
import openai
import pytest
from typer.testing import CliRunner

from mlxkv.cli.main import app
from mlxkv.config import KvOverflowConfig
from mlxkv.engine.batch import EngineConfig
from mlxkv.server.kv_overflow import KvOverflowBody, overflow_config
from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread

pytestmark = pytest.mark.server

PROMPT = "The import statement combines two operations; it searches for the named module, then binds it"
BUDGET = 32
SMALL = {"policy": "h2o", "budget": BUDGET, "sinks": 2, "recent": 4}
SMALL_FLAGS = ["--kv-overflow", "h2o", "--kv-overflow-budget", str(BUDGET), "--kv-overflow-sinks", "2",
               "--kv-overflow-recent", "4"]
N = 24


def _serve(llama_dir, **options):
    config = run_config(llama_dir, engine=EngineConfig(max_sequences=4, max_queue_depth=16), **options)
    return serve_in_thread(config, model_name="tiny-llama")


@pytest.fixture(scope="module")
def dense(llama_dir):
    with _serve(llama_dir, kv_backend="dense") as srv:
        yield openai_client(srv.url, timeout=120), srv.url


@pytest.fixture(scope="module")
def paged(llama_dir):
    """Its own server: the tests read its overflow counters as they are after their own requests only."""
    with _serve(llama_dir, kv_backend="paged") as srv:
        yield openai_client(srv.url, timeout=120)


def _generate(llama_dir, *flags, backend="dense", n=N):
    result = CliRunner().invoke(app, ["generate", "-m", llama_dir, "--raw", "-n", str(n), "--temp", "0",
                                      "--kv-backend", backend, *flags, PROMPT])
    assert result.exit_code == 0, result.output
    return result.stdout.rstrip("\n")


def _complete(client, n=N, **extra):
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body=extra or None)
    return r.choices[0].text, r.usage


def test_a_request_budget_below_its_context_matches_generate_with_the_same_flags(dense, llama_dir):
    client, _ = dense
    small, usage = _complete(client, kv_overflow=SMALL)
    # evictions come between steps, and generate prefills a prompt in other steps than the server: a prompt
    # within the budget makes the two runs evict at the same decode steps
    assert usage.prompt_tokens < BUDGET < usage.prompt_tokens + usage.completion_tokens
    plain, _ = _complete(client)
    assert small == _generate(llama_dir, *SMALL_FLAGS)
    assert plain == _generate(llama_dir)
    assert small != plain  # the budget changed what the model saw
    # a budget above the context: every policy is the plain cache
    for policy in ("window", "h2o", "offload"):
        assert _complete(client, kv_overflow={"policy": policy, "budget": 512})[0] == plain, policy


def test_paged_server_runs_a_request_budget_in_pages(paged, llama_dir):
    """The paged backend (serve's default) evicts whole pages (16 tokens): the same tokens as ``mlxkv generate``
    on paged storage with the same flags; a budget too small for its pages is a 400."""
    policy = {"policy": "h2o", "budget": 56, "sinks": 2, "recent": 8}
    flags = ["--kv-overflow", "h2o", "--kv-overflow-budget", "56", "--kv-overflow-sinks", "2",
             "--kv-overflow-recent", "8"]
    small, usage = _complete(paged, n=48, kv_overflow=policy)
    assert usage.prompt_tokens < 56 < usage.prompt_tokens + usage.completion_tokens
    assert small == _generate(llama_dir, *flags, backend="paged", n=48)
    assert small != _complete(paged, n=48)[0]
    with pytest.raises(openai.BadRequestError) as err:
        _complete(paged, kv_overflow={"policy": "window", "budget": 40})
    assert "too small for pages of 16 tokens" in err.value.body["message"]
    assert err.value.body["param"] == "kv_overflow"


def _stats(client):
    return client.get("/cache/stats", cast_to=object)["kv_blocks"]


def test_paged_server_runs_offload_from_the_flag_and_the_request(paged, llama_dir):
    """``offload`` on the paged backend, as a request's ``kv_overflow`` and as the server's ``--kv-overflow``: the
    tokens ``mlxkv generate --kv-backend paged`` gives with the same flags; pages went to host memory and came back,
    and once the requests end every block is free again and no host page is left."""
    policy = {"policy": "offload", "budget": 56, "sinks": 2, "recent": 8}
    flags = ["--kv-overflow", "offload", "--kv-overflow-budget", "56", "--kv-overflow-sinks", "2",
             "--kv-overflow-recent", "8"]
    expected = _generate(llama_dir, *flags, backend="paged", n=48)
    free = _stats(paged)["free"]
    small, usage = _complete(paged, n=48, kv_overflow=policy)
    assert usage.prompt_tokens < 56 < usage.prompt_tokens + usage.completion_tokens
    assert small == expected and small != _complete(paged, n=48)[0]
    stats = _stats(paged)
    assert stats["overflow_restored"] > 0 and stats["overflow_host_bytes"] == 0 and stats["free"] == free
    with _serve(llama_dir, kv_backend="paged", kv_overflow=KvOverflowConfig("offload", 56, 2, 8)) as srv:
        client = openai_client(srv.url, timeout=120)
        free = _stats(client)["free"]
        assert _complete(client, n=48)[0] == expected
        stats = _stats(client)
        assert stats["overflow_restored"] > 0 and stats["overflow_host_bytes"] == 0 and stats["free"] == free


def test_chat_and_messages_routes_take_the_field(dense):
    client, url = dense
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"kv_overflow": SMALL}).choices[0].message.content
    plain = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12,
                                           temperature=0).choices[0].message.content
    claude = anthropic_client(url, timeout=120)
    msg = claude.messages.create(model="tiny-llama", max_tokens=12, messages=messages,
                                 extra_body={"temperature": 0, "kv_overflow": SMALL})
    assert msg.content[0].text == chat != plain
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tiny-llama", max_tokens=12, messages=messages,
                               extra_body={"kv_overflow": {"policy": "h2o", "budget": 12, "recent": 8}})
    assert "room is needed" in err.value.body["error"]["message"]


@pytest.mark.parametrize("value, fragment", [
    ({"policy": "lru"}, "kv_overflow.policy"),
    ({"policy": "h2o", "budget": 1}, "kv_overflow.budget"),
    ({"policy": "h2o", "budget": 64, "evict": "fast"}, "kv_overflow.evict"),
    ({"policy": "h2o"}, "needs kv_overflow.budget"),
    ({"budget": 64}, "apply to kv_overflow window, h2o or offload"),
    ({"policy": "h2o", "budget": 12, "recent": 8}, "room is needed for heavy hitters"),
    ({"policy": "window", "budget": 64, "recent": 8}, "kv_overflow.recent applies to h2o and offload"),
])
def test_bad_values_are_a_400_naming_the_field(dense, value, fragment):
    client, _ = dense
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, kv_overflow=value)
    body = err.value.body
    assert fragment in body["message"] and body["param"].startswith("kv_overflow")


def test_a_policy_the_backend_cannot_run_is_a_400(llama_dir):
    with _serve(llama_dir, kv_backend="dense", max_kv_size=64) as srv:
        client = openai_client(srv.url, timeout=120)
        with pytest.raises(openai.BadRequestError) as err:
            _complete(client, kv_overflow={"policy": "h2o", "budget": 48})
        assert "--max-kv-size" in err.value.body["message"] and err.value.body["param"] == "kv_overflow"
        assert _complete(client, kv_overflow={"policy": "preempt"})[0]  # what the server runs anyway


def test_fields_left_out_take_the_servers_values():
    server = KvOverflowConfig(policy="h2o", budget=256, sinks=2, recent=32)
    assert overflow_config(None, server) is None
    assert overflow_config(KvOverflowBody(), server) is None
    assert overflow_config(KvOverflowBody(budget=256), server) is None  # the default itself
    assert overflow_config(KvOverflowBody(budget=128), server) == KvOverflowConfig("h2o", 128, 2, 32)
    assert overflow_config(KvOverflowBody(policy="offload"), server) == KvOverflowConfig("offload", 256, 2, 32)
    assert overflow_config(KvOverflowBody(policy="window"), server) == KvOverflowConfig("window", 256, 2)
    assert overflow_config(KvOverflowBody(policy="preempt"), server) == KvOverflowConfig()
    assert overflow_config(KvOverflowBody(policy="h2o", budget=64), None) == KvOverflowConfig("h2o", 64)
    with pytest.raises(ValueError, match="kv_overflow.sinks applies"):
        overflow_config(KvOverflowBody(policy="preempt", sinks=2), server)
