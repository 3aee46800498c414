"""``mlxkv serve --draft-model`` on SmolLM2-135M-Instruct through the openai client, with two drafts built offline
from the model itself: its weights quantized to 4 bits by mlx-lm (most proposals accepted) and its first four layers
with its own norm and head (most rejected). On an edit request greedy output equals the same server without
speculation token for token — alone, two requests drafted and verified together, and ``n = 2`` — and the draft's KV
is all given back. Needs ``MLXKV_TEST_GGUF`` (see tests/test_real_model.py); run with OpenBLAS preloaded."""

import concurrent.futures
from pathlib import Path

import pytest
from testkit.draft_models import first_layers
from testkit.real_model import GGUF
from testkit.serve_thread import openai_client, serve_in_thread
from testkit.waiting import wait_for

pytestmark = [pytest.mark.real_model, pytest.mark.float_order, pytest.mark.server, pytest.mark.slow]

CODE = "\n".join((Path(__file__).resolve().parents[1] / "mlxkv/engine/verify.py").read_text().splitlines()[60:80])
EDITS = [("target_logits", "scores"), ("draft", "proposal")]
TOKENS = 48


def edit(old, new):
    return [{"role": "user", "content": f"Return this Python code exactly, with `{old}` renamed to `{new}`. Reply "
                                        f"with the code only.\n\n```python\n{CODE}\n```"}]


def answer(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, max_tokens=TOKENS, temperature=0, **kw)


def config(**options):
    from mlxkv.config import EngineConfig
    from testkit.run_config import run_config

    return run_config(str(GGUF), dequantize=True, engine=EngineConfig(max_sequences=2), kv_backend="paged", **options)


@pytest.fixture(scope="module")
def expected():
    with serve_in_thread(config()) as plain:
        client = openai_client(plain.url, timeout=600)
        return [answer(client, edit(*e)).choices[0].message.content for e in EDITS]


@pytest.fixture(scope="module")
def quantized_draft(smollm2_f32_folder, tmp_path_factory):
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("smollm2-draft") / "4bit"
    convert(str(smollm2_f32_folder), mlx_path=str(out), quantize=True, q_bits=4)
    return out


@pytest.mark.parametrize("kind", ["quantized", "first-layers"])
def test_edit_requests_equal_plain_decoding(kind, expected, quantized_draft, smollm2_f32_folder, tmp_path):
    draft = quantized_draft if kind == "quantized" else first_layers(smollm2_f32_folder, 4, tmp_path / "draft")
    with serve_in_thread(config(draft_model=str(draft), num_draft_tokens=4)) as srv:
        client = openai_client(srv.url, timeout=600)
        got = answer(client, edit(*EDITS[0]))
        assert got.choices[0].message.content == expected[0]
        used = got.usage.model_extra["speculative"]
        if kind == "quantized":
            assert used["accepted_tokens"] > 0.7 * used["proposed_tokens"] > 0, used
        else:
            assert used["proposed_tokens"] > used["accepted_tokens"], used
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two rows drafted and verified together
            both = list(pool.map(lambda e: answer(client, edit(*e)).choices[0].message.content, EDITS))
        assert both == expected
        two = answer(client, edit(*EDITS[1]), n=2)
        assert [c.message.content for c in two.choices] == [expected[1], expected[1]]
        def draft_stats():
            return srv.parts.engine.stats()["speculative"]["draft_model"]

        # once the engine has published the step that ended the last request: every draft sequence released
        wait_for(lambda: draft_stats()["sequences"] == 0 and draft_stats()["kv_blocks"]["used"] == 0, timeout=10)
        assert draft_stats()["rows_per_forward"] > 1.0 and draft_stats()["cached_tokens"] > 0  # shared, prefix hits
