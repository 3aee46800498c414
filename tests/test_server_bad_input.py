"""Bad input stays a 4xx and never holds up anyone else, on a real server on loopback: invalid Unicode on every
route (keep-alive connection still usable), a prompt too long by its characters refused before tokenizing, and a
short prompt tokenized while a long one still is."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest

from mlxkv.engine.batch import EngineConfig
from mlxkv.server.app import create_app
from mlxkv.server.runner import ServerThread, build
from testkit.run_config import run_config

pytestmark = pytest.mark.server

SLOW_CHARS = 20_000
SLOW_S = 3.0
encoded_lengths: list[int] = []  # lengths of the texts the app's tokenizer encoded (module-level: survives copies)
slow_started = threading.Event()


class SlowTokenizer:
    """The real tokenizer, except that a text over SLOW_CHARS characters takes SLOW_S seconds more to encode (as a
    huge prompt does on a slow tokenizer; sleeping releases the GIL as the Rust tokenizer does)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name == "_inner":
            raise AttributeError(name)  # during copy.deepcopy, before __dict__ is restored
        return getattr(self._inner, name)

    def encode(self, text, *args, **kwargs):
        encoded_lengths.append(len(text))
        if len(text) > SLOW_CHARS:
            slow_started.set()
            time.sleep(SLOW_S)
        return self._inner.encode(text, *args, **kwargs)


@pytest.fixture(scope="module")
def server(test_model_dir):
    parts = build(run_config(str(test_model_dir("llama")), engine=EngineConfig(max_sequences=4)), model_name="m",
                  manage_engine=False)
    parts.engine.tokenizer = SlowTokenizer(parts.engine.tokenizer)  # what the app tokenizes prompts with
    app = create_app(parts.engine, model_name="m", manage_engine=True)
    with ServerThread(app) as srv:
        srv.engine = parts.engine
        yield srv


BAD = "\\ud800"  # a lone high surrogate, as a JSON escape
BODIES = {
    "/v1/completions": {"model": "m", "prompt": f"hi {BAD} there", "max_tokens": 2},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": f"hi {BAD}"}], "max_tokens": 2},
    "/v1/chat/completions#stop": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "stop": [f"x{BAD}"], "max_tokens": 2},
    "/v1/chat/completions#low": {"model": "m", "messages": [{"role": "user", "content": "a\\udc00b"}], "max_tokens": 2},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": f"x{BAD}"}]},
    "/v1/messages#system": {"model": "m", "max_tokens": 2, "system": f"be {BAD}",
                            "messages": [{"role": "user", "content": "x"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user",
                                                              "content": [{"type": "text", "text": f"x{BAD}"}]}]},
}


def raw_json(body: dict) -> bytes:
    """``body`` as JSON whose strings keep our escapes verbatim (json.dumps would double the backslash)."""
    return json.dumps(body).replace("\\\\u", "\\u").encode()


@pytest.mark.parametrize("route", list(BODIES))
def test_invalid_unicode_is_a_400_on_every_route_and_the_connection_lives(server, route):
    path = route.split("#")[0]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().read() and conn.sock is not None
    sock = conn.sock
    body = raw_json(BODIES[route])
    assert b"\\ud800" in body or b"\\udc00" in body
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    assert resp.status == 400, payload
    error = payload["error"]
    assert "invalid Unicode" in error["message"]
    if not path.startswith("/v1/messages"):
        assert error["code"] == "invalid_unicode" and error["param"]
    else:
        assert payload["type"] == "error" and error["type"] == "invalid_request_error"
    conn.request("GET", "/v1/models")  # the same keep-alive connection still serves
    assert conn.getresponse().status == 200 and conn.sock is sock
    conn.close()


def test_a_valid_surrogate_pair_is_accepted(server):
    body = raw_json({"model": "m", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2})  # an emoji, escaped
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(server, route):
    huge = "word " * 780_000  # 3.9 MB: under the body limit, far over a 4096-token context
    body = {"model": "m", "prompt": huge} if route == "/v1/completions" else {
        "model": "m", "messages": [{"role": "user", "content": huge}]}
    body["max_tokens"] = 2
    encoded_lengths.clear()
    t0 = time.perf_counter()
    r = httpx.post(server.url + route, json=body, timeout=60)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    assert "characters" in r.text and "4096-token context" in r.text
    assert not any(n > SLOW_CHARS for n in encoded_lengths)  # never tokenized
    assert elapsed < SLOW_S


def test_a_short_prompt_is_not_held_up_by_a_long_one(server):
    slow_started.clear()
    long_prompt = "word " * (SLOW_CHARS // 5 + 1)  # under the character limit: tokenized (slowly), then too long
    result = {}

    def send_long():
        result["long"] = httpx.post(server.url + "/v1/completions", timeout=60,
                                    json={"model": "m", "prompt": long_prompt, "max_tokens": 1})

    thread = threading.Thread(target=send_long)
    thread.start()
    assert slow_started.wait(30), "the long prompt never reached the tokenizer"
    t0 = time.perf_counter()
    short = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 1},
                       timeout=60)
    elapsed = time.perf_counter() - t0
    still_tokenizing = thread.is_alive()
    thread.join()
    assert short.status_code == 200, short.text
    assert still_tokenizing and elapsed < SLOW_S / 2, elapsed  # answered while the long one was still tokenizing
    long = result["long"]
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens" in long.json()["error"]["message"]  # refused by its token count, after tokenizing


def test_retention_priority_above_the_server_cap_is_refused(server):
    import openai

    app = create_app(server.engine, model_name="m", max_client_priority=50)  # the same running engine
    with ServerThread(app) as capped:
        client = openai.OpenAI(base_url=capped.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hi"}]
        for retention, field in (({"token_ranges": [{"start": 0, "end": 4, "priority": 100}]},
                                  "retention.token_ranges.0.priority"),
                                 ({"decode_priority": 51}, "retention.decode_priority")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="m", messages=msgs, max_tokens=1, extra_body={"retention": retention})
            body = err.value.body
            assert body["code"] == "priority_above_cap" and body["param"] == field and "cap of 50" in body["message"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", prompt="hi", max_tokens=1,
                                      extra_body={"retention": {"decode_priority": 90}})
        ok = client.chat.completions.create(model="m", messages=msgs, max_tokens=1, extra_body={
            "retention": {"token_ranges": [{"start": 0, "end": 4, "priority": 50}]}})  # at the cap: fine
        assert ok.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="max_client_priority"):
        create_app(server.engine, model_name="m", max_client_priority=101)
