"""Tool calling with the real SmolLM2-135M-Instruct weights: a real ``mlxkv serve`` process with the tools chat
template (``--chat-template``; SmolLM2's own template ignores tools) and the official openai client.

SmolLM2-135M does not call a tool from the tool list alone (asked about the weather with a get_weather tool, it
answers in prose or writes Python); with two earlier turns in which the assistant answered such questions by a
call, it calls the tool for the next question. So the round trip is: the model's call (parsed into
``message.tool_calls``, streamed as deltas) -> the tool's result -> the model's next answer, which the server
renders the call and the result into (checked against the template rendered here) and answers as greedy
generation in this process does.

Needs ``MLXKV_TEST_GGUF`` (see test_real_model.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.real_model import GGUF
from testkit.serve_process import serve_process

pytestmark = [pytest.mark.real_model, pytest.mark.server]

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def earlier_turn(i: int, city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}]


ASK = earlier_turn(1, "London") + earlier_turn(2, "Berlin") + [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"city": "Paris", "temperature_c": 21, "sky": "sunny"}'


@pytest.fixture(scope="module")
def client():
    with serve_process("-m", str(GGUF), "--dequantize", "--chat-template", TEMPLATE, "--max-sequences", "2",
                       "--log-level", "warning") as c:
        yield c


@pytest.fixture(scope="module")
def ours():
    from mlxkv.models import load

    return load(str(GGUF), dequantize=True, chat_template=TEMPLATE)


def test_smollm2_calls_the_tool_and_the_answer_has_openai_s_shape(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=48, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_call_deltas_rebuild_the_call_and_no_markup_is_content(client):
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=48,
                                                 temperature=0, stream=True))
    assert all("<tool" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0] and deltas[0].id.startswith("call_")
    with client.chat.completions.stream(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=48,
                                        temperature=0) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_round_trip_call_result_answer(client, ours):
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.server.tools import render_tools, to_template_messages

    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=48,
                                           temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=40,
                                       temperature=0)
    prompt = list(ours.tokenizer.apply_chat_template(to_template_messages(messages), tools=render_tools([WEATHER]),
                                                     add_generation_prompt=True))
    text = ours.tokenizer.decode(prompt)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(prompt)
    expected = "".join(c.text for c in DirectEngine(ours.model, ours.tokenizer).generate(
        prompt, SamplingParams(max_tokens=40)))
    answer = r.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content == expected and expected.strip()


def test_forced_calls_end_without_repeats_cut_calls_leave_no_markup_and_a_bare_function_takes_nothing(client):
    """SmolLM2 under ``tool_choice: "required"`` writes its call twice before it ends: it is given once. Cut by
    ``max_tokens`` inside the call: no content, no calls, finish ``length``. A function without ``parameters``
    (get_time) is called with ``{}``."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare = {"type": "function", "function": {"name": "get_time", "description": "Get the current time"}}
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required",
                                       max_tokens=80, temperature=0)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert r.usage.completion_tokens > 40  # the model wrote the call again, as it does
    cut = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required",
                                         max_tokens=12, temperature=0).choices[0]
    assert (cut.finish_reason, cut.message.content, cut.message.tool_calls) == ("length", None, None)
    r = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER, bare], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
