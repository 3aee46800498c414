"""One request preparation and one outcome mapping for every route, on a real server on loopback with the official
``openai`` and ``anthropic`` clients: a graceful stop answers 503 on ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/messages`` alike (streaming or not), and no route touches the KV pool off the engine thread."""

from __future__ import annotations

import threading
from typing import Any, Callable

import anthropic
import openai
import pytest

from mlxkv.engine.batch import BatchEngine, EngineConfig, context_length_of
from mlxkv.server.shutdown import SHUTDOWN_CODE, SHUTDOWN_MESSAGE
from testkit.pool_guard import EngineThreadOnly
from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread
from testkit.waiting import wait_for

pytestmark = pytest.mark.server

PROMPT = "The import statement"  # greedy on the test llama: no EOS for hundreds of tokens
LONG = 4096  # the context: the engine cuts it to the context's room
GREEDY = {"temperature": 0}
HISTORY = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": PROMPT}]


def _outcome(call: Callable[[], Any]) -> Callable[[], tuple]:
    """``call`` as (status, code, message): the HTTP status of an error response, or 200 and the error event that
    ended a stream, or 200 and "finished"."""
    def run() -> tuple:
        try:
            call()
        except openai.APIStatusError as exc:
            return exc.status_code, (exc.body or {}).get("code"), exc.message
        except anthropic.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            return exc.status_code, body.get("error", {}).get("type"), str(exc)
        except openai.APIError as exc:  # the error event that ends an OpenAI stream
            return 200, (exc.body or {}).get("code"), exc.message
        return 200, None, "finished"
    return run


def _calls(url: str) -> dict[str, Callable[[], Any]]:
    oai, claude = openai_client(url, timeout=120), anthropic_client(url, timeout=120)

    def drain(stream: Any) -> None:
        for _ in stream:
            pass

    return {
        "chat": lambda: oai.chat.completions.create(model="m", messages=HISTORY, max_tokens=LONG, **GREEDY),
        "completions": lambda: oai.completions.create(model="m", prompt=PROMPT, max_tokens=LONG, **GREEDY),
        "messages": lambda: claude.messages.create(model="m", max_tokens=LONG, messages=HISTORY[1:],
                                                   system=HISTORY[0]["content"], extra_body=GREEDY),
        "chat stream": lambda: drain(oai.chat.completions.create(model="m", messages=HISTORY, max_tokens=LONG,
                                                                 stream=True, **GREEDY)),
        "completions stream": lambda: drain(oai.completions.create(model="m", prompt=PROMPT, max_tokens=LONG,
                                                                   stream=True, **GREEDY)),
        "messages stream": lambda: drain(claude.messages.create(model="m", max_tokens=LONG, messages=HISTORY[1:],
                                                                system=HISTORY[0]["content"], stream=True,
                                                                extra_body=GREEDY)),
    }


def test_a_graceful_stop_answers_503_on_every_route(llama_dir):
    """Requests still generating when the server stops gracefully (what SIGTERM does: the engine drains) end with
    the same answer on every route: 503 in each API's error shape, or, on a stream already answering 200, an error
    event saying the server is shutting down. Requests after it get 503 too."""
    config = run_config(llama_dir, engine=EngineConfig(max_sequences=8, max_queue_depth=16), kv_backend="paged")
    with serve_in_thread(config) as srv:
        engine = srv.parts.engine
        calls = _calls(srv.url)
        outcomes: dict[str, tuple] = {}
        threads = [threading.Thread(target=lambda k=k, c=c: outcomes.__setitem__(k, _outcome(c)()))
                   for k, c in calls.items()]
        for t in threads:
            t.start()
        wait_for(lambda: engine.stats().get("running", 0) == len(calls), timeout=120)
        assert engine.drain(SHUTDOWN_MESSAGE) == len(calls)
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert outcomes["chat"][:2] == outcomes["completions"][:2] == (503, SHUTDOWN_CODE), outcomes
        assert outcomes["messages"][:2] == (503, "api_error"), outcomes
        assert outcomes["chat stream"][:2] == outcomes["completions stream"][:2] == (200, SHUTDOWN_CODE), outcomes
        assert outcomes["messages stream"][0] == 200 and outcomes["messages stream"][1] == "api_error", outcomes
        for name, (_, _, message) in outcomes.items():
            assert SHUTDOWN_MESSAGE in message and "generation failed" not in message, (name, message)
        after = {name: _outcome(call)() for name, call in calls.items() if "stream" not in name}
        assert {status for status, _, _ in after.values()} == {503}, after


def test_no_route_touches_the_pool_off_the_engine_thread(llama_dir):
    """Every route, with a ``kv_overflow`` policy, a multi-message conversation and a refused policy, served by an
    engine whose pool notes each use from another thread: none."""
    from mlxkv.engine.build import build_pool
    from mlxkv.models import load
    from mlxkv.server.app import create_app
    from mlxkv.server.runner import ServerThread

    run = run_config(llama_dir, engine=EngineConfig(max_sequences=4), kv_backend="paged")
    loaded = load(run.model)
    context = context_length_of(loaded.config)
    guard = EngineThreadOnly(build_pool(loaded.model, run.kv, max_sequences=4, context_tokens=context))
    engine = BatchEngine(loaded.model, loaded.tokenizer, config=run.engine, pool=guard, context_length=context)
    app = create_app(engine, model_name="m", manage_engine=True)
    guard.arm()
    policy = {"policy": "h2o", "budget": 56, "sinks": 2, "recent": 8}
    with ServerThread(app) as srv:
        oai, claude = openai_client(srv.url), anthropic_client(srv.url)
        extra = {**GREEDY, "kv_overflow": policy}
        assert oai.chat.completions.create(model="m", messages=HISTORY, max_tokens=8, extra_body=extra).choices
        assert oai.completions.create(model="m", prompt=PROMPT, max_tokens=8, extra_body=extra).choices
        assert list(oai.completions.create(model="m", prompt=PROMPT, max_tokens=4, stream=True, extra_body=extra))
        assert claude.messages.create(model="m", max_tokens=8, messages=HISTORY[1:] + [
            {"role": "assistant", "content": "It"}], system=HISTORY[0]["content"], extra_body=extra).content
        assert claude.messages.count_tokens(model="m", messages=HISTORY[1:]).input_tokens > 0
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model="m", prompt=PROMPT, max_tokens=4,
                                   extra_body={"kv_overflow": {"policy": "window", "budget": 40}})
        assert "too small for pages of 16 tokens" in err.value.body["message"]
        with pytest.raises(anthropic.BadRequestError):
            claude.messages.create(model="m", max_tokens=4, messages=HISTORY[1:],
                                   extra_body={"kv_overflow": {"policy": "window", "budget": 40}})
    assert guard.strangers == []
