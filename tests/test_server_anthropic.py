"""The Anthropic Messages API on a real server on loopback, driven by the official ``anthropic`` client.

The tiny test llama (random weights) covers the mechanics: the same conversation gives the same greedy text as
``/v1/chat/completions``, streaming events in Anthropic's order, stop reasons, token counts, the prefix cache's
share of usage, errors as the client's exception classes, auth by ``x-api-key``, disconnects. One test at the end
runs SmolLM2-135M-Instruct (``MLXKV_TEST_GGUF``). The current client has no ``temperature`` argument (the API's
newest models take none); it goes in ``extra_body`` as any client sends it.
"""

from __future__ import annotations

import json
import random
import shutil
import threading

import anthropic
import httpx
import openai
import pytest
from testkit.real_model import GGUF

from mlxkv.engine.batch import EngineConfig
from mlxkv.engine.request import Event
from mlxkv.server.anthropic.message import Reply
from mlxkv.server.anthropic.schemas import CountTokensRequest
from mlxkv.server.anthropic.translate import to_conversation
from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread
from testkit.waiting import wait_for

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0}
QUESTION = "What does the with statement do?"


@pytest.fixture(scope="module")
def server(served):
    return served()


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server.url)


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server.url)


def stats(server):
    return httpx.get(server.url + "/v1/cache/stats").json()


def chat(oai, messages, max_tokens):
    r = oai.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_create_answers_the_chat_completions_greedy_text(client, oai):
    history = [{"role": "user", "content": "What is a tuple?"}, {"role": "assistant", "content": "A sequence."},
               {"role": "user", "content": QUESTION}]
    m = client.messages.create(model="tiny-llama", max_tokens=16, system="Answer briefly.", messages=history,
                               extra_body=GREEDY)
    text, usage = chat(oai, [{"role": "system", "content": "Answer briefly."}, *history], 16)
    assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", "tiny-llama")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert m.usage.output_tokens == usage.completion_tokens == 16
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert m.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model="tiny-llama", system="Answer briefly.", messages=history)
    assert counted.input_tokens == usage.prompt_tokens


def test_system_blocks_and_content_blocks_render_as_their_joined_text(client):
    blocks = [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly.", "cache_control":
                                                    {"type": "ephemeral"}}]
    user = [{"type": "text", "text": "What does "}, {"type": "text", "text": "the with statement do?"}]
    a = client.messages.create(model="m", max_tokens=10, system=blocks, messages=[{"role": "user", "content": user}],
                               extra_body=GREEDY)
    b = client.messages.create(model="m", max_tokens=10, system="Answer briefly.",
                               messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    assert a.content[0].text == b.content[0].text
    count = [client.messages.count_tokens(model="m", system=s, messages=[{"role": "user", "content": u}]).input_tokens
             for s, u in ((blocks, user), ("Answer briefly.", QUESTION), (None, QUESTION))]
    assert count[0] == count[1] > count[2]


def test_consecutive_turns_of_one_role_are_one_turn(client, oai):
    m = client.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=[
        {"role": "user", "content": "What is a tuple?"}, {"role": "user", "content": QUESTION}])
    assert m.content[0].text == chat(oai, [{"role": "user", "content": f"What is a tuple?\n\n{QUESTION}"}], 8)[0]


def test_stream_sends_anthropic_s_events_and_the_same_text(server, client):
    whole = client.messages.create(model="m", max_tokens=12, messages=[{"role": "user", "content": QUESTION}],
                                   extra_body=GREEDY)
    with client.messages.stream(model="m", max_tokens=12, messages=[{"role": "user", "content": QUESTION}],
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 12)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens

    body = {"model": "m", "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": QUESTION}],
            **GREEDY}  # greedy: 12 tokens without an end of turn, as above
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [p["type"] for p in payloads] == names
    deltas = names.count("content_block_delta")
    assert names == ["ping", "message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1
    assert payloads[1]["message"]["content"] == [] and payloads[1]["message"]["stop_reason"] is None
    assert payloads[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert payloads[-2]["usage"]["output_tokens"] == 6


def test_stop_sequences_end_the_answer_and_are_named(client):
    full = client.messages.create(model="m", max_tokens=32, messages=[{"role": "user", "content": QUESTION}],
                                  extra_body=GREEDY).content[0].text
    cut = next(i for i in range(4, len(full) - 3) if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i)
    stop = full[cut:cut + 3]
    kwargs = dict(model="m", max_tokens=32, messages=[{"role": "user", "content": QUESTION}],
                  stop_sequences=["never-in-the-output", stop], extra_body=GREEDY)
    m = client.messages.create(**kwargs)
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (full[:cut], "stop_sequence", stop)
    assert m.usage.output_tokens < 32
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (full[:cut], "stop_sequence", stop)


def test_a_final_assistant_turn_is_continued(server, client):
    tokenizer = server.parts.loaded.tokenizer
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It opens"}]
    m = client.messages.create(model="m", max_tokens=10, messages=messages, extra_body=GREEDY)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("<|assistant|>\nIt opens")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 10, "temperature": 0}).json()
    assert m.content[0].text == r["choices"][0]["text"]
    assert client.messages.count_tokens(model="m", messages=messages).input_tokens == len(ids)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model="m", max_tokens=4, messages=[messages[0], {"role": "assistant",
                                                                              "content": "It opens "}])


