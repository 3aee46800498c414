"""Every field of OpenAI's chat-completions and completions references, sent through the official openai client to
a real server on loopback (the test llama): each is answered 200 or with the 400 docs/api.md documents, naming the
field. The tables are checked against the installed SDK's own parameter types, so a field the SDK adds and this
server has not decided on fails here. Local meanings: ``reasoning_effort`` (the template's thinking switch),
``prompt_cache_key`` (sharing narrowed within the tenant), ``max_completion_tokens`` (``max_tokens``' alias),
``prediction`` (usage reports nothing accepted)."""

from __future__ import annotations

import typing
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from testkit.models import write_test_model
from testkit.run_config import run_config
from testkit.serve_thread import openai_client, serve_in_thread
from testkit.tokenizer import write_thinking_tokenizer

from mlxkv.engine.batch import EngineConfig

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
ENGINE = {"max_sequences": 2, "max_queue_depth": 8}  # as test_server_tools.py: the same shared server
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

#: Chat fields -> (the value sent, None for a 200 or the param the documented 400 names).
CHAT = {
    "messages": (ASK, None), "model": ("tiny-llama", None),
    "audio": ({"voice": "alloy", "format": "wav"}, "audio"),
    "frequency_penalty": (0.5, None), "presence_penalty": (0.5, None),
    "function_call": ("auto", "function_call"), "functions": ([WEATHER["function"]], "functions"),  # deprecated
    "logit_bias": ({"5": 1}, None), "logprobs": (True, None), "top_logprobs": (2, None),
    "max_completion_tokens": (3, None), "max_tokens": (3, None),
    "metadata": ({"run": "spec-test"}, None),
    "modalities": (["text"], None),
    "moderation": ({"model": "omni-moderation-latest"}, "moderation"),
    "n": (2, None), "parallel_tool_calls": (False, None),
    "prediction": ({"type": "content", "content": "It is sunny."}, None),
    "prompt_cache_key": ("conversation-1", None),
    "prompt_cache_options": ({"mode": "implicit", "ttl": "30m"}, None),
    "prompt_cache_retention": ("24h", None),
    "reasoning_effort": ("minimal", None),  # the test llama does not reason: none and minimal are what it does
    "response_format": ({"type": "json_object"}, None),
    "safety_identifier": ("user-hash-1", None), "seed": (7, None), "service_tier": ("auto", None),
    "stop": (["\n\n"], None), "store": (True, None), "stream": (False, None),
    "stream_options": ({"include_usage": True, "include_obfuscation": False}, None),
    "temperature": (0.0, None), "tool_choice": ("auto", None), "tools": ([WEATHER], None), "top_p": (0.9, None),
    "user": ("user-1", None), "verbosity": ("low", None),
    "web_search_options": ({"search_context_size": "low"}, "web_search_options"),
}

#: What a field needs sent with it.
WITH = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": [WEATHER]}, "stream_options": {"stream": True}}

COMPLETION = {
    "model": ("tiny-llama", None), "prompt": ("Once upon a time", None),
    "best_of": (1, None), "echo": (False, None), "frequency_penalty": (0.5, None), "logit_bias": ({"5": 1}, None),
    "logprobs": (2, None), "max_tokens": (3, None), "n": (1, None), "presence_penalty": (0.5, None),
    "seed": (7, None), "stop": ("\n", None), "stream_options": ({"include_usage": True}, None),
    "suffix": ("", None), "temperature": (0.0, None), "top_p": (0.9, None), "user": ("user-1", None),
    "stream": (False, None),
}


@pytest.fixture(scope="module")
def server(served):
    return served(**ENGINE, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def sdk_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase, include_extras=False))


def test_the_tables_cover_every_field_of_the_installed_sdk():
    assert set(CHAT) | {"stream"} == sdk_fields(chat_create_params) | {"stream"}
    assert set(COMPLETION) | {"stream"} == sdk_fields(completion_create_params) | {"stream"}


def _send(create, base: dict, field: str, value, refused: str | None):
    """``create`` with ``base`` and ``field``: the answer, or the 400's error body."""
    kwargs = {**base, **WITH.get(field, {}), field: value}
    if refused:
        with pytest.raises(openai.BadRequestError) as info:
            create(**kwargs)
        assert info.value.body["param"] == refused, info.value.body
        return info.value.body
    out = create(**kwargs)
    return list(out) if kwargs.get("stream") else out


def test_every_chat_field_is_answered_as_documented(client):
    base = {"model": "tiny-llama", "messages": ASK, "max_tokens": 3, "temperature": 0}
    for field, (value, refused) in CHAT.items():
        if field in ("messages", "model"):
            continue
        base_here = {k: v for k, v in base.items() if k != "max_tokens"} if field == "max_completion_tokens" else base
        out = _send(client.chat.completions.create, base_here, field, value, refused)
        if field == "prediction":
            assert out.usage.completion_tokens_details.accepted_prediction_tokens == 0
        if field == "max_completion_tokens":
            assert out.usage.completion_tokens == 3


