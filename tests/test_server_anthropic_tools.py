"""Tool use on the Anthropic Messages API.

Against a real server on loopback (the random-weight test llama served with the tools template, ``--chat-template``)
with the official ``anthropic`` client: tools and tool_use / tool_result history render the prompt the chat route
renders for the same conversation (token counts: ``count_tokens`` against ``/v1/chat/completions`` usage, and the
same greedy answer), an answer's blocks go back as history, and what cannot be honoured is a 400. The random model
never writes a call, so the output side runs on scripted model outputs (tokenized by the test tokenizer and decoded
back token by token as the engine does): the Message and its stream events, and the official client's stream
accumulator rebuilding the ``tool_use`` blocks from our SSE bytes. SmolLM2's own calls at the end
(``MLXKV_TEST_GGUF``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import anthropic._base_client
import pytest
from testkit.real_model import GGUF

from mlxkv.engine.batch import EngineConfig
from mlxkv.engine.output import Event, TextStream, Usage
from mlxkv.server.anthropic.message import Reply
from mlxkv.server.anthropic.schemas import CountTokensRequest
from mlxkv.server.anthropic.stream import message_events
from mlxkv.server.anthropic.tool_use import TOOL_USE_ID_PREFIX, plan_tools
from mlxkv.server.anthropic.translate import to_conversation
from mlxkv.server.tool_stream import ToolOutput
from mlxkv.server.tools import render_tools, to_template_messages
from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def function(tool: dict) -> dict:
    """The OpenAI tool an Anthropic tool is."""
    fn = {"name": tool["name"], **({"description": tool["description"]} if "description" in tool else {}),
          "parameters": tool["input_schema"]}
    return {"type": "function", "function": fn}


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


#: The engine this module's servers run (the same in test_server_tools.py: they share them).
ENGINE = {"max_sequences": 2, "max_queue_depth": 8}


@pytest.fixture(scope="module")
def server(served):
    return served(**ENGINE, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server.url)


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.parts.loaded.tokenizer


def rendered(tokenizer, messages, tools=None) -> list[int]:
    """The prompt ids of OpenAI-shaped messages (and tools), rendered here."""
    kwargs = {"tools": render_tools(tools)} if tools else {}
    return list(tokenizer.apply_chat_template(to_template_messages(messages), add_generation_prompt=True, **kwargs))


def both(client, oai, anthropic_kwargs: dict, openai_kwargs: dict, max_tokens: int = 6):
    """The same conversation on both routes, greedy: ``(message, chat completion, counted input tokens)``."""
    m = client.messages.create(model="m", max_tokens=max_tokens, extra_body=GREEDY, **anthropic_kwargs)
    r = oai.chat.completions.create(model="m", max_tokens=max_tokens, temperature=0, **openai_kwargs)
    counted = client.messages.count_tokens(model="m", **anthropic_kwargs).input_tokens
    return m, r, counted


# ---- the request side, on a real server -------------------------------------------------------------------------
def test_tools_render_the_prompt_the_chat_route_renders(client, oai, tokenizer):
    system = "You are a weather bot."
    for tools in ([WEATHER], [WEATHER, TIME]):
        m, r, counted = both(client, oai, dict(system=system, messages=ASK, tools=tools),
                             dict(messages=[{"role": "system", "content": system}, *ASK],
                                  tools=[function(t) for t in tools]))
        prompt = rendered(tokenizer, [{"role": "system", "content": system}, *ASK], [function(t) for t in tools])
        assert counted == r.usage.prompt_tokens == len(prompt)
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == r.choices[0].message.content
        assert '"name": "get_weather"' in tokenizer.decode(prompt)
    plain = len(rendered(tokenizer, ASK))
    with_tools = len(rendered(tokenizer, ASK, [function(WEATHER)]))
    assert plain < with_tools
    for choice, expected in (({"type": "auto"}, with_tools), ({"type": "none"}, plain),
                             ({"type": "auto", "disable_parallel_tool_use": True}, with_tools)):
        counted = client.messages.count_tokens(model="m", messages=ASK, tools=[WEATHER], tool_choice=choice)
        assert counted.input_tokens == expected, choice
    m = client.messages.create(model="m", max_tokens=4, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"},
                               extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == plain and m.stop_reason == "max_tokens"


def test_tool_use_and_tool_result_history_renders_as_chat_history(client, oai, tokenizer):
    history = ASK + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking both."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": '{"temperature_c": 21, '}, {"type": "text", "text": '"sky": "sunny"}'}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "clock offline", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]
    chat = ASK + [
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temperature_c": 21, "sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: clock offline"},
        {"role": "user", "content": "And tomorrow?"}]
    tools = [WEATHER, TIME]
    m, r, counted = both(client, oai, dict(messages=history, tools=tools),
                         dict(messages=chat, tools=[function(t) for t in tools]))
    prompt = rendered(tokenizer, chat, [function(t) for t in tools])
    text = tokenizer.decode(prompt)
    assert 'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature_c": 21, "sky": "sunny"}\n</tool_response>' in text
    assert "<tool_response>\nError: clock offline\n</tool_response>" in text
    assert counted == r.usage.prompt_tokens == len(prompt)
    assert m.content[0].text == r.choices[0].message.content
    with client.messages.stream(model="m", max_tokens=6, messages=history, tools=tools, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason


BOUNDED = {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                                       "required": ["city"], "additionalProperties": False}}


def test_a_forced_tool_choice_makes_the_model_call(client):
    """``any`` (one call: ``disable_parallel_tool_use``) and a named ``tool`` go through the chat route's grammars:
    even the random-weight model answers with exactly one valid call, streamed too."""
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        m = client.messages.create(model="m", max_tokens=120, messages=ASK, tools=[BOUNDED], tool_choice=choice)
        calls = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(calls) == 1, m
        assert calls[0].name == "get_weather" and isinstance(calls[0].input["city"], str)
        assert len(calls[0].input["city"]) <= 10 and set(calls[0].input) == {"city"}
    with client.messages.stream(model="m", max_tokens=120, messages=ASK, tools=[BOUNDED],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].name == "get_weather" and isinstance(final.content[-1].input["city"], str)


def test_what_cannot_be_honoured_is_a_400(client):
    history = ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}]
    refused = [
        (dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"}), "get_time"),
        (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools"),
        (dict(tools=[{**WEATHER, "input_schema": {"properties": {}}}]), '"type": "object"'),
        (dict(tools=[WEATHER, WEATHER]), "unique"),
        (dict(tools=[{**WEATHER, "name": "has space"}]), "tools.0.name"),
        (dict(tools=[{**WEATHER, "defer_loading": True}]), "tool search"),
        (dict(tools=[{**WEATHER, "input_examples": [{"city": "Oslo"}]}]), "input_examples"),
        (dict(tools=[{**WEATHER, "allowed_callers": ["code_execution_20250825"]}]), "direct"),
        (dict(tool_choice={"type": "any"}), "needs tools"),
        (dict(messages=history), "final assistant turn calls tools"),
        (dict(messages=[*history, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]), "toolu_9"),
        (dict(messages=[*ASK, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]), "no tool_use block"),
    ]
    for kwargs, needle in refused:
        kwargs.setdefault("messages", ASK)
        for call in (lambda: client.messages.create(model="m", max_tokens=2, **kwargs),
                     lambda: client.messages.count_tokens(model="m", **kwargs)):
            with pytest.raises(anthropic.BadRequestError) as err:
                call()
            assert needle in err.value.message, (kwargs, err.value.message)
            assert err.value.body["error"]["type"] == "invalid_request_error"


def test_a_template_without_tools_refuses_tools_and_tool_history(served):
    srv = served(**ENGINE)  # the test llama's own template: no tool format
    client = anthropic_client(srv.url, api_key="x")
    history = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    for kwargs in (dict(messages=ASK, tools=[WEATHER]), dict(messages=history),
                   dict(messages=history, tools=[WEATHER], tool_choice={"type": "none"})):
        with pytest.raises(anthropic.BadRequestError, match="--chat-template"):
            client.messages.create(model="m", max_tokens=2, **kwargs)
        with pytest.raises(anthropic.BadRequestError, match="--chat-template"):
            client.messages.count_tokens(model="m", **kwargs)
    plain = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    none = client.messages.count_tokens(model="m", messages=ASK, tools=[WEATHER], tool_choice={"type": "none"})
    assert none.input_tokens == plain  # not shown: nothing for the template to render
    assert client.messages.create(model="m", max_tokens=2, messages=ASK, tools=[WEATHER],
                                  tool_choice={"type": "none"}).usage.output_tokens == 2


# ---- the output side, on scripted model outputs -----------------------------------------------------------------
class ScriptedHandle:
    """A request handle that hands out a fixed list of engine events (what :func:`message_events` reads)."""

    def __init__(self, events):
        self._events = list(events)

    async def aget(self, timeout=None):
        return self._events.pop(0)

    def get_nowait(self):
        return self._events.pop(0) if self._events else None

    def cancel(self):
        pass


def scripted_events(tokenizer, script: str, *, max_tokens: int = 10_000, eos: bool = True, whole: bool = False):
    """The engine's token events for a model that writes ``script`` (then its end of turn), and the done event;
    ``whole``: all its text in one event (as a detokenizer or stop matcher releasing held text at once)."""
    ids = list(tokenizer.encode(script, add_special_tokens=False)) + ([next(iter(tokenizer.eos_token_ids))] if eos
                                                                      else [])
    stream = TextStream(tokenizer, (), max_tokens)
    events = []
    for token in ids:
        text, finish = stream.feed(token)
        events.append(Event("token", 0, text, token, finish))
        if finish:
            break
    if whole:
        events = [Event("token", 0, "".join(e.text for e in events), events[-1].token, events[-1].finish_reason)]
    return events + [Event("done", usage=Usage(20, len(events)))]


def new_reply(tokenizer, *, tools=True, parallel=True, max_tokens=10_000):
    output = ToolOutput(tokenizer, [function(WEATHER)], 1, parallel=parallel, id_prefix=TOOL_USE_ID_PREFIX) \
        if tools else None
    return Reply(tokenizer, model="tiny-llama", max_tokens=max_tokens, stop_sequences=(), prompt_tokens=20,
                 tools=output)


def whole_message(tokenizer, events, **reply_options) -> dict:
    reply = new_reply(tokenizer, **reply_options)
    for e in events[:-1]:
        reply.add(e)
    return reply.message(events[-1].usage)


def sse_bytes(tokenizer, events, **reply_options) -> bytes:
    async def run():
        return "".join([chunk async for chunk in message_events(ScriptedHandle(events),
                                                                new_reply(tokenizer, **reply_options))])
    return asyncio.run(run()).encode()


def parse_sse(data: bytes) -> list[dict]:
    lines = [line for line in data.decode().splitlines() if line]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [p["type"] for p in payloads] == [line.removeprefix("event: ") for line in lines[0::2]]
    return payloads


def client_final_message(data: bytes):
    """The official client's ``messages.stream(...).get_final_message()`` over our SSE bytes (served by a mock
    transport of the HTTP library the client is built on: ``httpx2`` in recent releases, ``httpx`` before)."""
    http = getattr(anthropic._base_client, "httpx2", None) or anthropic._base_client.httpx
    transport = http.MockTransport(lambda request: http.Response(
        200, headers={"content-type": "text/event-stream"}, content=data))
    client = anthropic.Anthropic(base_url="http://mlxkv.test", api_key="x", max_retries=0,
                                 http_client=http.Client(transport=transport))
    with client.messages.stream(model="tiny-llama", max_tokens=100, messages=ASK) as stream:
        return stream.get_final_message()


def block_dicts(message) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def without_ids(blocks: list[dict]) -> list[dict]:
    """Blocks less their tool_use ids (fresh in every answer), which must be Anthropic's ``toolu_`` ones."""
    assert all(b["id"].startswith("toolu_") for b in blocks if b["type"] == "tool_use")
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