def test_the_second_request_on_a_long_system_prompt_reads_it_from_the_prefix_cache(client):
    words = random.Random(7).choices(["module", "scope", "binding", "frame", "iterator", "context"], k=600)
    system = "You answer questions about Python. " + " ".join(words)
    prompt_tokens = client.messages.count_tokens(model="m", system=system,
                                                 messages=[{"role": "user", "content": "x"}]).input_tokens
    assert prompt_tokens > 400
    first = client.messages.create(model="m", max_tokens=2, system=system,
                                   messages=[{"role": "user", "content": "What is a tuple?"}])
    second = client.messages.create(model="m", max_tokens=2, system=system,
                                    messages=[{"role": "user", "content": QUESTION}])
    assert first.usage.cache_read_input_tokens < 16  # at most the template's opening is shared with others
    assert second.usage.cache_read_input_tokens >= prompt_tokens - 32  # all of the system prompt's full blocks
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model="m", system=system,
                                     messages=[{"role": "user", "content": QUESTION}]).input_tokens


def test_invalid_and_unsupported_requests_are_anthropic_errors(server, client):
    user = [{"role": "user", "content": "x"}]
    refused = [
        (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                                  "media_type": "image/png",
                                                                                  "data": "AAAA"}}]}]), "image"),
        (dict(messages=user, tools=[{"name": "ls", "description": "list", "input_schema": {"type": "object"}}]),
         "tools"),
        (dict(messages=[*user, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls",
                                                                  "input": {}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                      "content": "a.txt"}]}]), "tool"),
        (dict(messages=user, thinking={"type": "enabled", "budget_tokens": 2048}), "thinking"),
        (dict(messages=user, extra_body={"frequency_penalty": 1}), "frequency_penalty: Extra inputs"),
        (dict(messages=user, extra_body={"temperature": 1.5}), "temperature"),
        (dict(messages=user, stop_sequences=["  "]), "non-whitespace"),
        (dict(messages=[{"role": "user", "content": ""}]), "non-empty content"),
        (dict(messages=[{"role": "assistant", "content": ""}]), "conversation is empty"),
        (dict(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
        (dict(messages=user, max_tokens=0), "max_tokens"),
    ]
    for kwargs, needle in refused:
        kwargs.setdefault("max_tokens", 4)
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="m", **kwargs)
        assert err.value.status_code == 400 and needle in err.value.message, (kwargs, err.value.message)
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        client.messages.count_tokens(model="m", messages=user, tools=[{"name": "ls", "input_schema": {}}])
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "go " * 5000}])
    for method, path, body, status, kind in [
            ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
            ("POST", "/v1/messages/nope", {}, 404, "not_found_error"),
            ("GET", "/v1/messages", None, 405, "invalid_request_error"),
            ("POST", "/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user",
                                                                                   "content": "x" * 5_000_000}]},
             413, "request_too_large")]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
        r = httpx.request(method, server.url + path, headers={"content-type": "application/json"}, **kwargs)
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == kind and r.json()["error"]["message"], r.text
    # the OpenAI routes keep OpenAI's shape
    assert "code" in httpx.post(server.url + "/v1/chat/completions", json={"messages": []}).json()["error"]


def test_x_api_key_and_bearer_both_authenticate(served):
    srv = served(max_sequences=2, api_key="s3cret")
    ok = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)
    assert ok.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]) \
        .usage.output_tokens == 2
    for bad in (anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0),
                anthropic.Anthropic(base_url=srv.url, auth_token="nope", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])
        assert err.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=srv.url, auth_token="s3cret", max_retries=0)
    assert bearer.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}]).input_tokens > 0
    # x-api-key opens the OpenAI routes too; no key at all is refused in each API's shape
    assert httpx.get(srv.url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    missing = httpx.post(srv.url + "/v1/messages", json={})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(srv.url + "/v1/models").json()["error"]["code"] == "missing_api_key"
    assert openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0).models.list().data


def test_an_answer_cut_by_the_context_end_says_so(test_model_dir, tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(test_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (model / "config.json").write_text(json.dumps(config))
    with serve_in_thread(run_config(str(model), engine=EngineConfig(max_sequences=1), kv_backend="paged")) as srv:
        client = anthropic_client(srv.url, api_key="x")
        m = client.messages.create(model="m", max_tokens=1000, messages=[{"role": "user", "content": QUESTION}],
                                   extra_body=GREEDY)
        assert m.stop_reason == "model_context_window_exceeded"
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens == 64


def test_a_full_queue_is_a_rate_limit_error(served):
    srv = served(max_sequences=1, max_queue_depth=1)
    client = anthropic_client(srv.url, api_key="x")
    long_body = {"model": "m", "max_tokens": 100000, "stream": True, "temperature": 0,
                 "messages": [{"role": "user", "content": "The import statement"}]}  # greedy: no EOS for long
    with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + "/v1/messages", json=long_body) as long:
        lines = long.iter_lines()  # keep it: dropping the iterator closes the connection
        while next(lines) != "event: content_block_delta":  # decoding: the one slot is taken
            pass
        waiting = threading.Thread(target=lambda: client.messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]))
        waiting.start()
        wait_for(lambda: srv.parts.engine.stats()["waiting"] == 1)
        with pytest.raises(anthropic.RateLimitError) as err:
            client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "y"}])
        assert err.value.body["error"]["type"] == "rate_limit_error" and "queue is full" in err.value.message
    waiting.join(60)
    wait_for(lambda: srv.parts.engine.stats()["pool_sequences"] == 0)


