"""The --kv-overflow policies through the product's doors: ``mlxkv generate`` (Typer runner), a chat session over
turns, and ``mlxkv serve`` (a real server on loopback, the official openai client, dense and paged backends)."""

from __future__ import annotations

from concurrent import futures

import pytest
from testkit.serve_process import serve_process
from typer.testing import CliRunner

from mlxkv.chat import ChatSession
from mlxkv.cli.main import app
from mlxkv.config import KvOverflowConfig
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import each_layer_cache

pytestmark = pytest.mark.server

runner = CliRunner()
PROMPT = "The import statement combines two operations; it searches for the named module"


def _generate(llama_dir, *extra):
    result = runner.invoke(app, ["generate", "-m", llama_dir, "--raw", "-n", "24", *extra, PROMPT])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_generate_is_exact_under_a_large_budget_and_runs_past_a_small_one(llama_dir):
    plain = _generate(llama_dir)
    for policy in ("window", "h2o", "offload"):
        assert _generate(llama_dir, "--kv-overflow", policy, "--kv-overflow-budget", "512") == plain, policy
    small = _generate(llama_dir, "--kv-overflow", "offload", "--kv-overflow-budget", "16", "--kv-overflow-recent", "4",
                      "--kv-overflow-sinks", "2")
    assert small.strip()


@pytest.mark.parametrize("args, fragment", [
    (["--kv-overflow", "h2o"], "needs --kv-overflow-budget"),
    (["--kv-overflow-budget", "64"], "apply to --kv-overflow window, h2o or offload"),
    (["--kv-overflow-sinks", "2"], "applies to --kv-overflow window, h2o or offload"),
    (["--kv-overflow", "lru", "--kv-overflow-budget", "64"], "preempt"),
    (["--kv-overflow", "offload", "--kv-overflow-budget", "64", "--kv-backend", "paged"], "too small for pages"),
    (["--kv-overflow", "h2o", "--kv-overflow-budget", "40", "--kv-backend", "paged"], "too small for pages"),
    (["--kv-overflow", "h2o", "--kv-overflow-budget", "64", "--max-kv-size", "64"], "both cap the context"),
    (["--kv-overflow", "offload", "--kv-overflow-budget", "64", "--kv-bits", "8"], "--kv-bits"),
    (["--kv-overflow", "window", "--kv-overflow-budget", "64", "--kv-overflow-recent", "8"], "applies to h2o and offload"),
    (["--kv-overflow", "h2o", "--kv-overflow-budget", "12", "--kv-overflow-recent", "8"], "room is needed"),
])
def test_generate_refuses_bad_combinations_in_one_message(llama_dir, args, fragment):
    result = runner.invoke(app, ["generate", "-m", llama_dir, "-n", "2", *args, "hi"])
    assert result.exit_code == 2
    assert fragment in " ".join(result.output.replace("│", " ").split())


def test_a_chat_session_keeps_answering_past_its_budget():
    from mlxkv.models import load

    demo = load(None)
    overflow = KvOverflowConfig(policy="h2o", budget=48, recent=16)
    plain = ChatSession(demo.model, demo.tokenizer, system="Be brief.")
    ours = ChatSession(demo.model, demo.tokenizer, system="Be brief.",
                       overflow=KvOverflowConfig(policy="h2o", budget=4096))
    params = SamplingParams(max_tokens=10)
    assert "".join(ours.turn("Hello, who are you?", params)) == "".join(plain.turn("Hello, who are you?", params))
    small = ChatSession(demo.model, demo.tokenizer, system="Be brief.", overflow=overflow)
    for question in ("Hello, who are you?", "Tell me about the sea.", "And the mountains?"):
        assert "".join(small.turn(question, params)).strip()
        layers = [c for c in each_layer_cache(small.caches) if hasattr(c, "evicted")]
        assert layers and all(c.size() <= 48 + 64 and c.offset == len(small.tokens) for c in layers)
    assert any(c.evicted for c in layers)


def test_serve_dense_with_offload_answers_concurrent_requests():
    """The demo model over loopback: a budget far below the conversation; two streams decode in one batch."""
    with serve_process("--kv-backend", "dense", "--kv-overflow", "offload", "--kv-overflow-budget", "24",
                       "--kv-overflow-recent", "8", "--temp", "0") as client:
        def ask(question):
            r = client.chat.completions.create(model="default", max_tokens=40,
                                               messages=[{"role": "user", "content": question}])
            return r.choices[0].message.content, r.usage

        with futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, ["Tell me about the sea and the ships.", "What is a tuple in Python?"]))
        for text, usage in answers:
            assert text.strip() and usage.prompt_tokens + usage.completion_tokens > 24
        assert ask("Tell me about the sea and the ships.")[0] == answers[0][0]  # greedy: same answer alone


@pytest.mark.parametrize("policy", ["h2o", "offload"])
def test_serve_paged_with_a_policy_answers_concurrent_requests(policy):
    """serve's default paged backend with a server-wide budget far below the conversations: concurrent chat
    requests and n=2 (a fork) through the openai client, each the same answer alone; every block free at the end
    (offload: and no host page left)."""
    with serve_process("--kv-overflow", policy, "--kv-overflow-budget", "64", "--kv-overflow-recent", "8",
                       "--temp", "0") as client:
        free = client.get("/cache/stats", cast_to=object)["kv_blocks"]["free"]

        def ask(question, n=1):
            r = client.chat.completions.create(model="default", max_tokens=60, n=n,
                                               messages=[{"role": "user", "content": question}])
            return [c.message.content for c in r.choices], r.usage

        questions = ["Tell me about the sea and the ships.", "What is a tuple in Python?"]
        with futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, questions + [questions[0]], [1, 1, 2]))
        for texts, usage in answers:
            assert all(t.strip() for t in texts) and usage.prompt_tokens + usage.completion_tokens > 64
        assert answers[2][0] == answers[0][0] * 2  # greedy: the fork's samples, the same answer alone
        assert ask(questions[1])[0] == answers[1][0]
        stats = client.get("/cache/stats", cast_to=object)["kv_blocks"]
        assert stats["overflow_dropped"] > 0 and stats["free"] == free and stats["overflow_host_bytes"] == 0


@pytest.mark.parametrize("args, fragment", [
    (["--kv-overflow", "h2o", "--kv-overflow-budget", "64", "--max-kv-size", "64"], "both cap the context"),
    (["--kv-overflow", "offload", "--kv-overflow-budget", "64", "--kv-bits", "8"], "full-precision"),
    (["--kv-overflow", "window"], "needs --kv-overflow-budget"),
])
def test_chat_refuses_bad_combinations_before_loading(args, fragment):
    result = runner.invoke(app, ["chat", *args], input="")
    assert result.exit_code == 2
    assert fragment in " ".join(result.output.replace("│", " ").split())
