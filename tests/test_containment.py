"""No request can fail another: bad requests beside good greedy ones on one server.

The fuzz set is every numeric field of the three generating routes' schemas just past its bounds and at
extremes of the wrong type, plus the size-like fields whose bound is the model's (context, vocabulary): each is
a 4xx, and the good requests decoding meanwhile give exactly what they give alone. A request whose sampling fails
in the middle of a shared decode batch (a fault injected into its sampler) ends alone: the others finish.
"""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest

from mlxkv.engine.batch import EngineConfig
from mlxkv.engine.row_sampler import RowSampler
from mlxkv.server.anthropic.schemas import MessagesRequest
from mlxkv.server.schemas import ChatCompletionRequest, CompletionRequest
from testkit.run_config import run_config
from testkit.serve_thread import serve_in_thread

pytestmark = pytest.mark.server

ROUTES = {"/v1/completions": ({"model": "m", "prompt": "The import statement", "max_tokens": 4}, CompletionRequest),
          "/v1/chat/completions": ({"model": "m", "messages": [{"role": "user", "content": "What is a list?"}],
                                    "max_tokens": 4}, ChatCompletionRequest),
          "/v1/messages": ({"model": "m", "messages": [{"role": "user", "content": "What is a dict?"}],
                            "max_tokens": 4}, MessagesRequest)}
GOOD = [("/v1/completions", {"model": "m", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Name a color."}],
                                  "max_tokens": 24, "temperature": 0}),
        ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "Count to five."}],
                          "max_tokens": 24, "temperature": 0})]
WRONG_TYPES = ["x", {}]


@pytest.fixture(scope="module")
def srv(llama_dir):
    config = run_config(llama_dir, engine=EngineConfig(max_sequences=4, max_queue_depth=64), kv_backend="paged")
    with serve_in_thread(config, model_name="m") as s:
        yield s


def numeric_fields(schema: dict) -> dict[str, dict]:
    """Top-level integer and number properties of a JSON schema, with their bounds."""
    out = {}
    for name, prop in schema["properties"].items():
        for option in prop.get("anyOf", [prop]):
            if option.get("type") in ("integer", "number"):
                out[name] = option
    return out


def bad_values(prop: dict) -> list:
    """Values just past ``prop``'s bounds, and of the wrong type."""
    values = list(WRONG_TYPES)
    if prop["type"] == "integer":
        values += [1.5, 2**64, -1e308]
    else:
        values += [v for v, bound in ((1e308, "maximum"), (-1e308, "minimum")) if bound in prop
                   or f"exclusiveM{bound[1:]}" in prop]
    for key, step in (("minimum", -1), ("exclusiveMinimum", 0), ("maximum", 1), ("exclusiveMaximum", 0)):
        if key in prop:
            edge = prop[key] + (step if prop["type"] == "integer" else step * 1e-6)
            values.append(edge)
    return [v for v in values if not (isinstance(v, float) and math.isnan(v))]


def schema_cases() -> list[tuple[str, dict]]:
    cases = []
    for path, (base, model) in ROUTES.items():
        for name, prop in numeric_fields(model.model_json_schema()).items():
            for value in bad_values(prop):
                if (path, name) == ("/v1/messages", "max_tokens") and isinstance(value, (int, float)) and value > 0:
                    continue  # Anthropic's API runs any max_tokens to the end of the context (admission.py)
                cases.append((path, {**base, name: value}))
    return cases


