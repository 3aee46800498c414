"""The secondary KV tier under a real ``mlx.launch -n 2 --backend ring`` (tensor and pipeline), over loopback.

Per mode, two launches on one ``--kv-disk-cache`` folder (each rank writes its own subfolder):

1. with ``--host-cache-size`` and a small per-rank budget, a prompt whose blocks were evicted to every rank's host
   tier is restored on the next request (a prefix hit in the response's usage, restored blocks on both ranks in
   the stats) and its greedy text equals one process's; SIGTERM then flushes every rank's tier to disk;
2. between the launches rank 1's shard of another prompt's first block is deleted; the restart hits the first
   prompt from disk on every rank, and the second prompt, whose blocks rank 0 still holds, gets no hit (rank 1
   cannot restore its shard, so rank 0 does not count it) and the same text.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from mlxkv.cli.cache import cache_app
from typer.testing import CliRunner

from testkit.launch_process import launch_available, start_launch
from testkit.run_config import run_config

from mlxkv.kv.blocks.hashing import sha256_block_hash
from mlxkv.kv.tier.disk_store import read_header_file
from mlxkv.kv.tier.seal import open_seal

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.server,
    pytest.mark.skipif(launch_available() is not None, reason=str(launch_available())),
]

BLOCK = 16
#: Per-rank KV budget: 11 blocks of 16 tokens per rank (block 0 is the null block); each prompt below fits alone.
BUDGET = str(12 * 4096)
FIRST = [(7 * i) % 900 + 20 for i in range(70)]  # 4 full blocks (the last prompt token is always recomputed)
SECOND = [(11 * i) % 900 + 25 for i in range(40)]  # 2 full blocks
FILLERS = [[(13 * i + 97 * j) % 900 + 30 for i in range(70)] for j in range(4)]  # push FIRST out of the pool


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/cache/stats", timeout=30) as r:
        return json.load(r)


def _files_of(folder, block_hash: str) -> list:
    """The tier files of ``folder`` holding group 0's block ``block_hash`` (hex), read with the folder's secret."""
    seal = open_seal(folder, create=False)
    return [p for p in folder.glob("*.mlxkvblk")
            if read_header_file(p, seal)[0].block_hash == block_hash and read_header_file(p, seal)[0].group_id == 0]


def _complete(client, prompt: list[int], max_tokens: int = 8) -> tuple[str, int]:
    """Greedy text of a token-id prompt and the prompt tokens the prefix cache served."""
    out = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _ranks_restored(url: str, at_least: int) -> list[int]:
    """Each rank's restored tier blocks, once rank 0's gathered figures (at most once a second) show every rank at
    ``at_least`` or more (or after 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        ranks = _stats(url)["distributed"]["ranks"]
        restored = [r["tier"]["restored_blocks"] for r in ranks]
        if min(restored) >= at_least or time.monotonic() > deadline:
            return restored
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(llama_dir) -> dict:
    """One process's greedy texts (in this process, default options)."""
    from testkit.serve_thread import openai_client, serve_in_thread

    with serve_in_thread(run_config(llama_dir, kv_backend="paged")) as srv:
        client = openai_client(srv.url, api_key="none", timeout=120)
        return {"first": _complete(client, FIRST)[0], "second": _complete(client, SECOND)[0]}


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
@pytest.mark.slow
def test_each_rank_keeps_and_restores_its_shard(mode, llama_dir, reference, tmp_path):
    tier = tmp_path / "tier"
    args = ("-m", llama_dir, "--kv-cache-budget", BUDGET, "--host-cache-size", "64MB", "--kv-disk-cache", str(tier),
            "--kv-disk-write-interval", "3600", "--distributed-timeout", "30", "--log-level", "warning")
    launch = start_launch(2, *args, mode=mode).wait_ready()
    try:
        assert _complete(launch.client, FIRST) == (reference["first"], 0)
        for filler in FILLERS:
            _complete(launch.client, filler, max_tokens=1)
        assert _complete(launch.client, FIRST) == (reference["first"], 4 * BLOCK)  # back from the host tiers
        stats = _stats(launch.url)
        assert stats["tier"]["secondary"]["hits_memory"] >= 4, stats["tier"]
        assert min(_ranks_restored(launch.url, 4)) >= 4  # every rank restored its shard
        assert _complete(launch.client, SECOND) == (reference["second"], 0)
    finally:
        log = launch.stop()
    mine = tier / f"rank-1-of-2-{mode}"
    assert sorted(p.name for p in tier.iterdir() if p.is_dir()) == [f"rank-0-of-2-{mode}", mine.name]
    # written by each rank's flush at the stop (the write interval is longer than the test)
    saved = {p.name: len(list(p.glob("*.mlxkvblk"))) for p in tier.iterdir() if p.is_dir()}
    assert min(saved.values()) >= 6 and len(set(saved.values())) == 1, saved
    first = sha256_block_hash(None, tuple(SECOND[:BLOCK]), ()).hex()
    lost = _files_of(mine, first)  # names are keyed: found through each rank's own secret
    assert len(lost) == 1 and len(_files_of(tier / f"rank-0-of-2-{mode}", first)) == 1
    lost[0].unlink()  # rank 1's shard of SECOND's first block; rank 0 keeps its own

    listing = CliRunner(env={"COLUMNS": "200"}).invoke(cache_app, ["ls", str(mine)])
    assert listing.exit_code == 0 and f"rank 1 of 2 ({mode}-parallel)" in listing.output, listing.output
    assert f"{saved[mine.name] - 1} blocks" in listing.output  # this rank's own files, verified with its secret

    launch = start_launch(2, *args, mode=mode).wait_ready()
    try:
        assert _complete(launch.client, FIRST) == (reference["first"], 4 * BLOCK)  # from disk, on every rank
        assert _stats(launch.url)["tier"]["secondary"]["hits_disk"] >= 4
        assert min(_ranks_restored(launch.url, 4)) >= 4
        # rank 0 holds both of SECOND's blocks, rank 1 not the first: no hit, the same text
        assert _complete(launch.client, SECOND) == (reference["second"], 0)
        assert _stats(launch.url)["distributed"]["tier"]["refused_blocks"] >= 1
        with urllib.request.urlopen(f"{launch.url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert 'mlxkv_rank_tier_restored_blocks{rank="1"}' in metrics
    finally:
        log = launch.stop()
    assert f"rank 1 of 2 ready (pid" in log and f"KV tier: {saved[mine.name] - 1} block(s) on disk)" in log, log
    assert "Traceback" not in log, log
