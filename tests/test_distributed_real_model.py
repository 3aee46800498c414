"""SmolLM2-135M-Instruct (9 query / 3 KV heads) served by 3 tensor-parallel ranks under ``mlx.launch`` over loopback,
against one process: concurrent greedy chat answers through the official ``openai`` client.

Tensor parallelism sums each layer's partial products in another order than one process, so a long greedy output
may take the other branch of a near-tie; where the tokens first differ, both runs' log-probabilities of the tokens
before it must agree closely and the single process's two best candidates there must be nearly tied.
Needs ``MLXKV_TEST_GGUF`` (see tests/test_real_model.py); skipped without it or without ``mlx.launch``.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from testkit.launch_process import launch_available, start_launch
from testkit.real_model import GGUF
from testkit.run_config import run_config

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.float_order,
    pytest.mark.distributed,
    pytest.mark.server,
    pytest.mark.skipif(launch_available() is not None, reason=str(launch_available())),
]
QUESTIONS = ["What is the capital of France?", "Name a primary color."]
MAX_TOKENS = 8


def _answers(client) -> list[list[tuple[str, float, list]]]:
    """Each question's answer as (token, logprob, top-2 logprobs) per generated token, asked concurrently."""
    def one(question: str):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                           max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
        return [(t.token, t.logprob, [c.logprob for c in t.top_logprobs]) for t in r.choices[0].logprobs.content]

    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, QUESTIONS))


def test_three_ranks_answer_like_one_process():
    import openai

    from mlxkv.config import EngineConfig
    from mlxkv.server.runner import ServerThread, build

    launch = start_launch(3, "-m", str(GGUF), "--dequantize", "--max-sequences", "4", "--log-level", "warning",
                          "--distributed-timeout", "300")
    try:
        parts = build(run_config(str(GGUF), dequantize=True, kv_backend="paged", engine=EngineConfig(max_sequences=4)))
        with ServerThread(parts.app) as srv:
            single = _answers(openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600))
        parts.engine.stop()
        launched = _answers(launch.wait_ready(timeout=600).client)
    finally:
        launch.stop()
    for ours, ref in zip(launched, single):
        for i, ((tok, lp, _), (ref_tok, ref_lp, ref_top)) in enumerate(zip(ours, ref)):
            assert abs(lp - ref_lp) < 1e-3, f"token {i}: logprob {lp} vs {ref_lp}"
            if tok != ref_tok:  # the first divergence: a near-tie in the single process
                assert len(ref_top) == 2 and abs(ref_top[0] - ref_top[1]) < 1e-3, (i, tok, ref_tok, ref_top)
                break