def test_a_client_that_goes_away_cancels_its_request(server):
    cancelled = stats(server)["cancelled_total"]
    body = {"model": "m", "messages": [{"role": "user", "content": "The import statement"}], "max_tokens": 100000,
            "stream": True, **GREEDY}  # greedy: no early end of turn (a sampled one may end within the timeout)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/messages", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(9)]  # ping, message_start, content_block_start
            while next(lines) != "event: content_block_delta":  # keep-alive pings may come first under load
                pass
            assert received[0] == "event: ping" and "event: message_start" in received
    wait_for(lambda: stats(server)["cancelled_total"] == cancelled + 1)
    wait_for(lambda: stats(server)["pool_sequences"] == 0)
    body.pop("stream")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/messages", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: stats(server)["cancelled_total"] == cancelled + 2)
    wait_for(lambda: stats(server)["pool_sequences"] == 0)


def test_the_stop_reason_of_an_end_of_turn_and_of_a_stop_string_at_it(server):
    tokenizer = server.parts.loaded.tokenizer
    eos = next(iter(tokenizer.eos_token_ids))
    ids = tokenizer.encode("Hello world", add_special_tokens=False)

    def reply(stops, emitted):
        r = Reply(tokenizer, model="m", max_tokens=50, stop_sequences=stops, prompt_tokens=3)
        for i, t in enumerate([*ids, eos]):
            r.add(Event("token", token=t, text=emitted if i == 0 else "", finish_reason="stop" if t == eos else None))
        return r.stop()

    assert reply((), "Hello world") == ("end_turn", None)
    assert reply(("zzz",), "Hello world") == ("end_turn", None)
    assert reply(("world", "wor"), "Hello ") == ("stop_sequence", "wor")  # matched in the last text, at the EOS


def test_tool_blocks_translate_to_openai_chat_messages():
    """The chat form the tool blocks take (rendered and answered in test_server_anthropic_tools.py)."""
    body = CountTokensRequest.model_validate({"model": "m", "system": "Use tools.", "messages": [
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": [{"type": "text", "text": "Listing."},
                                          {"type": "tool_use", "id": "t1", "name": "ls", "input": {"dir": "."}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"},
                                     {"type": "text", "text": "And now?"}]}],
        "tools": [{"name": "ls", "description": "list files", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "ls", "disable_parallel_tool_use": True}})
    conv = to_conversation(body)
    assert conv.messages == [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": '{"dir": "."}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a.txt"}, {"role": "user", "content": "And now?"}]
    assert conv.tools == [{"type": "function", "function": {"name": "ls", "description": "list files",
                                                            "parameters": {"type": "object"}}}]
    assert conv.tool_choice == {"type": "function", "function": {"name": "ls"}} and conv.parallel_tool_calls is False
    assert conv.tool_history and not conv.prefill


@pytest.mark.real_model
def test_smollm2_answers_the_messages_api_as_chat_completions():
    config = run_config(str(GGUF), dequantize=True, engine=EngineConfig(max_sequences=2), kv_backend="paged")
    with serve_in_thread(config, model_name="smollm2") as srv:
        client = anthropic_client(srv.url, api_key="x", timeout=600)
        oai = openai_client(srv.url, api_key="x", timeout=600)
        system, question = "You are a concise assistant.", "What is the capital of France?"
        m = client.messages.create(model="smollm2", max_tokens=48, system=system, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": question}])
        text, usage = chat(oai, [{"role": "system", "content": system}, {"role": "user", "content": question}], 48)
        assert m.content[0].text == text and "Paris" in text
        assert m.stop_reason == "end_turn" and m.usage.output_tokens == usage.completion_tokens < 48
        with client.messages.stream(model="smollm2", max_tokens=48, system=system, extra_body=GREEDY,
                                    messages=[{"role": "user", "content": question}]) as stream:
            assert "".join(stream.text_stream) == text
            final = stream.get_final_message()
        assert final.stop_reason == "end_turn" and final.usage.cache_read_input_tokens > 0
        stop = client.messages.create(model="smollm2", max_tokens=48, system=system, extra_body=GREEDY,
                                      messages=[{"role": "user", "content": question}], stop_sequences=["Paris"])
        assert (stop.content[0].text, stop.stop_reason, stop.stop_sequence) == \
            (text[:text.index("Paris")], "stop_sequence", "Paris")