SCRIPT = "Let me look that up.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + \
    call_text("get_weather", {"city": "Köln"})


def test_calls_become_tool_use_blocks_after_the_text(tokenizer):
    message = whole_message(tokenizer, scripted_events(tokenizer, SCRIPT))
    text, paris, koln = message["content"]
    assert text == {"type": "text", "text": "Let me look that up."}
    for block, city in ((paris, "Paris"), (koln, "Köln")):
        assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": city}
        assert block["id"].startswith("toolu_") and len(block["id"]) == len("toolu_") + 24
    assert paris["id"] != koln["id"]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    first_only = whole_message(tokenizer, scripted_events(tokenizer, SCRIPT), parallel=False)["content"]
    assert [b["type"] for b in first_only] == ["text", "tool_use"] and first_only[1]["input"] == {"city": "Paris"}


def test_the_stream_sends_each_call_as_a_tool_use_block(tokenizer):
    events = parse_sse(sse_bytes(tokenizer, scripted_events(tokenizer, SCRIPT)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["ping", "message_start", "content_block_start"]  # the text block waits for text
    assert events[2] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    blocks = [e for e in events if e["type"].startswith("content_block")]
    text_deltas = [e for e in blocks if e["type"] == "content_block_delta" and e["index"] == 0]
    assert "".join(e["delta"]["text"] for e in text_deltas) == "Let me look that up."
    tail = blocks[1 + len(text_deltas):]
    assert [(e["type"], e["index"]) for e in tail] == [
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    start, delta = tail[1]["content_block"], tail[2]["delta"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    assert start["id"].startswith("toolu_")
    assert delta["type"] == "input_json_delta" and json.loads(delta["partial_json"]) == {"city": "Paris"}
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert all("<tool" not in json.dumps(e) for e in events)


def test_the_official_client_rebuilds_the_tool_use_blocks(tokenizer):
    cases = [
        (SCRIPT, {}),
        (call_text("get_weather", {"city": "Oslo"}), {}),  # a call first: no text block at all
        (call_text("get_weather", {"city": "Oslo"}) + "\nDone, see above.", {}),  # text after a call: its own block
        (SCRIPT, {"parallel": False}),
        ("No tools needed: it is sunny.", {}),
        ("Plain text <tool_call> is just text here.", {"tools": False}),
    ]
    for script, options in cases:
        events = scripted_events(tokenizer, script)
        whole = whole_message(tokenizer, events, **options)
        final = client_final_message(sse_bytes(tokenizer, events, **options))
        assert without_ids(block_dicts(final)) == without_ids(whole["content"]), script
        assert (final.stop_reason, final.usage.output_tokens) == (whole["stop_reason"],
                                                                   whole["usage"]["output_tokens"])
        # and the same content when the engine releases the whole text in one event (blocks stay in order)
        at_once = whole_message(tokenizer, scripted_events(tokenizer, script, whole=True), **options)
        assert without_ids(at_once["content"]) == without_ids(whole["content"]), script
    oslo = whole_message(tokenizer, scripted_events(tokenizer, cases[2][0]))["content"]
    assert [b["type"] for b in oslo] == ["tool_use", "text"] and oslo[1]["text"] == "\nDone, see above."


def test_without_tools_the_stream_is_one_text_block_opened_with_the_first_token(tokenizer):
    events = parse_sse(sse_bytes(tokenizer, scripted_events(tokenizer, "Hello there."), tools=False))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["ping", "message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    empty = whole_message(tokenizer, scripted_events(tokenizer, ""), tools=True)  # nothing at all: one empty block
    assert empty["content"] == [{"type": "text", "text": ""}] and empty["stop_reason"] == "end_turn"
    assert block_dicts(client_final_message(sse_bytes(tokenizer, scripted_events(tokenizer, "")))) == \
        [{"type": "text", "text": ""}]


def test_a_call_cut_off_by_max_tokens_is_dropped_and_a_bad_call_is_text(tokenizer):
    script = "Sure. " + call_text("get_weather", {"city": "Paris"})
    ids = tokenizer.encode(script, add_special_tokens=False)
    cut = max(k for k in range(len(ids)) if "Paris" not in tokenizer.decode(ids[:k]))
    message = whole_message(tokenizer, scripted_events(tokenizer, script, max_tokens=cut), max_tokens=cut)
    assert [b["type"] for b in message["content"]] == ["text"] and message["stop_reason"] == "max_tokens"
    assert message["content"][0]["text"] == "Sure."  # the cut call's markup is dropped
    not_object = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'  # arguments not an object
    message = whole_message(tokenizer, scripted_events(tokenizer, not_object))
    assert message["content"] == [{"type": "text", "text": not_object}] and message["stop_reason"] == "end_turn"


def test_an_answer_s_blocks_go_back_as_history(client, oai, tokenizer):
    """The usual agent loop: the answer's content as the assistant turn, then a user turn with the results."""
    final = client_final_message(sse_bytes(tokenizer, scripted_events(tokenizer, SCRIPT)))
    paris, koln = final.content[1:]
    history = [*ASK, {"role": "assistant", "content": final.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": paris.id, "content": "sunny"},
                                            {"type": "tool_result", "tool_use_id": koln.id, "content": "rain"}]}]
    chat = [*ASK, {"role": "assistant", "content": "Let me look that up.", "tool_calls": [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in (paris, koln)]},
        {"role": "tool", "tool_call_id": paris.id, "content": "sunny"},
        {"role": "tool", "tool_call_id": koln.id, "content": "rain"}]
    m, r, counted = both(client, oai, dict(messages=history, tools=[WEATHER]),
                         dict(messages=chat, tools=[function(WEATHER)]))
    assert counted == r.usage.prompt_tokens == len(rendered(tokenizer, chat, [function(WEATHER)]))
    assert m.content[0].text == r.choices[0].message.content


def test_is_error_and_block_results_translate_to_tool_messages():
    body = CountTokensRequest.model_validate({"model": "m", "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                 "input": {"city": "Paris"}, "caller": {"type": "direct"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "timed "}, {"type": "text", "text": "out"}]}]}],
        "tools": [TIME]})
    conv = to_conversation(body)
    assert conv.messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": "Error: timed out"}
    assert conv.tools == [function(TIME)]  # no description: none rendered, as the chat route leaves it out


def test_tool_choice_decides_what_is_parsed(tokenizer):
    """The route's plan for each tool_choice, run on the scripted two-call answer: auto parses every call,
    disable_parallel_tool_use the first, none leaves the markup as text (the tools were not shown either)."""
    def content(choice):
        body = CountTokensRequest.model_validate({"model": "m", "messages": ASK, "tools": [WEATHER],
                                                  **({"tool_choice": choice} if choice else {})})
        plan = plan_tools(to_conversation(body), None)
        reply = Reply(tokenizer, model="m", max_tokens=10_000, stop_sequences=(), prompt_tokens=1,
                      tools=plan.output(tokenizer))
        events = scripted_events(tokenizer, SCRIPT)
        for e in events[:-1]:
            reply.add(e)
        return bool(plan.template_kwargs), [b["type"] for b in reply.message(events[-1].usage)["content"]]

    assert content(None) == content({"type": "auto"}) == (True, ["text", "tool_use", "tool_use"])
    assert content({"type": "auto", "disable_parallel_tool_use": True}) == (True, ["text", "tool_use"])
    assert content({"type": "none"}) == (False, ["text"])


def earlier_turn(i: int, city: str) -> tuple[list[dict], list[dict]]:
    """A question the assistant answered by a call: the Messages API's turns, and the chat route's."""
    question = {"role": "user", "content": f"What is the weather in {city}?"}
    return ([question, {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}",
                                                           "name": "get_weather", "input": {"city": city}}]}],
            [question, {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"toolu_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}])


@pytest.mark.real_model
def test_smollm2_calls_a_tool_and_answers_its_result():
    """SmolLM2-135M calls the tool when earlier turns show the assistant answering such questions by a call (see
    test_real_model_tools.py); given the call's result, it answers as the chat route does the same conversation."""
    config = run_config(str(GGUF), dequantize=True, chat_template=TEMPLATE, engine=EngineConfig(max_sequences=2),
                        kv_backend="paged")
    with serve_in_thread(config, model_name="smollm2") as srv:
        client = anthropic_client(srv.url, api_key="x", timeout=600)
        oai = openai_client(srv.url, api_key="x", timeout=600)
        (a1, c1), (a2, c2) = earlier_turn(1, "London"), earlier_turn(2, "Berlin")
        question = {"role": "user", "content": "What is the weather in Paris?"}
        ask, chat = [*a1, *a2, question], [*c1, *c2, question]
        m = client.messages.create(model="smollm2", max_tokens=48, messages=ask, tools=[WEATHER], extra_body=GREEDY)
        assert m.stop_reason == "tool_use", m
        (call,) = [b for b in m.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
        assert all(b.text.strip() for b in m.content if b.type == "text")
        with client.messages.stream(model="smollm2", max_tokens=48, messages=ask, tools=[WEATHER],
                                    extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "input", None)) for b in final.content] == \
            [(b.type, getattr(b, "input", None)) for b in m.content]

        result = '{"city": "Paris", "temperature_c": 21, "sky": "sunny"}'
        history = [*ask, {"role": "assistant", "content": m.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]
        answer = client.messages.create(model="smollm2", max_tokens=40, messages=history, tools=[WEATHER],
                                        extra_body=GREEDY)
        text = "".join(b.text for b in m.content if b.type == "text")
        chat += [{"role": "assistant", "content": text or None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}]
        r = oai.chat.completions.create(model="smollm2", messages=chat, tools=[function(WEATHER)], max_tokens=40,
                                        temperature=0)
        assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == r.usage.prompt_tokens
        assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
        assert answer.content[0].text == r.choices[0].message.content and answer.content[0].text.strip()
