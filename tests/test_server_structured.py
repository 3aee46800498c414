"""Structured output and forced tool calls through a real server on loopback with the official openai client: the
random-weight test llama served with the tools template (``--chat-template``), sampled at temperature 1.0 — a
random model writes anything it may, so every output that validates was held to its grammar.

Covered: ``response_format`` json_schema (many random schemas) and json_object on both routes, ``n > 1``,
streaming, constrained and free requests at once (the free ones' greedy text unchanged), ``tool_choice`` required /
named / strict tools / with a ``response_format``, and the 400s. SmolLM2 itself: test_real_model_structured.py.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
from testkit.json_schemas import random_schema

from mlxkv.engine.batch import EngineConfig
from mlxkv.server.structured_output import _special_id
from mlxkv.server.tools import ToolCallParser
from mlxkv.structured.tool_calls import CallMarkup, calls_in_text, document_or_calls, forced_calls
from mlxkv.structured import json_schema_format
from mlxkv.structured.vocabulary import vocabulary_for
from testkit.run_config import run_config
from testkit.serve_thread import openai_client, serve_in_thread

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
PARAMETERS = {"get_weather": CITY, "get_time": ZONE}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def serve(llama_dir, **options):
    """This module's server (eight sequences, the tools template) on its own engine, until the block ends."""
    config = run_config(llama_dir, engine=EngineConfig(max_sequences=8, max_queue_depth=32), kv_backend="paged",
                        chat_template=TEMPLATE, **options)
    return serve_in_thread(config, model_name="tiny-llama")


@pytest.fixture(scope="module")
def server(llama_dir):
    with serve(llama_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny-llama", **{"messages": ASK, "max_tokens": 400,
                                                                 "temperature": 1.0, **kwargs})


def valid(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ---- response_format ------------------------------------------------------------------------------------------


def test_json_schema_outputs_validate_over_random_schemas_at_temperature_one(client):
    rng = random.Random(11)
    schemas = [random_schema(rng) for _ in range(16)]

    def ask(i):
        return chat(client, response_format=schema_format(schemas[i], f"s{i}"), seed=i)

    with ThreadPoolExecutor(8) as pool:  # decoded together, eight constrained rows per step
        answers = list(pool.map(ask, range(len(schemas))))
    for answer, schema in zip(answers, schemas):
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        valid(answer.choices[0].message.content, schema)


def test_json_object_and_the_completions_route(client):
    for seed in range(3):
        answer = chat(client, response_format={"type": "json_object"}, max_tokens=60, seed=seed)
        text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length" and text.startswith("{") and answer.usage.completion_tokens == 60
    completion = client.completions.create(model="tiny-llama", prompt="A person as JSON:", max_tokens=200,
                                           temperature=1.0, seed=3,
                                           extra_body={"response_format": schema_format(PERSON)})
    assert completion.choices[0].finish_reason == "stop"
    valid(completion.choices[0].text, PERSON)


def test_parallel_samples_and_streams_are_constrained_each(client):
    answer = chat(client, response_format=schema_format(PERSON), n=4, seed=1)
    texts = [c.message.content for c in answer.choices]
    assert all(c.finish_reason == "stop" for c in answer.choices)
    assert [valid(t, PERSON) for t in texts] and len(set(texts)) > 1
    stream = chat(client, response_format=schema_format(PERSON), n=2, seed=2, stream=True,
                  stream_options={"include_usage": True})
    parts, finish = {0: [], 1: []}, {}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for index in (0, 1):
        valid("".join(parts[index]), PERSON)
    assert sum(len(p) > 0 for p in parts[0]) > 2  # streamed piece by piece, not in one chunk


def test_free_requests_beside_constrained_ones_give_their_greedy_text(llama_dir):
    questions = ["What is a tuple?", "Explain the import statement.", "How do generators work?"]
    with serve(llama_dir) as srv:  # its own engine: max_batch below counts this test's steps only
        client = openai_client(srv.url, timeout=120)

        def free(question):
            return chat(client, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
                        ).choices[0].message.content

        alone = [free(q) for q in questions]
        with ThreadPoolExecutor(8) as pool:
            constrained = [pool.submit(chat, client, response_format=schema_format(PERSON), seed=i) for i in range(4)]
            mixed = list(pool.map(free, questions))
            answers = [f.result() for f in constrained]
        max_batch = srv.parts.engine.stats()["max_batch"]
    assert mixed == alone
    for answer in answers:
        valid(answer.choices[0].message.content, PERSON)
    assert max_batch >= 5  # constrained and free rows decoded in the same steps


# ---- forced tool calls ----------------------------------------------------------------------------------------


def calls_of(answer, finish=("tool_calls",)):
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in finish, message
    assert not message.content
    out = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, valid(call.function.arguments, PARAMETERS[call.function.name])))
    return out


def test_tool_choice_required_makes_valid_calls(client):
    names = set()
    for seed in range(4):
        # Parallel calls allowed: a random model may go on calling until max_tokens; every call it made is whole.
        calls = calls_of(chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=seed),
                         ("tool_calls", "length"))
        assert calls
        names |= {name for name, _ in calls}
    assert names <= {"get_weather", "get_time"}
    for seed in range(3):
        single = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(calls_of(single)) == 1