def test_every_completions_field_is_answered_as_documented(client):
    base = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    for field, (value, refused) in COMPLETION.items():
        if field not in ("model", "prompt"):
            _send(client.completions.create, base, field, value, refused)


@pytest.mark.parametrize("body, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options.mode"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"service_tier": "platinum"}, "service_tier"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),  # the test llama does not reason: nothing to turn on
    ({"stream_options": {"include_usage": True, "padding": 1}, "stream": True}, "stream_options.padding"),
    ({"not_a_field": 1}, "not_a_field"),
])
def test_refusals_name_the_field(client, body, param):
    kwargs = {"model": "tiny-llama", "messages": ASK, "max_completion_tokens": 3, **body}
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k == "not_a_field"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs, extra_body=extra or None)
    assert info.value.body["param"] == param, info.value.body


@pytest.mark.parametrize("body, param", [
    ({"echo": True}, "echo"), ({"suffix": "The end."}, "suffix"), ({"best_of": 3}, "best_of"),
])
def test_completions_refusals_name_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt="Once", max_tokens=2, **body)
    assert info.value.body["param"] == param, info.value.body


def test_max_completion_tokens_and_max_tokens_agreeing_are_one_limit(client):
    r = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=4, max_completion_tokens=4,
                                       temperature=0)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


# ---- prompt_cache_key: sharing narrowed within the tenant ------------------------------------------------------


@pytest.fixture(scope="module")
def own_server(llama_dir):
    """A server of its own: the test reads what its cache shares."""
    with serve_in_thread(run_config(llama_dir, engine=EngineConfig(max_sequences=2), kv_backend="paged")) as srv:
        yield srv


LONG = [{"role": "user", "content": "Tell me about caching. " * 12}]


def cached(client, **extra) -> int:
    r = client.chat.completions.create(model="m", messages=LONG, max_tokens=1, temperature=0, **extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_prompt_cache_key_shares_only_within_the_same_key_and_tenant(own_server):
    client = openai_client(own_server.url)
    assert cached(client, prompt_cache_key="a") == 0
    assert cached(client, prompt_cache_key="a") > 0  # the same key shares
    assert cached(client, prompt_cache_key="b") == 0  # another key does not
    assert cached(client) == 0  # nor does a request without one
    tenant = {"cache_salt": "tenant-2"}
    assert cached(client, prompt_cache_key="a", extra_body=tenant) == 0  # nor another tenant with the same key
    assert cached(client, prompt_cache_key="a", extra_body=tenant) > 0
    # the keyed blocks are still the tenant's: its reset drops them
    assert httpx.post(own_server.url + "/v1/cache/reset", json=tenant, timeout=30).json()["scope"] == "tenant"
    assert cached(client, prompt_cache_key="a", extra_body=tenant) == 0
    assert cached(client, prompt_cache_key="a") > 0  # another tenant's keep theirs


# ---- reasoning_effort: the template's thinking switch ----------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The test llama with a thinking tokenizer: a template with an ``enable_thinking`` switch."""
    folder = write_test_model("llama", tmp_path_factory.mktemp("effort"))
    write_thinking_tokenizer(folder)
    with serve_in_thread(run_config(str(folder), engine=EngineConfig(max_sequences=2), kv_backend="paged")) as srv:
        yield openai_client(srv.url), srv.parts.loaded.tokenizer


def prompt_tokens(client, **extra) -> int:
    return client.chat.completions.create(model="t", messages=ASK, max_tokens=1, **extra).usage.prompt_tokens


def test_reasoning_effort_switches_the_templates_thinking(thinking):
    client, tokenizer = thinking
    off = len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False))
    on = len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=True))
    assert off != on
    for effort in ("none", "minimal"):
        assert prompt_tokens(client, reasoning_effort=effort) == off
    for effort in ("low", "high", "max"):
        assert prompt_tokens(client, reasoning_effort=effort) == on
    agreeing = {"chat_template_kwargs": {"enable_thinking": False}}
    assert prompt_tokens(client, reasoning_effort="none", extra_body=agreeing) == off
    with pytest.raises(openai.BadRequestError) as info:
        prompt_tokens(client, reasoning_effort="high", extra_body=agreeing)
    assert info.value.body["param"] == "reasoning_effort" and "enable_thinking" in info.value.body["message"]


def test_a_template_reading_reasoning_effort_gets_the_level(served, tmp_path_factory):
    """gpt-oss style: the template itself reads ``reasoning_effort`` (here it writes it into the system turn)."""
    from testkit.tokenizer import CHAT_TEMPLATE

    path = tmp_path_factory.mktemp("effort-template") / "effort.jinja"
    path.write_text("{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}" + CHAT_TEMPLATE,
                    encoding="utf-8")
    server = served(**ENGINE, chat_template=str(path))
    client = openai_client(server.url)
    tokenizer = server.parts.loaded.tokenizer
    for effort in ("none", "high"):
        expected = len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, reasoning_effort=effort))
        assert prompt_tokens(client, reasoning_effort=effort) == expected
    assert prompt_tokens(client) == len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True))
