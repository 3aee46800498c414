"""A 10-turn conversation through ``previous_response_id`` with the real SmolLM2-135M-Instruct weights, served in
this process and read with the official openai client: each turn's prompt starts with every earlier turn's own
tokens, whose KV blocks the stored responses retain, so only the new input is prefilled (cached tokens reported).

Needs ``MLXKV_TEST_GGUF`` (see test_real_model.py).
"""

from __future__ import annotations

import pytest
from testkit.real_model import GGUF
from testkit.run_config import run_config
from testkit.serve_thread import openai_client, serve_in_thread

from mlxkv.config import EngineConfig

pytestmark = [pytest.mark.real_model, pytest.mark.server, pytest.mark.slow]

BLOCK = 16
QUESTIONS = ["Name a fruit.", "What colour is it?", "Where does it grow?", "Is it sweet?", "Name another fruit.",
             "Which one is bigger?", "Name a vegetable.", "Is it green?", "Do you cook it?", "Thanks, bye."]


@pytest.fixture(scope="module")
def client():
    config = run_config(str(GGUF), dequantize=True, engine=EngineConfig(max_sequences=2), kv_backend="paged",
                        kv_block_size=BLOCK)
    with serve_in_thread(config, model_name="smollm2") as srv:
        yield openai_client(srv.url)


def test_each_turn_prefills_only_its_new_input(client):
    previous = None
    for turn, question in enumerate(QUESTIONS):
        r = client.responses.create(model="smollm2", input=question, previous_response_id=previous,
                                    instructions="Answer in one short sentence.", max_output_tokens=16,
                                    temperature=0)
        assert r.output_text, (turn, r)
        if previous is not None:
            kept = last.usage.input_tokens + last.usage.output_tokens  # the KV the previous turn computed
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached >= kept - BLOCK, (turn, cached, kept)  # every whole block of it came from the cache
            new = r.usage.input_tokens - kept
            assert 0 < new < 40, (turn, new)  # the new input: the question and its turn markers
        previous, last = r.id, r
    assert last.usage.input_tokens > 200  # ten turns of conversation
