"""Tool calling through a real server on loopback with the official openai client: the random-weight test llama
served with the tools template (``--chat-template``), for the mechanics a random model can show (what is rendered
into the prompt, history, the answers after it, refusals). Parsing its calls is in test_tool_parser.py; real calls
from SmolLM2 in test_real_model_tools.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.server.tools import render_tools, to_template_messages
from testkit.serve_thread import openai_client

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'},
]


#: The engine this module's servers run (the same in test_server_anthropic_tools.py: they share them).
ENGINE = {"max_sequences": 2, "max_queue_depth": 8}


@pytest.fixture(scope="module")
def server(served):
    return served(**ENGINE, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def rendered(server, messages, tools=None) -> list[int]:
    """The prompt ids the server's tokenizer gives these OpenAI-shaped messages (and tools), rendered locally."""
    kwargs = {"tools": render_tools(tools)} if tools else {}
    return list(server.parts.loaded.tokenizer.apply_chat_template(to_template_messages(messages),
                                                                  add_generation_prompt=True, **kwargs))


def greedy(server, prompt: list[int], max_tokens: int) -> str:
    loaded = server.parts.loaded
    chunks = DirectEngine(loaded.model, loaded.tokenizer).generate(prompt, SamplingParams(max_tokens=max_tokens))
    return "".join(c.text for c in chunks)


def test_tools_are_rendered_into_the_prompt_and_none_leaves_them_out(server, client):
    tokenizer = server.parts.loaded.tokenizer
    text = tokenizer.apply_chat_template(ASK, tools=render_tools([WEATHER, TIME]), add_generation_prompt=True,
                                         tokenize=False)
    assert "<tools>" in text and '"name": "get_weather"' in text and '"name": "get_time"' in text
    with_tools = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=[WEATHER, TIME],
                                                max_tokens=4, temperature=0)
    prompt = rendered(server, ASK, [WEATHER, TIME])
    assert with_tools.usage.prompt_tokens == len(prompt)
    assert with_tools.choices[0].message.content == greedy(server, prompt, 4)
    plain = rendered(server, ASK)
    assert len(plain) < len(prompt)
    for choice in ("none", None):
        r = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=4, temperature=0,
                                           **({"tools": [WEATHER], "tool_choice": choice} if choice else {}))
        assert r.usage.prompt_tokens == len(plain) and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "length"


def test_a_history_with_a_call_and_its_result_is_rendered_and_answered(server, client):
    prompt = rendered(server, HISTORY, [WEATHER])
    text = server.parts.loaded.tokenizer.decode(prompt)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature_c": 21, "sky": "sunny"}\n</tool_response>' in text
    r = client.chat.completions.create(model="tiny-llama", messages=HISTORY, tools=[WEATHER], max_tokens=6,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == greedy(server, prompt, 6)
    streamed = client.chat.completions.create(model="tiny-llama", messages=HISTORY, tools=[WEATHER], max_tokens=6,
                                              temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy(server, prompt, 6)
    assert all(c.system_fingerprint == r.system_fingerprint for c in chunks)
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_tools_change_the_memoized_head_of_a_long_system_prompt(server, client):
    """A long system prompt's tokens are memoized (prompts.py); other tools render another head, never the
    memo of the first."""
    system = {"role": "system", "content": "You answer questions about the weather. " * 80}
    for tools in ([WEATHER], [WEATHER], [TIME], [WEATHER, TIME], [TIME]):
        for question in ("Paris?", "Oslo?"):
            messages = [system, {"role": "user", "content": question}]
            r = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, max_tokens=1,
                                               temperature=0)
            assert r.usage.prompt_tokens == len(rendered(server, messages, tools)), (tools, question)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 2, **body},
                      timeout=30)


@pytest.mark.parametrize("body, param, code", [
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "invalid_value"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name",
     "invalid_value"),
    ({"messages": ASK, "tools": [{"type": "code_interpreter"}]}, "tools.0.type", "invalid_value"),
    ({"messages": ASK, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"messages": ASK, "functions": [WEATHER["function"]]}, None, "invalid_value"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]}, "messages.0",
     "invalid_value"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "invalid_value"),
])
def test_what_cannot_be_honoured_is_a_clear_400(server, body, param, code):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param, error


def test_a_template_without_tools_refuses_them_but_takes_tool_choice_none(served):
    srv = served(**ENGINE)  # the test llama's own template: no tool format
    r = post(srv, {"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_unsupported"
    assert "--chat-template" in r.json()["error"]["message"]
    assert post(srv, {"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}).status_code == 200
    r = post(srv, {"messages": HISTORY})  # calls in the history would be dropped by the template: refused
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_unsupported"
    assert "tool_calls" in r.json()["error"]["message"]
    srv = served(**ENGINE, tool_parser="json_tools")  # a parser, but the template ignores tools
    r = post(srv, {"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and "ignores tools" in r.json()["error"]["message"]
    r = post(srv, {"messages": HISTORY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
