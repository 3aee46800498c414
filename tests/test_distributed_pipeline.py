"""``mlxkv serve`` / ``generate --distributed pipeline`` under a real ``mlx.launch -n 2 --backend ring`` over loopback.

The test llama has 2 layers: each rank keeps one, and its KV. Through the official ``openai`` client, concurrent
greedy requests give the same text as one process (pipeline parallelism does not reorder any float sum, so the
tokens are exactly equal), each rank's KV blocks are half a single process's, prompts hit the prefix cache, a
small per-rank budget preempts and still matches, and killing a rank ends the launch with a clear error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from test_distributed import BUDGET, GENERATE, PROMPTS, _complete_all, _stats

from testkit.launch_process import launch_available, ring_port, start_launch
from testkit.run_config import run_config

from mlxkv.distributed.pipeline import split_layers

pytestmark = [pytest.mark.distributed, pytest.mark.server]

needs_launch = pytest.mark.skipif(launch_available() is not None, reason=str(launch_available()))


def test_split_layers_is_contiguous_and_balanced():
    assert split_layers(2, 2) == [range(0, 1), range(1, 2)]
    assert split_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert split_layers(30, 3) == [range(0, 10), range(10, 20), range(20, 30)]
    with pytest.raises(ValueError, match="fewer than the 3 ranks"):
        split_layers(2, 3)


@pytest.fixture(scope="module")
def generating(llama_dir):
    """``mlxkv generate --distributed pipeline`` under mlx.launch, started with the server launch."""
    proc = subprocess.Popen(["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(ring_port(2)), "--",
                             sys.executable, "-m", "mlxkv", *GENERATE, "-m", llama_dir, "--distributed", "pipeline"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def started(llama_dir, generating):
    """The launch, started first: its ranks boot while the reference runs."""
    launched = start_launch(2, "-m", llama_dir, "--kv-cache-budget", BUDGET, "--distributed-timeout", "30",
                            "--log-level", "warning", mode="pipeline")
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def reference(started, llama_dir):
    """Greedy texts and the block bytes of one server process (in this process, on loopback), default options."""
    from testkit.serve_thread import openai_client, serve_in_thread

    with serve_in_thread(run_config(llama_dir, kv_backend="paged")) as srv:
        client = openai_client(srv.url, api_key="none", timeout=120)
        texts = _complete_all(client, PROMPTS)
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi there"}],
                                              max_tokens=16, temperature=0).choices[0].message.content
        bytes_per_block = srv.parts.engine.pool.paged.bytes_per_block
    return {"texts": texts, "chat": chat, "bytes_per_block": bytes_per_block}


@pytest.fixture(scope="module")
def launch(started, reference):
    return started.wait_ready()


@needs_launch
@pytest.mark.slow
def test_concurrent_greedy_requests_equal_one_process(launch, reference):
    assert _complete_all(launch.client, PROMPTS) == reference["texts"]
    chat = launch.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi there"}],
                                                 max_tokens=16, temperature=0).choices[0].message.content
    assert chat == reference["chat"]
    stats = _stats(launch.url)
    assert stats["max_batch"] >= 2 and stats["batched_decode"], stats  # they did decode together
    assert stats["preemptions"] >= 1, "the per-rank budget was meant to preempt a request"
    assert stats["failed_total"] == 0


@needs_launch
@pytest.mark.slow
def test_each_rank_holds_its_layers_kv_bytes(launch, reference):
    single = reference["bytes_per_block"]
    dist = _stats(launch.url)["distributed"]
    ranks = dist.pop("ranks")
    assert dist == {"mode": "pipeline", "world_size": 2, "rank": 0, "bytes_per_block_per_rank": single // 2}
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["mlx_active_bytes"] > 0 for r in ranks), ranks
    assert f"rank 1 of 2 ready (pid {launch.ranks[1]}, " in launch.log()
    assert f"KV blocks of {single // 2} bytes" in launch.log()  # rank 1's own pool: one layer of two
    blocks = _stats(launch.url)["kv_blocks"]
    assert blocks["total"] == int(BUDGET) // (single // 2) - 1  # the budget is per rank (block 0 is the null block)


@needs_launch
@pytest.mark.slow
def test_prefix_hit_across_ranks(launch, reference):
    prompt = PROMPTS[0]
    before = _stats(launch.url)["prefix_cache"]["hits"]
    first = _complete_all(launch.client, [prompt], max_tokens=8)
    again = _complete_all(launch.client, [prompt], max_tokens=8)
    assert first == again
    assert reference["texts"][0].startswith(first[0])
    assert _stats(launch.url)["prefix_cache"]["hits"] > before


@needs_launch
@pytest.mark.slow
def test_killing_a_rank_ends_the_launch(launch):
    """Last of the server tests: it ends the shared launch."""
    os.kill(launch.ranks[1], signal.SIGKILL)
    try:
        launch.proc.wait(timeout=60)  # rank 0 notices at its next heartbeat (1 s) at the latest
    except subprocess.TimeoutExpired:
        pytest.fail("the launch kept running after a rank was killed:\n" + launch.log())
    log = launch.log()
    assert "mlxkv: rank 0: the distributed group failed" in log, log
    with pytest.raises(Exception):
        launch.client.models.list()
    with pytest.raises(Exception):
        urllib.request.urlopen(f"{launch.url}/v1/models", timeout=5)


@needs_launch
def test_generate_under_mlx_launch_equals_one_process(generating, llama_dir):
    single = subprocess.run([sys.executable, "-m", "mlxkv", *GENERATE, "-m", llama_dir], capture_output=True,
                            text=True, timeout=120)
    out, err = generating.communicate(timeout=240)
    assert single.returncode == 0 and single.stdout.strip(), single.stderr
    # mlx.launch exits 0 even when a rank fails: the text is the check, and the ranks' stderr says why it is missing
    assert out == single.stdout, err  # printed once (rank 0), the same greedy text
