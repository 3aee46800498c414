"""Recurrent-state snapshots in the secondary tier (qwen3_next, nemotron_h; random weights): evicted to host
memory and restored with their blocks, written to disk and found again by a fresh pool on the same folder (a
restart); greedy output with the tier's hit equals output without reuse."""

import pytest
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.layouts import install_attention_hook
from mlxkv.kv.store import CachePool
from mlxkv.kv.tier.disk_store import read_header_file
from mlxkv.kv.tier.seal import open_seal

BS = 4
PARAMS = SamplingParams(max_tokens=6)
PROMPT = [(5 * i + 7) % 900 + 10 for i in range(33)]  # 8 full blocks + 1: a repeat resumes at 32


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h"])
def model(request):
    m, _ = build_model(request.param)
    install_attention_hook(m)
    return m


def pool_with_tier(model, **tier):
    cfg = KvCacheConfig(backend="paged", block_size=BS, secondary_write_interval_s=3600, **tier)
    return CachePool(model, backend="paged", num_blocks=120, max_sequences=2, kv_config=cfg)


def reference(model):
    return list(DirectEngine(model, None, pool=CachePool(model, max_sequences=1)).generate_tokens(PROMPT, PARAMS))


def test_evicted_snapshot_comes_back_from_host_memory(model):
    expected = reference(model)
    pool = pool_with_tier(model, secondary_memory_bytes=1 << 24)
    engine = DirectEngine(model, None, pool=pool)
    assert list(engine.generate_tokens(PROMPT, PARAMS)) == expected
    assert pool.evict_cached() > 0  # blocks and snapshots leave the pool for the host tier
    assert pool.block_stats()["state_snapshots"]["count"] == 0
    assert list(engine.generate_tokens(PROMPT, PARAMS)) == expected
    assert engine.last_stats.cached_prompt_tokens == 32
    stats = pool.block_stats()
    assert stats["tier"]["secondary"]["hits_memory"] >= 9  # 8 attention blocks and the snapshot at 32
    assert stats["state_snapshots"]["hits"] == 1
    pool.check_invariants()


def test_snapshots_survive_a_restart_on_the_disk_tier(model, tmp_path):
    expected = reference(model)
    tier = {"secondary_disk_dir": str(tmp_path), "secondary_disk_bytes": 1 << 24}
    first = pool_with_tier(model, **tier)
    assert list(DirectEngine(model, None, pool=first).generate_tokens(PROMPT, PARAMS)) == expected
    assert first.flush_tier(30)["lost"] == 0
    seal = open_seal(tmp_path, create=False)
    kinds = [read_header_file(p, seal)[0].kind for p in tmp_path.glob("*.mlxkvblk")]
    assert kinds.count("state") >= 2  # the prompt's end (32) and the finished sequence's last boundary (36)
    second = pool_with_tier(model, **tier)  # a fresh pool on the same folder: a restart
    engine = DirectEngine(model, None, pool=second)
    assert list(engine.generate_tokens(PROMPT, PARAMS)) == expected
    assert engine.last_stats.cached_prompt_tokens == 32
    assert second.block_stats()["tier"]["secondary"]["hits_disk"] >= 9
    second.check_invariants()


@pytest.mark.parametrize("damage", ["shape", "prefix"])
def test_a_snapshot_record_that_does_not_fit_is_recomputed(model, damage):
    import numpy as np

    expected = reference(model)
    pool = pool_with_tier(model, secondary_memory_bytes=1 << 24)
    engine = DirectEngine(model, None, pool=pool)
    list(engine.generate_tokens(PROMPT, PARAMS))
    pool.evict_cached()
    memory = pool.paged.tier.tier.memory
    states = [tb for tb in memory._blocks.values() if tb.kind == "state"]
    assert states
    for tb in states:
        if damage == "shape":  # another model's layout
            tb.arrays[0] = np.zeros((1, *tb.arrays[0].shape), dtype=tb.arrays[0].dtype)
        else:  # the state of another prefix under the same key (a hash collision)
            tb.token_ids = (0, *tb.token_ids[1:])
    assert list(engine.generate_tokens(PROMPT, PARAMS)) == expected
    assert engine.last_stats.cached_prompt_tokens == 0
    assert pool.block_stats()["state_snapshots"]["hits"] == 0
    pool.check_invariants()


def test_a_snapshot_evicted_alone_comes_back_beside_pool_blocks(model):
    expected = reference(model)
    pool = pool_with_tier(model, secondary_memory_bytes=1 << 24)
    engine = DirectEngine(model, None, pool=pool)
    list(engine.generate_tokens(PROMPT, PARAMS))
    manager = pool.paged.manager
    group = manager.snapshots.group_id
    assert manager.pool.evict_cached(len(manager.pool.blocks), where=lambda b: b.group_id == group) > 0
    assert manager.find_prefix_hit(PROMPT).num_full_blocks == 0  # attention blocks cached, no snapshot left
    assert list(engine.generate_tokens(PROMPT, PARAMS)) == expected
    assert engine.last_stats.cached_prompt_tokens == 32
    stats = pool.block_stats()
    assert stats["tier"]["secondary"]["hits_memory"] == 1  # the snapshot alone: the 8 blocks never left
    pool.check_invariants()
