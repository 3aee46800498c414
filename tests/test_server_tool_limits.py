"""Tool calls at their limits, through the official openai and anthropic clients against the test llama on loopback
(the tools template): a call cut by ``max_tokens`` never reaches a client as markup (content ``null``, finish
``length``; the openai stream helper does not raise), ``parallel_tool_calls: false`` gives exactly one call and the
grammar ends after it, a call repeated verbatim is given once, a function declared without ``parameters`` takes
``{}``; the same on the Messages API (``tool_choice: any``: tool_use blocks only). A forced ``tool_choice`` makes
even random weights write calls (constrained decoding), so these need no real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.serve_thread import anthropic_client, openai_client

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
ENGINE = {"max_sequences": 2, "max_queue_depth": 8}  # as test_server_tools.py: the same shared server
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}  # no parameters
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
MARKUP = ("<tool_call>", "</tool_call>", '"name"')


@pytest.fixture(scope="module")
def server(served):
    return served(**ENGINE, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP)


def test_a_call_cut_by_max_tokens_is_content_null_and_finish_length(client):
    for max_tokens in (1, 3, 8):
        r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=max_tokens, temperature=0)
        choice = r.choices[0]
        assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", None, None)
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True,
                                                     tool_choice="required", max_tokens=max_tokens, temperature=0))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert all(no_markup(d.content) and not d.tool_calls for d in deltas)
        assert chunks[-1].choices[0].finish_reason == "length"
        with client.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=max_tokens, temperature=0) as stream:
            events = list(stream)  # the helper reads a cut call's stream without raising
            snapshot = stream.current_completion_snapshot  # (get_final_completion raises on any "length", by design)
        assert not [e for e in events if e.type == "content.delta" and e.delta or e.type.startswith("tool_calls")]
        assert snapshot.choices[0].finish_reason == "length" and not snapshot.choices[0].message.content
        assert not snapshot.choices[0].message.tool_calls


def test_a_function_without_parameters_takes_an_empty_object(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(model="m", messages=ASK, tools=[TIME], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=40, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_required_is_at_least_one_call_and_a_repeat_is_given_once(client):
    # get_time's only call is {"name": "get_time", "arguments": {}}: every further call would repeat it
    r = client.chat.completions.create(model="m", messages=ASK, tools=[TIME], tool_choice="required",
                                       max_tokens=80, temperature=0)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    assert no_markup(r.choices[0].message.content)


def test_anthropic_any_answers_tool_use_blocks_only(server):
    client = anthropic_client(server.url)
    tool = {"name": "get_time", "description": "The current time",
            "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    ask = [{"role": "user", "content": "What time is it?"}]
    whole = client.messages.create(model="m", max_tokens=40, messages=ask, tools=[tool], tool_choice={"type": "any"},
                                   extra_body=GREEDY)
    assert whole.stop_reason in ("tool_use", "max_tokens") and whole.content
    assert all(b.type == "tool_use" for b in whole.content), whole.content
    for max_tokens in (2, 5):  # cut inside the call: no text block of markup
        for stream in (False, True):
            kwargs = dict(model="m", max_tokens=max_tokens, messages=ask, tools=[tool],
                          tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
            if stream:
                with client.messages.stream(**kwargs) as s:
                    message = s.get_final_message()
            else:
                message = client.messages.create(**kwargs)
            assert message.stop_reason == "max_tokens"
            assert all(b.type == "tool_use" or (b.type == "text" and no_markup(b.text) and not b.text.strip())
                       for b in message.content), message.content


def test_anthropic_structured_output_with_a_forced_call_is_refused_naming_it(server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(server.url).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}],
            tools=[{"name": "t", "input_schema": {"type": "object"}}], tool_choice={"type": "any"},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert "output_config.format" in info.value.message
