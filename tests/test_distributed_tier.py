"""The secondary KV tier under ``--distributed``, without mlx.launch: per-rank folders and fingerprints, and rank 0's
agreed restores applied on a follower's pool in this process (the loopback channel of test_distributed_replay).

A follower whose tier lacks its shard of a block shortens rank 0's hit instead of diverging; one that loses a block
after agreeing to it stops with a clear error. The launches themselves: test_distributed_tier_launch.py.
"""

from __future__ import annotations

import logging
import time

import pytest
from mlxkv.cli.cache import cache_app
from test_distributed_replay import _FollowerChannel, _LoopbackChannel, _tables
from typer.testing import CliRunner

from mlxkv.config import KvCacheConfig
from mlxkv.distributed.changes import TierRestore
from mlxkv.distributed.follower import Replayer
from mlxkv.distributed.leader import LeaderEngine, Plans
from mlxkv.distributed.leader_pool import ChangeLog, LeaderPool
from mlxkv.distributed.tier import parse_shard_name, rank_tier_config, shard_name
from mlxkv.engine.batch import EngineConfig
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import CachePool
from mlxkv.kv.tier import DiskStore, TierBlock
from mlxkv.kv.tier.fingerprint import make_fingerprint, with_shard
from mlxkv.kv.tier.format import extra_digest
from mlxkv.models import load

PROMPT = [(7 * i) % 500 + 40 for i in range(41)]  # 5 full blocks of 8 (the last token is always recomputed)
FILLERS = [[(13 * i + 101 * j) % 700 + 30 for i in range(33)] for j in range(4)]


def test_each_rank_gets_its_own_folder_and_fingerprint(tmp_path, caplog):
    kv = KvCacheConfig(backend="paged", secondary_disk_dir=str(tmp_path))
    one = rank_tier_config(kv, "tensor", 1, 2)
    assert one.secondary_disk_dir == str(tmp_path / "rank-1-of-2-tensor")
    assert one.secondary_shard == shard_name("tensor", 1, 2) == "rank-1-of-2-tensor"
    assert parse_shard_name("rank-1-of-2-tensor") == (1, 2, "tensor") and parse_shard_name("rank-x-of-2") is None
    host_only = rank_tier_config(KvCacheConfig(backend="paged", secondary_memory_bytes=1 << 20), "pipeline", 0, 2)
    assert host_only.secondary_disk_dir is None and host_only.secondary_shard == "rank-0-of-2-pipeline"
    assert rank_tier_config(KvCacheConfig(backend="paged"), "tensor", 0, 2).secondary_shard == ""  # no tier
    base = make_fingerprint("llama", "files", "abc")
    digests = {with_shard(base, shard_name(m, r, n))["digest"] for m in ("tensor", "pipeline") for n in (2, 4)
               for r in range(n)}
    assert len(digests) == 12 and base["digest"] not in digests  # every split and rank is another model
    (tmp_path / "rank-0-of-4-pipeline").mkdir()
    with caplog.at_level(logging.WARNING, logger="mlxkv.distributed"):
        rank_tier_config(kv, "tensor", 0, 2)
    assert "holds the tier of another --distributed split (rank-0-of-4-pipeline)" in caplog.text


def test_a_folder_of_another_shard_is_never_served(tmp_path, caplog):
    import numpy as np

    base = make_fingerprint("llama", "files", "abc")
    block = TierBlock(block_hash=b"\x01" * 32, parent_hash=None, group_id=0, layers=(0,), token_ids=tuple(range(4)),
                      extra_digest=extra_digest(()), priority=50, arrays=[np.zeros((4, 1, 2), np.float32)] * 2,
                      dtypes=["float32", "float32"])
    folder = tmp_path / "rank-1-of-2-tensor"
    written = DiskStore(folder, with_shard(base, "rank-1-of-2-tensor"), 1 << 20, block_size=4)
    assert written.put(block) and len(written) == 1
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        other = DiskStore(folder, with_shard(base, "rank-0-of-2-tensor"), 1 << 20, block_size=4)
    assert len(other) == 0 and other.num_foreign == 1  # read as rank 0's shard: not served, not deleted
    assert "belong to another model, other KV bits or another --distributed shard" in caplog.text
    assert len(DiskStore(folder, with_shard(base, "rank-1-of-2-tensor"), 1 << 20, block_size=4)) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        whole = DiskStore(tmp_path, base, 1 << 20, block_size=4)  # one process on the launch's folder
    assert len(whole) == 0 and "holds the per-rank folders of --distributed launches (rank-1-of-2-tensor)" \
        in caplog.text
    runner = CliRunner(env={"COLUMNS": "200"})
    listed = runner.invoke(cache_app, ["ls", str(folder)])
    assert listed.exit_code == 0 and "rank 1 of 2 (tensor-parallel): this rank's shard" in listed.output
    assert "1 blocks" in listed.output, listed.output
    parent = runner.invoke(cache_app, ["ls", str(tmp_path)])
    assert parent.exit_code == 0 and "holds the per-rank folders of --distributed launches (rank-1-of-2-tensor)" \
        in parent.output and f"mlxkv cache ls {folder}" in parent.output, parent.output


