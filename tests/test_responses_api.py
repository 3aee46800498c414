"""``/v1/responses`` through the official openai client against a real server on loopback: the random-weight test
llama served with the tools template, for the mechanics a random model shows (the shapes of responses and stream
events, items and tools in, constrained output, stored responses and their continuation from the KV cache,
tenancy, refusals). A real conversation on SmolLM2 is in test_responses_api_real.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel

from testkit.serve_thread import openai_client

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


class Weather(BaseModel):
    city: str
    degrees: int


#: The engine of test_server_tools.py's servers: this module shares them.
ENGINE = {"max_sequences": 2, "max_queue_depth": 8}


@pytest.fixture(scope="module")
def server(served):
    return served(**ENGINE, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def test_string_input_whole(client):
    r = client.responses.create(model="m", input="Say hello.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_stream_events_in_order(client):
    with client.responses.create(model="m", input="Say hello.", max_output_tokens=6, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 6
    whole = client.responses.create(model="m", input="Say hello.", max_output_tokens=6, temperature=0)
    assert whole.output_text == text  # greedy: the stream says what the whole answer says


def test_stream_helper_and_items(client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And now?"}]}]
    # the helper's final response needs response.completed: a schema makes the random model finish
    with client.responses.stream(model="m", input=items, instructions="Be brief.", max_output_tokens=200,
                                 temperature=0, text_format=Weather) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and final.instructions == "Be brief."
    assert isinstance(final.output_parsed, Weather)


def test_parse_follows_the_schema(client):
    r = client.responses.parse(model="m", input="Weather in Paris as JSON.", text_format=Weather, temperature=0,
                               max_output_tokens=200)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Weather)


def test_forced_function_call_and_its_output(client):
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                temperature=0, max_output_tokens=64)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model="m", tools=[WEATHER], temperature=0, max_output_tokens=4,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


def test_streamed_function_call(client):
    with client.responses.stream(model="m", input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=64) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    [call] = [i for i in final.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)


def test_previous_response_id_continues_from_the_cache(client):
    first = client.responses.create(model="m", input="Tell me a long story about a cat. " * 6,
                                    max_output_tokens=20, temperature=0)
    second = client.responses.create(model="m", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    kept = first.usage.input_tokens + first.usage.output_tokens
    # the new prompt starts with the first turn's own tokens: every whole block of them is a cache hit
    assert second.usage.input_tokens > kept
    assert second.usage.input_tokens_details.cached_tokens >= kept - 16
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_retrieve_delete_and_tenancy(llama_dir):
    """A stored response belongs to its tenant: another API key's tenant cannot read, delete or continue it."""
    from testkit.run_config import run_config
    from testkit.serve_thread import serve_in_thread

    from mlxkv.config import EngineConfig
    from mlxkv.server.tenancy import Tenants

    mine, theirs = "tenant-key-one-0123456789", "tenant-key-two-9876543210"
    config = run_config(llama_dir, engine=EngineConfig(**ENGINE), kv_backend="paged", chat_template=TEMPLATE)
    with serve_in_thread(config, model_name="m", tenants=Tenants.from_options([mine, theirs])) as two_tenants:
        _check_tenancy(openai_client(two_tenants.url, api_key=mine), openai_client(two_tenants.url, api_key=theirs))


def _check_tenancy(client, other):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2, metadata={"k": "v"})
    assert client.responses.retrieve(r.id).metadata == {"k": "v"}
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: other.responses.create(model="m", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=r.id)


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input"),  # a text-only model: "this model reads text only"
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input.0.content.0.file_id"),
    ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input.0.colour"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
])
def test_refusals_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_ids_are_404(server):
    assert httpx.get(server.url + "/v1/responses/resp_nope").status_code == 404
    assert httpx.delete(server.url + "/v1/responses/resp_nope").status_code == 404


def test_function_call_output_continues_a_stored_call(client):
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    [call] = [i for i in r.output if i.type == "function_call"]
    follow = client.responses.create(
        model="m", tools=[WEATHER], previous_response_id=r.id, temperature=0, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    # the stored call is rendered before its output, and its tokens come from the cache
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 16


def test_a_continuation_needs_the_stored_salt(server, client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2, extra_body={"cache_salt": "tenant-a"})
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=r.id, max_output_tokens=2)
    ok = client.responses.create(model="m", input="x", previous_response_id=r.id, max_output_tokens=2,
                                 extra_body={"cache_salt": "tenant-a"})
    assert ok.previous_response_id == r.id
