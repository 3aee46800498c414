"""SmolLM2-135M-Instruct (30 layers) served by 2 pipeline-parallel ranks (15 layers each) under ``mlx.launch`` over
loopback, against one process: concurrent greedy chat answers through the official ``openai`` client are equal
token for token (pipeline parallelism reorders no float sum), and each rank's KV blocks are half a process's.
Needs ``MLXKV_TEST_GGUF`` (see tests/test_real_model.py); skipped without it or without ``mlx.launch``.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

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


def _answers(client) -> list[list[str]]:
    """Each question's greedy answer as its tokens, asked concurrently."""
    def one(question: str) -> list[str]:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                           max_tokens=MAX_TOKENS, temperature=0, logprobs=True)
        return [t.token for t in r.choices[0].logprobs.content]

    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, QUESTIONS))


def test_two_pipeline_ranks_answer_exactly_like_one_process():
    import openai

    from mlxkv.config import EngineConfig
    from mlxkv.server.runner import ServerThread, build

    launch = start_launch(2, "-m", str(GGUF), "--dequantize", "--max-sequences", "4", "--log-level", "warning",
                          "--distributed-timeout", "300", mode="pipeline")
    try:
        parts = build(run_config(str(GGUF), dequantize=True, kv_backend="paged", engine=EngineConfig(max_sequences=4)))
        with ServerThread(parts.app) as srv:
            single = _answers(openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600))
        single_block = parts.engine.pool.paged.bytes_per_block
        parts.engine.stop()
        launched = _answers(launch.wait_ready(timeout=600).client)
        with urllib.request.urlopen(f"{launch.url}/v1/cache/stats", timeout=30) as r:
            dist = json.load(r)["distributed"]
    finally:
        launch.stop()
    assert all(len(a) >= 2 for a in single), single  # real answers (one may end before MAX_TOKENS)
    assert launched == single, (launched, single)
    assert dist["mode"] == "pipeline" and dist["bytes_per_block_per_rank"] == single_block // 2
