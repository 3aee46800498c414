"""The HTTP server on loopback: the official openai client, concurrency, disconnects, errors, auth, metrics."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from testkit.serve_thread import openai_client
from testkit.waiting import wait_for

pytestmark = pytest.mark.server

QUESTIONS = ["What is a tuple?", "Explain the import statement.", "How do generators work?",
             "What does the with statement do?"]


@pytest.fixture(scope="module")
def server(served):
    return served()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def stats(server):
    return httpx.get(server.url + "/v1/cache/stats").json()


def direct_text(parts, question, max_tokens):
    loaded = parts.loaded
    prompt = list(loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                       add_generation_prompt=True))
    chunks = list(DirectEngine(loaded.model, loaded.tokenizer).generate(prompt, SamplingParams(max_tokens=max_tokens)))
    return "".join(c.text for c in chunks), len(chunks), len(prompt)


def test_openai_client_chat_completion_and_streaming(server, client):
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                          max_tokens=10, temperature=0)
    text, n_tokens, n_prompt = direct_text(server.parts, QUESTIONS[0], 10)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (n_prompt, n_tokens)

    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens

    completion = client.completions.create(model="tiny-llama", prompt="The import statement", max_tokens=6,
                                           temperature=0)
    streamed = list(client.completions.create(model="tiny-llama", prompt="The import statement", max_tokens=6,
                                              temperature=0, stream=True))
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"

    two = client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == two.choices[1].text
    assert two.usage.completion_tokens == 8


def test_concurrent_greedy_requests_equal_sequential_direct_engine(server, client):
    before = stats(server)["batched_steps_total"]

    def ask(q):
        r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": q}],
                                           max_tokens=24, temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, QUESTIONS))
    expected = [direct_text(server.parts, q, 24)[:2] for q in QUESTIONS]
    assert got == expected
    assert stats(server)["batched_steps_total"] > before  # they really were decoded together


def test_disconnect_mid_stream_releases_the_sequence(server):
    cancelled = stats(server)["cancelled_total"]
    # greedy from this prompt runs > 1000 tokens before EOS
    body = {"messages": [{"role": "user", "content": "The import statement"}], "max_tokens": 4096,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            assert stats(server)["running"] == 1
    wait_for(lambda: stats(server)["cancelled_total"] == cancelled + 1)
    wait_for(lambda: stats(server)["pool_sequences"] == 0)
    s = stats(server)
    assert s["running"] == 0 and s["kv_bytes"] == 0
    # a non-streaming client that gives up is noticed too
    body.pop("stream")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: stats(server)["cancelled_total"] == cancelled + 2)
    wait_for(lambda: stats(server)["pool_sequences"] == 0)


def test_bad_requests_get_openai_shaped_4xx(server):
    url = server.url + "/v1"
    cases = [
        ("/chat/completions", b"{not json", 400),
        ("/chat/completions", {"messages": []}, 400),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
        ("/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("/completions", {"prompt": "x", "n": 0}, 400),
        ("/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400),
        ("/completions", {"prompt": "x", "cache_salt": ""}, 400),
        ("/completions", {"prompt": "x", "retention": {"token_ranges": [{"start": 0, "end": 8, "priority": 80},
                                                                         {"start": 4, "priority": 10}]}}, 400),
        ("/completions", {"prompt": "x", "retention": {"decode_priority": 101}}, 400),
        ("/completions", {"prompt": [5, 4096]}, 400),
        ("/completions", {"prompt": [i % 1000 + 10 for i in range(4200)]}, 400),
        ("/nope", {}, 404),
    ]
    for path, body, status in cases:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = httpx.post(url + path, **kwargs)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] and "code" in error, r.text
    too_long = httpx.post(url + "/completions", json={"prompt": [i % 1000 + 10 for i in range(4200)]}).json()["error"]
    assert too_long["code"] == "context_length_exceeded" and "4096" in too_long["message"]
    huge = httpx.post(url + "/completions", json={"prompt": "x" * (5 * 1024 * 1024)})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    accepted = httpx.post(url + "/completions", json={
        "prompt": "x", "max_tokens": 2, "cache_salt": "tenant-a", "priority": 3,
        "retention": {"token_ranges": [{"start": 0, "end": 4, "priority": 90, "duration": 30}], "decode_priority": 20}})
    assert accepted.status_code == 200, accepted.text


def test_metrics_openapi_models_health_and_cache_routes(server, client):
    def families():
        text = httpx.get(server.url + "/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(fams, name, suffix=""):
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    before = families()
    r = client.completions.create(model="tiny-llama", prompt="The with statement", max_tokens=7)
    after = families()
    assert value(after, "mlxkv_generation_tokens", "_total") - value(before, "mlxkv_generation_tokens", "_total") == 7
    assert value(after, "mlxkv_time_to_first_token_seconds", "_count") > \
        value(before, "mlxkv_time_to_first_token_seconds", "_count")
    assert r.usage.completion_tokens == 7
    for name in ("mlxkv_queue_depth", "mlxkv_running_sequences", "mlxkv_kv_blocks_used", "mlxkv_kv_blocks_free",
                 "mlxkv_kv_blocks_cached", "mlxkv_prefix_cache_queries", "mlxkv_prefix_cache_hits",
                 "mlxkv_kv_evictions", "mlxkv_preemptions", "mlxkv_time_per_output_token_seconds"):
        assert name in after, name
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/cache/stats"} <= set(spec["paths"])
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    reset = httpx.post(server.url + "/v1/cache/reset").json()
    assert reset["reset"] is True and "mlx_cache_bytes_freed" in reset


def test_queue_full_answers_429(served):
    srv = served(max_sequences=1, max_queue_depth=1)
    url = srv.url + "/v1/completions"
    with httpx.Client(timeout=60) as http:
        long_body = {"prompt": "The import statement", "max_tokens": 4096, "temperature": 0, "stream": True}
        with http.stream("POST", url, json=long_body) as long:  # greedy: no EOS for > 2000 tokens
            lines = long.iter_lines()  # keep it: dropping the iterator closes the connection
            next(lines)  # decoding: the one slot is taken
            waiting = threading.Thread(target=lambda: httpx.post(url, json={"prompt": "y", "max_tokens": 2},
                                                                 timeout=60))
            waiting.start()
            wait_for(lambda: httpx.get(srv.url + "/v1/cache/stats").json()["waiting"] == 1)
            r = httpx.post(url, json={"prompt": "z", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    waiting.join(60)
    wait_for(lambda: httpx.get(srv.url + "/v1/cache/stats").json()["pool_sequences"] == 0)


def test_api_key_required_on_v1_routes(served):
    srv = served(max_sequences=2, api_key="s3cret")
    body = {"prompt": "x", "max_tokens": 2}
    missing = httpx.post(srv.url + "/v1/completions", json=body)
    wrong = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
    assert ok.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_sse_lines_are_json_and_end_with_done(server):
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        json.loads(line.removeprefix("data: "))


def test_a_field_the_server_does_not_implement_is_refused_not_ignored(server):
    """Fields outside a route's spec are refused by name (chat's own spec: test_server_request_spec.py)."""
    base = {"model": "tiny-llama", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 2}
    for route, body, refused in (
            ("/v1/chat/completions", base, ({"reasoning": {"effort": "high"}}, {"input": "x"}, {"best_of": 2})),
            ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 2},
             ({"reasoning_effort": "high"}, {"store": True}, {"service_tier": "flex"}))):
        for extra in refused:
            r = httpx.post(server.url + route, json={**body, **extra}, timeout=30)
            assert r.status_code == 400, (route, extra, r.text)
            assert next(iter(extra)) in r.json()["error"]["message"] + str(r.json()["error"].get("param")), r.text
        ok = httpx.post(server.url + route, json={**body, "user": "someone"}, timeout=30)
        assert ok.status_code == 200, ok.text
