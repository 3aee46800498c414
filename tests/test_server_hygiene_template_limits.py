"""Limits that count what the chat template adds, before anything is rendered: a conversation of more messages
than the template can fit in the context is refused at once (400 naming the limit) on every chat route, and a
neighbour's stream goes on meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from mlxkv.server.limits import max_messages, template_cost
from testkit.run_config import run_config
from testkit.serve_thread import serve_in_thread

pytestmark = pytest.mark.server

#: The issue's request: 130,000 one-character messages, 3.9 MB of JSON.
FLOOD = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}] * 130_000},
                   separators=(",", ":")).encode()


@pytest.fixture(scope="module")
def srv(llama_dir):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="m") as s:
        yield s


def post(srv, path: str, body: bytes) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(srv.url + path, content=body, timeout=60, headers={"content-type": "application/json"})
    return r, time.monotonic() - start


def test_the_template_cost_is_measured(srv):
    cost = template_cost(srv.parts.engine.tokenizer)
    assert cost.tokens_per_message >= 1 and cost.chars_per_message >= 5
    assert max_messages(4096, cost) == 4096 // cost.tokens_per_message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"])
def test_a_flood_of_messages_is_refused_at_once_naming_the_limit(srv, path):
    assert len(FLOOD) < 4 * 1024 * 1024
    post(srv, path, FLOOD)  # warm: the first request of a route builds its models
    r, seconds = post(srv, path, FLOOD)
    assert r.status_code == 400, r.text
    limit = max_messages(srv.parts.engine.context_length, template_cost(srv.parts.engine.tokenizer))
    message = r.json()["error"]["message"]
    assert "130000 messages" in message and f"at most {limit}" in message, message
    if not path.startswith("/v1/messages"):
        assert r.json()["error"]["code"] == "too_many_messages" and r.json()["error"]["param"] == "messages"
    assert seconds < 1.5, seconds  # measured ~0.3 s, nearly all of it parsing 3.9 MB of JSON


def test_the_limit_itself_passes_and_one_more_is_refused(srv):
    limit = max_messages(srv.parts.engine.context_length, template_cost(srv.parts.engine.tokenizer))
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(limit + 1)]
    r = httpx.post(srv.url + "/v1/messages/count_tokens", json={"model": "m", "messages": turns[:limit - 1]},
                   timeout=60)
    assert r.status_code in (200, 400) and "too_many_messages" not in r.text  # the template's own limits may refuse
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "m", "messages": turns, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"


def test_a_neighbours_stream_goes_on_while_a_flood_is_refused(srv):
    gaps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "m", "prompt": "hi there", "max_tokens": 300, "stream": True, "temperature": 0}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            last = time.monotonic()
            for _ in r.iter_lines():
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    for _ in range(3):
        assert post(srv, "/v1/chat/completions", FLOOD)[0].status_code == 400
    reader.join(120)
    assert len(gaps) > 100 and max(gaps[1:]) < 1.0, max(gaps[1:])  # measured ~0.3 s: the JSON parse