def test_models_with_recurrent_layers_are_refused():
    from types import SimpleNamespace

    from mlxkv.distributed.tier import RankTier

    with pytest.raises(ValueError, match="does not cover models with recurrent layers"):
        RankTier(SimpleNamespace(states=object()))  # a bridge whose state snapshots travel with the tier


@pytest.fixture(scope="module")
def llama(test_model_dir):
    return load(str(test_model_dir("llama")), progress=False)


def _cached(pool: CachePool) -> set:
    return {(b.block_id, b.block_hash) for b in pool.paged.manager.pool.blocks if b.cached}


class _Ranks:
    """Rank 0's engine over a recording pool with a host tier, and a follower pool (its own host tier) replaying
    every message in this process."""

    def __init__(self, model, kv: KvCacheConfig):
        def pool(rank: int) -> CachePool:
            return CachePool(model, max_sequences=2, backend="paged", num_blocks=16,
                             kv_config=rank_tier_config(kv, "tensor", rank, 2))

        self.leader_pool, self.follower_pool = pool(0), pool(1)
        self.replayer = Replayer(model, self.follower_pool, _FollowerChannel())
        self.channel = _LoopbackChannel(self.replayer)
        self.channel.leader_pool = self.leader_pool
        changes = ChangeLog()
        self.plans = Plans(self.channel, changes, self.leader_pool)
        from mlxkv.distributed.tier import rank_tier

        self.leader_tier = rank_tier(self.leader_pool, self.plans)
        pooled = LeaderPool(self.leader_pool, changes, on_idle=self.plans.heartbeat, on_stop=self.plans.stop,
                            heartbeat_s=1.0, extra_stats=dict)
        self.engine = LeaderEngine(model, None, config=EngineConfig(max_sequences=2), pool=pooled,
                                   context_length=4096, plans=self.plans).start()

    def run(self, prompt: list[int]) -> tuple[list[int], int]:
        """Greedy tokens of ``prompt`` and the prompt tokens its prefix hit served."""
        events = list(self.engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=6, temp=0.0))))
        assert events[-1].kind == "done", events[-1]
        return [e.token for e in events if e.kind == "token"], events[-1].usage.cached_tokens

    def evict_prompt(self) -> None:
        for filler in FILLERS:  # 16 blocks: the fillers' blocks push PROMPT's out (to each rank's host tier)
            self.run(filler)

    def check_same(self) -> None:
        """The follower's blocks are rank 0's, once the last release reached it (rank 0's idle heartbeat)."""
        deadline = time.monotonic() + 10
        while self.plans.changes.pending:
            assert time.monotonic() < deadline, "rank 0 sent no heartbeat"
            time.sleep(0.05)
        time.sleep(0.05)  # the heartbeat's message is replayed as it is sent
        assert _tables(self.follower_pool) == _tables(self.leader_pool)
        assert _cached(self.follower_pool) == _cached(self.leader_pool)


def test_restores_are_agreed_and_applied(llama):
    kv = KvCacheConfig(backend="paged", block_size=8, secondary_memory_bytes=1 << 24)
    ranks = _Ranks(llama.model, kv)
    try:
        reference, hit = ranks.run(PROMPT)
        assert hit == 0
        ranks.evict_prompt()
        follower = ranks.replayer.tier
        assert ranks.leader_tier.figures()[0] >= 5 and follower.figures()[0] >= 5  # in both host tiers
        tokens, hit = ranks.run(PROMPT)
        assert (tokens, hit) == (reference, 40)  # 5 blocks from the host tier, on both ranks
        assert ranks.leader_tier.figures()[2] == follower.figures()[2] == 5
        assert [c for c in ranks.channel.changes if isinstance(c, TierRestore)][-1].grew == 5
        ranks.check_same()

        ranks.evict_prompt()
        follower.bridge.tier.memory.clear()  # the follower lost its shards (its host memory; a removed folder alike)
        tokens, hit = ranks.run(PROMPT)
        assert (tokens, hit) == (reference, 0)  # rank 0 still holds them, but not every rank: no hit
        assert ranks.leader_tier.refused_blocks >= 5 and ranks.leader_tier.figures()[2] == follower.figures()[2]
        ranks.check_same()

        ranks.evict_prompt()
        follower.bridge.tier.take = lambda key: None  # holds its shard when asked, loses it before the replay
        errors: list[str] = []
        replay = ranks.replayer.apply

        def apply(change) -> None:  # a real follower stops the launch with this error (serve_follower)
            try:
                replay(change)
            except RuntimeError as exc:
                errors.append(str(exc))
                raise

        ranks.replayer.apply = apply
        events = list(ranks.engine.submit(GenerationRequest(PROMPT, SamplingParams(max_tokens=2, temp=0.0))))
        assert events[-1].kind == "error"
        assert errors and "this rank's KV tier lost its shard of block 0" in errors[0], errors
    finally:
        ranks.engine.stop()
