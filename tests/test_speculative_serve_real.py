"""``mlxkv serve --prompt-lookup`` on SmolLM2-135M-Instruct through the openai client: on an edit request (return
this code with one name changed) greedy output equals the same server without speculation token for token —
alone, two requests verified in one forward, with a stop string, ``n = 2`` and quantized pages — while most
proposals are accepted; a ``json_schema`` answer quoting its prompt likewise. Needs ``MLXKV_TEST_GGUF`` (see
tests/test_real_model.py); run with OpenBLAS preloaded."""

import concurrent.futures
import json
from pathlib import Path

import pytest
from testkit.real_model import GGUF
from testkit.serve_thread import openai_client, serve_in_thread

pytestmark = [pytest.mark.real_model, pytest.mark.float_order, pytest.mark.server, pytest.mark.slow]

CODE = "\n".join((Path(__file__).resolve().parents[1] / "mlxkv/engine/verify.py").read_text().splitlines()[60:80])
EDITS = [("target_logits", "scores"), ("draft", "proposal")]
TOKENS = 64


def edit(old, new):
    return [{"role": "user", "content": f"Return this Python code exactly, with `{old}` renamed to `{new}`. Reply "
                                        f"with the code only.\n\n```python\n{CODE}\n```"}]


@pytest.fixture(scope="module")
def servers():
    from mlxkv.config import EngineConfig
    from testkit.run_config import run_config

    def config(**options):
        return run_config(str(GGUF), dequantize=True, engine=EngineConfig(max_sequences=2), kv_backend="paged",
                          **options)

    with serve_in_thread(config()) as plain, serve_in_thread(config(prompt_lookup=True, num_draft_tokens=8)) as spec:
        yield openai_client(plain.url, timeout=600), openai_client(spec.url, timeout=600)


def answer(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, max_tokens=TOKENS, temperature=0, **kw)


def test_edit_requests_equal_plain_decoding_and_mostly_accept(servers):
    plain, spec = servers
    for old, new in EDITS:
        expected = answer(plain, edit(old, new))
        got = answer(spec, edit(old, new))
        assert got.choices[0].message.content == expected.choices[0].message.content
        used = got.usage.model_extra["speculative"]
        assert used["accepted_tokens"] > 0.5 * used["proposed_tokens"] > 0, used
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two rows verified in one forward
        both = list(pool.map(lambda e: answer(spec, edit(*e)).choices[0].message.content, EDITS))
    assert both == [answer(plain, edit(*e)).choices[0].message.content for e in EDITS]
    stop = both[0][len(both[0]) // 2: len(both[0]) // 2 + 4]
    assert (answer(spec, edit(*EDITS[0]), stop=[stop]).choices[0].message.content
            == answer(plain, edit(*EDITS[0]), stop=[stop]).choices[0].message.content)
    two = answer(spec, edit(*EDITS[1]), n=2)
    assert [c.message.content for c in two.choices] == [both[1], both[1]]


PAPER = {"title": "Fast Inference from Transformers via Speculative Decoding",
         "authors": ["Yaniv Leviathan", "Matan Kalman", "Yossi Matias"], "year": 2023,
         "abstract": "Inference from large autoregressive models like Transformers is slow; decoding K tokens takes K "
                     "serial runs of the model."}
PAPER_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "authors": {"type": "array", "items": {"type": "string"}}, "year": {"type": "integer"},
    "abstract": {"type": "string"}}, "required": ["title", "authors", "year", "abstract"], "additionalProperties": False}


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.2}], ids=["greedy", "penalised"])
def test_a_json_schema_answer_quoting_the_prompt_equals_plain_decoding_and_mostly_accepts(servers, extra):
    """Structured output speculates: proposals cut by the grammar, each position verified under its mask."""
    plain, spec = servers
    messages = [{"role": "user", "content": f"Here is a paper record:\n{json.dumps(PAPER)}\nReturn it as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "paper", "schema": PAPER_SCHEMA}}
    expected, got = (c.chat.completions.create(model="m", messages=messages, max_tokens=120, temperature=0,
                                               response_format=fmt, **extra) for c in (plain, spec))
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert json.loads(got.choices[0].message.content)["authors"] == PAPER["authors"]
    used = got.usage.model_extra["speculative"]
    assert used["accepted_tokens"] > 0.5 * used["proposed_tokens"] > 0, used


def test_quantized_pages_equal_plain_decoding():
    from mlxkv.config import EngineConfig
    from testkit.run_config import run_config

    def config(**options):
        return run_config(str(GGUF), dequantize=True, engine=EngineConfig(max_sequences=2), kv_backend="paged",
                          kv_bits=8, **options)

    with serve_in_thread(config()) as plain, serve_in_thread(config(prompt_lookup=True, num_draft_tokens=8)) as spec:
        messages = edit(*EDITS[0])
        expected = answer(openai_client(plain.url, timeout=600), messages).choices[0].message.content
        got = answer(openai_client(spec.url, timeout=600), messages)
        assert got.choices[0].message.content == expected
        assert got.usage.model_extra["speculative"]["accepted_tokens"] > 0
