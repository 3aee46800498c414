"""The Messages API's usage and structured output through the official anthropic client against the test llama on
loopback: every stream event reports the same usage as the final one (``message_start``'s input and cache-read
tokens are ``message_delta``'s), and ``output_config.format`` (what ``messages.parse`` sends) and the beta's
``output_format`` hold the answer to their JSON schema by constrained decoding."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import pytest
from pydantic import BaseModel
from testkit.serve_thread import anthropic_client

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0}
LONG = "Explain what the with statement does, and when a context manager's exit runs. " * 6
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]  # bounded: random weights would write a string without end
    sunny: bool


@pytest.fixture(scope="module")
def server(served):
    return served()  # as test_server_anthropic.py: the same shared server


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server.url)


def test_every_stream_event_reports_the_same_usage(client):
    ask = [{"role": "user", "content": LONG}]
    client.messages.create(model="m", max_tokens=2, messages=ask)  # the prompt's blocks are cached now
    with client.messages.stream(model="m", max_tokens=4, messages=ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens, start.cache_creation_input_tokens) == \
        (delta.input_tokens, delta.cache_read_input_tokens, delta.cache_creation_input_tokens)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (delta.input_tokens,
                                                                               delta.cache_read_input_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model="m", messages=ask).input_tokens


def test_output_config_format_holds_the_answer_to_its_schema(client):
    ask = [{"role": "user", "content": "Weather in Paris as JSON."}]
    for kwargs in ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"},
                    "extra_body": GREEDY},
                   {"extra_body": {"output_format": {"type": "json_schema", "schema": SCHEMA}, **GREEDY}}):
        message = client.messages.create(model="m", max_tokens=60, messages=ask, **kwargs)
        assert message.stop_reason == "end_turn", message
        value = json.loads(message.content[0].text)
        assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)
    parsed = client.messages.parse(model="m", max_tokens=60, messages=ask, output_format=Weather, extra_body=GREEDY)
    assert isinstance(parsed.parsed_output, Weather)
    with client.messages.stream(model="m", max_tokens=60, messages=ask, output_format=Weather, extra_body=GREEDY) as stream:
        assert isinstance(stream.get_final_message().parsed_output, Weather)


@pytest.mark.parametrize("body, field", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
      "output_format": {"type": "json_schema", "schema": {"type": "object"}}}, "output_format"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
])
def test_structured_output_refusals_name_the_field(client, body, field):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               extra_body=body)
    assert field in info.value.message, info.value.message
