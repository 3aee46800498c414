"""The openai-agents SDK on its default Responses model class (``OpenAIResponsesModel``) against a real server on
loopback, offline (tracing off): an Agent with a function tool and an ``output_type`` runs to its final output.

The random-weight test llama is served with the tools template: ``tool_choice="required"`` with
``parallel_tool_calls=False`` makes its first answer one call by constrained decoding; the SDK runs the tool,
resets ``tool_choice`` to auto and sends the call and its output back as input items; the next answer follows the
output type's JSON schema (``text.format``, strict tools: the grammar admits the document or a call), which the SDK
parses into the output type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents")

pytestmark = pytest.mark.server

TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
#: The engine of test_server_tools.py's servers: this module shares them.
ENGINE = {"max_sequences": 2, "max_queue_depth": 8}


class Forecast(BaseModel):
    sunny: bool


def test_agent_with_a_function_tool_and_an_output_type(served):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    server = served(**ENGINE, chat_template=TEMPLATE)
    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:  # an enum: the random model's call ends
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather],
                  output_type=Forecast, model=OpenAIResponsesModel(model="tiny-llama", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=64))
    result = Runner.run_sync(agent, "Is it sunny in Paris?", max_turns=4)
    assert calls, "the agent ran its tool"
    assert isinstance(result.final_output, Forecast)
