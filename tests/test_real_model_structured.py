"""Structured output and forced tool calls with the real SmolLM2-135M-Instruct weights: a real ``mlxkv serve``
process (float32, the tools chat template) and the official openai client.

Random schemas sampled at temperature 1.0 in one batch must all validate; a free greedy request decoded beside them
gives its text alone; ``tool_choice`` required and a named function give calls whose arguments validate against the
function's parameters. Needs ``MLXKV_TEST_GGUF`` (see test_real_model.py); about a minute under OpenBLAS.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from testkit.real_model import GGUF
from testkit.json_schemas import random_schema
from testkit.serve_process import serve_process

pytestmark = [pytest.mark.real_model, pytest.mark.server]

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
SCHEMAS = 6
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
                                             "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    with serve_process("-m", str(GGUF), "--dequantize", "--chat-template", TEMPLATE, "--max-sequences", "8",
                       "--log-level", "warning") as c:
        yield c


def ask_json(client, schema, seed):
    fields = ", ".join(schema["properties"])
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": f"Reply with a JSON object with the fields {fields}."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": schema, "strict": True}},
        max_tokens=300, temperature=1.0, seed=seed)


def free(client):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is Python?"}],
                                          max_tokens=24, temperature=0).choices[0].message.content


def test_random_schemas_at_temperature_one_validate_beside_a_free_request(client):
    rng = random.Random(19)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    alone = free(client)
    with ThreadPoolExecutor(SCHEMAS + 1) as pool:
        answers = [pool.submit(ask_json, client, schema, i) for i, schema in enumerate(schemas)]
        beside = pool.submit(free, client)
        answers = [a.result() for a in answers]
    assert beside.result() == alone
    for answer, schema in zip(answers, schemas):
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_forced_tool_calls_have_valid_arguments(client):
    def call(choice):
        return client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                              max_tokens=100, temperature=0)

    with ThreadPoolExecutor(2) as pool:  # decoded together
        required, named = pool.map(call, ["required", {"type": "function", "function": {"name": "get_time"}}])
    for answer, names in ((required, {"get_weather", "get_time"}), (named, {"get_time"})):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        for call in choice.message.tool_calls:
            assert call.function.name in names
            tool = WEATHER if call.function.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
