"""``mlxkv serve --distributed tensor`` under a real ``mlx.launch -n 2 --backend ring`` over loopback.

The test llama (4 query / 2 KV heads) is served by one process and by two tensor-parallel ranks; through the
official ``openai`` client, concurrent greedy requests give the same text on both, each rank's KV blocks are half
a single process's, prompts hit the prefix cache, a small per-rank budget preempts and still matches, and killing
a rank ends the whole launch with a clear error instead of a hang.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from testkit.launch_process import launch_available, ring_port, start_launch
from testkit.run_config import run_config

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.server,
    pytest.mark.skipif(launch_available() is not None, reason=str(launch_available())),
]

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 2, "hello world, how are you today?",
           "a b c d e f g h i j k l m n o p q r s t u v w x y z", "0 1 2 3 4 5 6 7 8 9 10 11 12 13"]
#: Per-rank KV budget of the distributed launch: 12 blocks of 16 tokens per rank (11 usable). The prompts below are
#: 20-50 tokens; each request alone fits, but any three of them decoding 40 tokens need 14 blocks or more, so some
#: are preempted and resumed whatever the order they arrive in.
BUDGET = str(12 * 4096)


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/cache/stats", timeout=30) as r:
        return json.load(r)


def _complete_all(client, prompts: list[str], max_tokens: int = 40) -> list[str]:
    def one(prompt: str) -> str:
        return client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


GENERATE = ["generate", "the quick brown fox", "--temp", "0", "--max-tokens", "12"]


@pytest.fixture(scope="module")
def generating(llama_dir):
    """``mlxkv generate --distributed tensor`` under mlx.launch, started with the server launch (both boot while
    the reference runs)."""
    proc = subprocess.Popen(["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(ring_port(2)), "--",
                             sys.executable, "-m", "mlxkv", *GENERATE, "-m", llama_dir, "--distributed", "tensor"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def started(llama_dir, generating):
    """The launch, started first: its ranks boot while the reference runs."""
    launched = start_launch(2, "-m", llama_dir, "--kv-cache-budget", BUDGET, "--distributed-timeout", "30",
                            "--log-level", "warning")
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


@pytest.mark.slow
def test_each_rank_holds_half_the_kv_bytes(launch, reference):
    single = reference["bytes_per_block"]
    dist = _stats(launch.url)["distributed"]
    ranks = dist.pop("ranks")
    assert dist == {"mode": "tensor", "world_size": 2, "rank": 0, "bytes_per_block_per_rank": single // 2}
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["mlx_active_bytes"] > 0 for r in ranks), ranks
    with urllib.request.urlopen(f"{launch.url}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert f"mlxkv_kv_block_bytes_per_rank {float(single // 2)}" in metrics
    assert 'mlxkv_rank_mlx_active_bytes{rank="1"}' in metrics
    assert f"KV blocks of {single // 2} bytes" in launch.log()  # rank 1's own pool, as it reported it
    blocks = _stats(launch.url)["kv_blocks"]
    assert blocks["total"] == int(BUDGET) // (single // 2) - 1  # the budget is per rank (block 0 is the null block)


@pytest.mark.slow
def test_prefix_hit_across_ranks(launch, reference):
    prompt = PROMPTS[0]
    before = _stats(launch.url)["prefix_cache"]["hits"]
    first = _complete_all(launch.client, [prompt], max_tokens=8)
    again = _complete_all(launch.client, [prompt], max_tokens=8)
    assert first == again
    assert reference["texts"][0].startswith(first[0])
    assert _stats(launch.url)["prefix_cache"]["hits"] > before


@pytest.mark.slow
def test_killing_a_rank_ends_the_launch(launch):
    """Last in this module: it ends the shared launch."""
    follower = launch.ranks[1]
    os.kill(follower, signal.SIGKILL)
    try:
        launch.proc.wait(timeout=60)  # rank 0 notices at its next heartbeat (1 s) at the latest
    except subprocess.TimeoutExpired:
        pytest.fail("the launch kept running after a rank was killed:\n" + launch.log())
    log = launch.log()
    assert "mlxkv: rank 0: the distributed group failed" in log, log
    with pytest.raises(Exception):
        launch.client.models.list()


def test_generate_under_mlx_launch_equals_one_process(generating, llama_dir):
    single = subprocess.run([sys.executable, "-m", "mlxkv", *GENERATE, "-m", llama_dir], capture_output=True,
                            text=True, timeout=120)
    out, err = generating.communicate(timeout=240)
    assert single.returncode == 0 and single.stdout.strip(), single.stderr
    # mlx.launch exits 0 even when a rank fails: the text is the check, and the ranks' stderr says why it is missing
    assert out == single.stdout, err  # printed once (rank 0), the same greedy text


def test_distributed_needs_mlx_launch(llama_dir):
    out = subprocess.run([sys.executable, "-m", "mlxkv", "serve", "-m", llama_dir, "--distributed", "tensor"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "needs several ranks: start it with mlx.launch" in out.stderr


def test_mlx_launch_without_distributed_is_refused(llama_dir):
    env = {**os.environ, "MLX_RANK": "0"}  # what mlx.launch sets for each rank
    out = subprocess.run([sys.executable, "-m", "mlxkv", "serve", "-m", llama_dir], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 1
    assert "started by mlx.launch without --distributed" in out.stderr


@pytest.mark.parametrize("command", [GENERATE, ["serve"]], ids=["generate", "serve"])
def test_a_ring_port_in_use_stops_the_launch_with_one_line(llama_dir, command):
    start = ring_port(2)
    with socket.socket() as taken:  # rank 1's port
        taken.bind(("127.0.0.1", start + 1))
        taken.listen()
        out = subprocess.run(["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(start), "--",
                              sys.executable, "-m", "mlxkv", *command, "-m", llama_dir, "--distributed", "tensor"],
                             capture_output=True, text=True, timeout=240)
    assert out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert ("error: the distributed group did not start: [ring] Couldn't bind socket (Address already in use): a port "
            "of this launch's ring is taken; give mlx.launch another --starting-port\n") in out.stderr, out.stderr


@pytest.mark.slow
def test_prompt_lookup_under_mlx_launch_equals_plain_one_process(llama_dir):
    """Every rank runs the same speculative steps (proposals come from the same committed tokens), so the greedy
    text equals plain decoding in one process."""
    args = ["generate", "abc abc abc abc abc abc", "--raw", "--temp", "0", "--max-tokens", "24", "-m", llama_dir]
    single = subprocess.run([sys.executable, "-m", "mlxkv", *args], capture_output=True, text=True, timeout=120)
    launched = subprocess.run(["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(ring_port(2)), "--",
                               sys.executable, "-m", "mlxkv", *args, "--distributed", "tensor", "--prompt-lookup",
                               "--verbose"], capture_output=True, text=True, timeout=240)
    assert single.returncode == 0 and launched.returncode == 0, launched.stderr
    assert single.stdout.strip() and launched.stdout == single.stdout, launched.stderr
    assert "speculative: acceptance" in launched.stderr