def model_cases(srv) -> list[tuple[str, dict]]:
    """Fields whose bound is this model's: its context and vocabulary."""
    engine = srv.parts.engine
    ctx = engine.context_length
    vocab = engine.vocab_size
    c, h, a = (ROUTES[p][0] for p in ROUTES)
    return [
        ("/v1/completions", {**c, "top_k": vocab + 1}),
        ("/v1/messages", {**a, "top_k": vocab + 1}),
        ("/v1/completions", {**c, "seed": 2**63, "temperature": 0.5}),
        ("/v1/chat/completions", {**h, "seed": -(2**63) - 1, "temperature": 0.5}),
        ("/v1/completions", {**c, "stop": ["s" * 1025]}),
        ("/v1/messages", {**a, "stop_sequences": ["s" * 1025]}),
        ("/v1/completions", {**c, "presence_context_size": ctx + 1}),
        ("/v1/completions", {**c, "repetition_context_size": 2**40}),
        ("/v1/completions", {**c, "logit_bias": {str(vocab): 1}}),
        ("/v1/completions", {**c, "logit_bias": {"9" * 5000: 1}}),
        ("/v1/completions", {**c, "prompt": [vocab]}),
        ("/v1/completions", {**c, "prompt": [False]}),
        ("/v1/completions", {**c, "retention": {"token_ranges": [{"start": ctx, "priority": 5}]}}),
        ("/v1/messages", {**a, "retention": {"token_ranges": [{"start": 0, "end": ctx + 1, "priority": 5}]}}),
        ("/v1/chat/completions", {**h, "cache_salt_ranges": [{"start": 0, "end": 10**30, "salt": "x"}]}),
        ("/v1/completions", {**c, "kv_overflow": {"policy": "h2o", "budget": ctx + 1}}),
        ("/v1/chat/completions", {**h, "n": 17}),
        ("/v1/chat/completions", {**h, "logprobs": True, "top_logprobs": 21}),
        ("/v1/chat/completions", {**h, "messages": [{"role": "user", "content": "x"}] * 20_000}),
        ("/v1/messages", {**a, "max_tokens": 0}),
        ("/v1/completions", {**c, "stop": ["a"] * 17}),
        ("/v1/chat/completions", {**h, "cache_salt": "s" * 257}),
    ]


def post(srv, path: str, body: dict, client: httpx.Client | None = None) -> httpx.Response:
    return (client or httpx).post(srv.url + path, content=json.dumps(body), timeout=120,
                                  headers={"content-type": "application/json"})


def good_text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    data = r.json()
    if "content" in data:
        return "".join(b.get("text", "") for b in data["content"])
    choice = data["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]


@pytest.mark.slow
def test_bad_requests_beside_good_ones_are_4xx_and_change_nothing(srv):
    alone = [good_text(post(srv, path, body)) for path, body in GOOD]
    bad = schema_cases() + model_cases(srv)
    assert len(bad) > 150, len(bad)
    statuses: list[tuple[int, str, dict]] = []
    outputs: list[list[str]] = []
    done = threading.Event()

    def fuzz() -> None:
        try:
            with httpx.Client() as client:
                for path, body in bad:
                    r = post(srv, path, body, client)
                    statuses.append((r.status_code, path, {k: str(v)[:40] for k, v in body.items()}))
        finally:
            done.set()

    def good() -> None:
        while not done.is_set():
            outputs.append([good_text(post(srv, path, body)) for path, body in GOOD])

    workers = [threading.Thread(target=fuzz), threading.Thread(target=good)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    wrong = [s for s in statuses if not 400 <= s[0] < 500]
    assert not wrong, "\n".join(map(str, wrong))
    assert len(statuses) == len(bad) and outputs
    assert all(out == alone for out in outputs), (alone, outputs)


def test_a_row_whose_sampling_fails_mid_batch_ends_alone(srv, monkeypatch):
    """A fault in one request's sampler at its third decode step (a penalty marks it) fails that request only."""
    alone = [good_text(post(srv, path, body)) for path, body in GOOD]
    original = RowSampler.for_choice.__func__

    def for_choice(cls, request, index):
        sampler = original(cls, request, index)
        if request.params.presence_penalty == 1.25:
            calls = []

            def fault(tokens, logits):
                calls.append(1)
                if len(calls) >= 3:
                    raise RuntimeError("an injected sampling fault")
                return logits

            sampler.add_processor(fault)
        return sampler

    monkeypatch.setattr(RowSampler, "for_choice", classmethod(for_choice))
    faulty = {"model": "m", "prompt": "A faulty request", "max_tokens": 40, "temperature": 0,
              "presence_penalty": 1.25}
    results: dict[str, object] = {}

    def run(name, path, body):
        results[name] = post(srv, path, body)

    threads = [threading.Thread(target=run, args=(f"good{i}", p, b)) for i, (p, b) in enumerate(GOOD)]
    threads.append(threading.Thread(target=run, args=("faulty", "/v1/completions", faulty)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    r = results["faulty"]
    assert r.status_code == 500 and "injected sampling fault" in r.json()["error"]["message"]
    assert [good_text(results[f"good{i}"]) for i in range(len(GOOD))] == alone
