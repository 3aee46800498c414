"""The disk tier for every layout: sliding-window (gemma3) and chunked (llama4) models restore, after a restart,
the blocks a hit needs (full-attention groups all of them, windowed groups only their window), and the restored
hit gives the logits of a hit on blocks that never left the pool."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.config import KvCacheConfig
from mlxkv.kv.blocks.specs import KVCacheGroupSpec
from mlxkv.kv.store import CachePool
from mlxkv.kv.tier.restore_plan import plan_restore
from testkit.pool_runs import prefill_and_release

B = 4
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(42)]  # 10 full usable blocks


@pytest.fixture(scope="module", params=["gemma3_text", "llama4"])
def arch_model(request):
    from testkit.archs import build_model

    from mlxkv.kv.layouts.attention_hook import install_attention_hook

    model, _ = build_model(request.param)
    install_attention_hook(model)
    return model


def pool_for(model, folder):
    config = KvCacheConfig(backend="paged", block_size=B, secondary_disk_dir=str(folder),
                           secondary_disk_bytes=1 << 26)
    return CachePool(model, max_sequences=2, backend="paged", kv_config=config, num_blocks=96)




def test_windowed_groups_restore_their_window_after_a_restart(arch_model, tmp_path):
    first = pool_for(arch_model, tmp_path)
    specs = first.paged.specs
    assert any(not s.is_full for s in specs) and any(s.is_full for s in specs)
    reference, cached = prefill_and_release(first, PROMPT)  # cold: the whole prompt forwarded
    assert cached == 0
    assert first.flush_tier(10)["lost"] == 0

    restarted = pool_for(arch_model, tmp_path)
    logits, cached = prefill_and_release(restarted, PROMPT)
    assert cached == 40
    # 2 tokens forwarded over restored K/V vs 42 over computed K/V: equal up to float32 summation order
    assert mx.abs(logits - reference).max().item() <= 1e-5 * max(1.0, mx.abs(reference).max().item())
    needed = sum(len(s.needed_blocks(40, B)) for s in specs)  # 10 per full group, the window's 2 per windowed
    s = restarted.block_stats()["tier"]
    assert s["secondary_hit_blocks"] == 10 and s["secondary"]["hits_disk"] == needed < 10 * len(specs)


def test_the_plan_restores_only_what_the_hit_needs():
    full, sliding = KVCacheGroupSpec("full"), KVCacheGroupSpec("sliding", window=8)
    everything = lambda g, i: True  # noqa: E731
    assert plan_restore([full, sliding], 4, 0, 10, everything, 100) == (10, sorted(
        [(i, 0) for i in range(10)] + [(8, 1), (9, 1)]))
    # the window's last block is missing at 10: the longest hit with its window in the tier is 9 blocks
    assert plan_restore([full, sliding], 4, 0, 10, lambda g, i: not (g == 1 and i == 9), 100)[0] == 9
    # a gap in the full group bounds the hit; the primary pool's first 3 blocks are not restored
    length, wanted = plan_restore([full], 4, 3, 10, lambda g, i: i != 6, 100)
    assert (length, wanted) == (6, [(3, 0), (4, 0), (5, 0)])
    assert plan_restore([full], 4, 0, 10, everything, 4)[0] == 4  # no more than the free blocks
    assert plan_restore([full], 4, 0, 10, lambda g, i: False, 100) == (0, [])