def test_a_named_function_is_the_one_called_streamed_too(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        assert [name for name, _ in calls_of(chat(client, tools=[WEATHER, TIME], tool_choice=choice, seed=seed))] == [
            "get_time"]
    deltas, finish = [], None
    for chunk in chat(client, tools=[WEATHER, TIME], tool_choice=choice, seed=4, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            assert not c.delta.content
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == "get_time" and deltas[0].index == 0
    valid(deltas[0].function.arguments, ZONE)


def test_strict_tools_and_tools_with_a_response_format_are_honoured(client):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for seed in range(3):
        answer = chat(client, tools=[strict], seed=seed, max_tokens=60)
        for call in answer.choices[0].message.tool_calls or []:  # a call, if the model starts one, is valid
            valid(call.function.arguments, CITY)
    for seed in range(4):  # a document or a call: both held to their schemas
        answer = chat(client, tools=[WEATHER], response_format=schema_format(PERSON), seed=seed)
        message = answer.choices[0].message
        if message.tool_calls:
            calls_of(answer)
        else:
            assert answer.choices[0].finish_reason == "stop"
            valid(message.content, PERSON)


# ---- refusals -------------------------------------------------------------------------------------------------


def post(server, body, route="/v1/chat/completions"):
    payload = {"model": "tiny-llama", "max_tokens": 4, **({"messages": ASK} if "chat" in route else {"prompt": "x"}),
               **body}
    return httpx.post(server.url + route, json=payload, timeout=60)


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": schema_format({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": "json"}, "response_format", "valid dictionary"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "unsupported field"),
    ({"response_format": schema_format({"type": "object", "minProperties": "two"})}, "response_format",
     "invalid JSON schema"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "ipv9"}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters", "format"),
])
def test_bad_formats_and_impossible_tool_choices_are_400s_naming_the_field(server, body, param, fragment):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_completions_refuse_a_bad_response_format_too(server):
    r = post(server, {"response_format": {"type": "json_schema"}}, route="/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_a_tool_format_without_a_grammar_is_refused_clearly(llama_dir):
    with serve(llama_dir, tool_parser="qwen3_coder") as srv:  # the template renders tools; the parser reads XML
        r = post(srv, {"tools": [WEATHER], "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "json_tools" in r.json()["error"]["message"] and "qwen3_coder" in r.json()["error"]["message"]
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        r = post(srv, {"tools": [WEATHER, strict]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.strict", r.text
        assert post(srv, {"tools": [WEATHER]}).status_code == 200  # auto, unconstrained: as before


# ---- the grammars themselves ----------------------------------------------------------------------------------


def accepts(fmt, tokenizer, text) -> bool:
    vocabulary = vocabulary_for(tokenizer)
    matcher = vocabulary.matcher(fmt.grammar)
    return matcher.consume_tokens(vocabulary.ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_the_call_grammars_write_what_the_tool_parser_reads(server):
    tokenizer = server.parts.loaded.tokenizer
    markup = CallMarkup(tokenizer.tool_call_start, tokenizer.tool_call_end)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    forced = forced_calls([WEATHER, TIME], markup)
    assert accepts(forced, tokenizer, call) and accepts(forced, tokenizer, call + "\n" + other)
    assert not accepts(forced, tokenizer, "Sure! " + call)  # only calls
    assert not accepts(forced, tokenizer, call.replace('"utc"', '"mars"'))  # arguments follow the schema
    assert not accepts(forced_calls([WEATHER, TIME], markup, names=["get_weather"]), tokenizer, call)
    assert not accepts(forced_calls([WEATHER, TIME], markup, parallel=False), tokenizer, call + "\n" + other)
    parser = ToolCallParser(tokenizer, [WEATHER, TIME])
    content, calls = parser.feed(call + "\n" + other)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    in_text = calls_in_text([WEATHER, TIME], markup)
    assert accepts(in_text, tokenizer, "Let me check. " + call + " Done.")
    assert accepts(in_text, tokenizer, "No call at all.")
    assert not accepts(in_text, tokenizer, 'Let me check. <tool_call>\n{"name": "get_date"}')
    either = document_or_calls(json_schema_format(PERSON), [TIME], markup)
    assert accepts(either, tokenizer, '{"name": "Ada", "age": 36}') and accepts(either, tokenizer, call)
    assert not accepts(either, tokenizer, "Ada, 36")
    vocabulary = vocabulary_for(tokenizer)
    assert _special_id(tokenizer, vocabulary, "<|user|>") == 4
    assert _special_id(tokenizer, vocabulary, "<tool_call>") is None
    special = forced_calls([TIME], CallMarkup("<|user|>", "<|assistant|>", start_id=4, end_id=5))
    body = vocabulary.ll_tokenizer.tokenize_str('\n{"name": "get_time", "arguments": {"zone": "cet"}}\n')
    matcher = vocabulary.matcher(special.grammar)  # a special-token marker is that token, not its spelling
    assert matcher.consume_tokens([4] + body + [5]) and matcher.is_accepting()
    spelled = vocabulary.matcher(special.grammar)
    assert not spelled.consume_tokens(vocabulary.ll_tokenizer.greedy_tokenize("<|user|>"))  # its bytes spelled out
