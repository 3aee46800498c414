"""Hostile request bodies get a JSON 400 in their API's shape, before admission, and never fail a neighbour: a penalty
window wider than the context, a lone surrogate in an object key, a ``logit_bias`` key of thousands of digits, an
events cursor past 2**63, a ``response_format`` schema with a ``$ref`` cycle or thousands of branches, and a
boolean as a prompt token id."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from testkit.serve_thread import openai_client

pytestmark = pytest.mark.server

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WINDOWS = ("repetition_context_size", "presence_context_size", "frequency_context_size")


@pytest.fixture(scope="module")
def server(served):
    return served()


def post_raw(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def assert_openai_400(r: httpx.Response, param: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("field", WINDOWS)
@pytest.mark.parametrize("size", [2**40, 4097])
def test_a_penalty_window_wider_than_the_context_is_a_400_naming_it(server, field, size):
    client = openai_client(server.url)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2,
                                  extra_body={field: size, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                                              "frequency_penalty": 0.5})
    assert caught.value.body["param"] == field, caught.value.body


def test_a_bad_window_beside_a_decoding_neighbour_leaves_its_output_unchanged(server):
    client = openai_client(server.url)
    ask = dict(model="tiny-llama", prompt="the neighbour's prompt", max_tokens=24, temperature=0,
               extra_body={"cache_salt": "neighbour"})
    alone = client.completions.create(**ask).choices[0].text
    beside: dict[str, str] = {}
    started = threading.Event()

    def neighbour():
        stream = client.completions.create(**ask, stream=True)
        parts = []
        for chunk in stream:
            started.set()
            parts.append(chunk.choices[0].text if chunk.choices else "")
        beside["text"] = "".join(parts)

    thread = threading.Thread(target=neighbour)
    thread.start()
    assert started.wait(30)
    for field in WINDOWS:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "bad", "max_tokens": 8, field: 2**40,
                             "repetition_penalty": 1.2, "presence_penalty": 1.0, "frequency_penalty": 1.0})
        assert_openai_400(r, field)
    thread.join(60)
    assert beside["text"] == alone


def test_a_lone_surrogate_in_an_object_key_is_a_400_in_each_shape(server):
    body = b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "\\ud800k": 1}'
    error = assert_openai_400(post_raw(server, "/v1/chat/completions", body))
    assert error["code"] == "invalid_unicode" and "\\ud800" in error["param"]
    r = post_raw(server, "/v1/messages", body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "\\ud800" in r.json()["error"]["message"]


def test_a_logit_bias_key_of_thousands_of_digits_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "logit_bias": {"9" * 5000: 1}}, timeout=60)
    error = assert_openai_400(r, "logit_bias")
    assert len(error["message"]) < 300


@pytest.mark.parametrize("since", [str(10**23), "9" * 5000, str(2**63)])
def test_an_events_cursor_past_2_63_is_a_400(server, since):
    r = httpx.get(server.url + "/v1/cache/events", params={"since": since}, timeout=60)
    error = assert_openai_400(r, "since")
    assert len(error["message"]) < 300


def test_the_largest_events_cursor_is_accepted(server):
    r = httpx.get(server.url + "/v1/cache/events", params={"since": str(2**63 - 1)}, timeout=60)
    assert r.status_code == 200 and r.json()["events"] == [], r.text


SCHEMAS = {
    "ref_cycle": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "self_ref": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "wide_any_of": {"anyOf": [{"const": i} for i in range(3000)]},
    "wide_one_of": {"type": "object", "properties": {"x": {"oneOf": [{"const": i} for i in range(3000)]}}},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_an_unenforceable_schema_is_a_400_naming_response_format(server, name):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[name]}}
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "response_format": fmt}, timeout=60)
    assert_openai_400(r, "response_format")


def test_a_boolean_prompt_token_is_a_400(server):
    for prompt in ([False], [True], [1, False]):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt,
                                                             "max_tokens": 2}, timeout=60)
        assert_openai_400(r, "prompt")
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [0, 1], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
