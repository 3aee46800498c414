"""The secondary tier attached by configuration: KvCacheConfig's ``secondary_*`` fields make a paged
CachePool offload evicted blocks and restore them on ``open``; a fresh pool over the same disk folder (a
"restart") gets its first request's prefix from disk with the logits of a never-evicted run."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.config import DEFAULT_SECONDARY_DISK_BYTES, KvCacheConfig
from mlxkv.kv.store import CachePool
from testkit.pool_runs import prefill_and_release

B = 4
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(42)]  # 10 full usable blocks
OTHER = [(11 * i + 5) % 900 + 10 for i in range(44)]  # 11 blocks: evicts all of a 12-block pool



def pool_for(model, num_blocks=12, **secondary):
    config = KvCacheConfig(backend="paged", block_size=B, **secondary)
    return CachePool(model, max_sequences=2, backend="paged", kv_config=config, num_blocks=num_blocks)




def test_config_fields_are_validated():
    c = KvCacheConfig(backend="paged", secondary_disk_dir="/tmp/x")
    assert c.secondary_enabled and c.secondary_disk_cap == DEFAULT_SECONDARY_DISK_BYTES
    assert not KvCacheConfig().secondary_enabled and KvCacheConfig().secondary_disk_cap == 0
    for bad in ({"secondary_memory_bytes": -1}, {"secondary_disk_bytes": True},
                {"secondary_disk_bytes": 1 << 20}, {"secondary_disk_dir": ""}, {"secondary_disk_dir": 3}):
        with pytest.raises(ValueError, match="secondary_"):
            KvCacheConfig(backend="paged", **bad)


def test_no_tier_without_config(model):
    pool = pool_for(model)
    assert pool.paged.tier is None
    prefill_and_release(pool, PROMPT)
    s = pool.paged.tier_stats()
    assert s["enabled"] is False and s["prompt_tokens"] == len(PROMPT) and s["secondary"] is None


def test_restart_gets_a_disk_hit_with_never_evicted_logits(model, tmp_path):
    reference, cached = prefill_and_release(pool_for(model, num_blocks=64), PROMPT)  # cold, never evicted
    assert cached == 0
    disk = {"secondary_disk_dir": str(tmp_path), "secondary_disk_bytes": 1 << 22}
    first = pool_for(model, **disk)
    assert first.paged.tier is not None and first.paged.tier.tier.disk is not None
    cold, cached = prefill_and_release(first, PROMPT)
    assert cached == 0 and mx.array_equal(cold, reference).item()
    assert first.paged.flush_cached() >= 10  # evict everything: offloaded to disk (by the write-behind thread)
    assert first.flush_tier(10)["lost"] == 0
    assert first.paged.manager.find_prefix_hit(PROMPT).num_full_blocks == 0
    assert first.paged.tier_stats()["secondary"]["disk"]["blocks"] >= 10

    restarted = pool_for(model, **disk)  # a new process: fresh pool and pages, same folder
    logits, cached = prefill_and_release(restarted, PROMPT)
    assert cached == 40  # every usable full block came from disk on the first request
    assert mx.array_equal(logits, reference).item()
    s = restarted.paged.tier_stats()
    assert s["enabled"] and s["primary_hit_blocks"] == 0 and s["secondary_hit_blocks"] == 10
    assert s["secondary"]["hits_disk"] == 10
    again, cached = prefill_and_release(restarted, PROMPT)  # now a primary hit (plus the partial last block)
    assert cached == 41  # one-token forward: float32 rounding differs from the multi-token reference
    assert mx.abs(again - reference).max().item() <= 1e-5 * max(1.0, mx.abs(reference).max().item())
    s = restarted.paged.tier_stats()
    assert s["primary_hit_blocks"] == 10 and s["secondary_hit_blocks"] == 10


def test_memory_tier_by_config_restores_after_eviction(model):
    reference, _ = prefill_and_release(pool_for(model, num_blocks=64), PROMPT)
    pool = pool_for(model, secondary_memory_bytes=1 << 22)
    assert pool.paged.tier.tier.disk is None
    prefill_and_release(pool, PROMPT)
    prefill_and_release(pool, OTHER)  # evicts PROMPT's blocks into host memory
    assert pool.paged.manager.find_prefix_hit(PROMPT).num_full_blocks < 10
    logits, cached = prefill_and_release(pool, PROMPT)
    assert cached == 40 and mx.array_equal(logits, reference).item()
    assert pool.paged.tier_stats()["secondary"]["hits_memory"] >= 1
