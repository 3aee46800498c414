"""Secondary tier behind the paged backend: evicted blocks offload, a later prompt restores them into pages that
are bit-exact copies of the evicted ones, and the logits equal a never-evicted run's up to float32 rounding."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.config import KvCacheConfig
from mlxkv.kv.blocks.cache_request import CacheRequest
from mlxkv.kv.blocks.hashing import HashContext, extend_block_hashes
from mlxkv.kv.paged import PagedBackend
from mlxkv.kv.tier import DiskStore, HostMemoryStore, SecondaryTier, fingerprint_model
from mlxkv.kv.tier.bridge import TierBridge

pytestmark = pytest.mark.float_order

B = 4
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(22)]  # 5 full usable blocks
OTHER = [(11 * i + 5) % 900 + 10 for i in range(44)]  # 11 blocks: evicts all of a 12-block pool


def backend(model, num_blocks=12):
    return PagedBackend(model, KvCacheConfig(backend="paged", block_size=B), num_blocks=num_blocks)


def run(be, bridge, tokens, salt=None):
    """Open (restoring from the tier first), prefill the uncached rest, release; (last logits, cached)."""
    if bridge is not None:
        bridge.restore(tokens, salt)
    caches, seq = be.open(tokens, CacheRequest(salt=salt))
    cached = seq.num_cached
    logits = model_call(be.model, caches, tokens[cached:])
    seq.commit()
    be.release(seq)
    return logits, cached


def model_call(model, caches, tokens):
    out = model(mx.array(tokens, dtype=mx.uint32)[None], cache=caches)[0, -1]
    mx.eval(out)
    return out


def prefix_pages(be, tokens):
    """Copies of the K/V pages of the blocks ``tokens``' prefix hit finds, every written layer."""
    ids = [b.block_id for b in be.manager.find_prefix_hit(tokens).blocks[0]]
    pages = [p[:, ids] for layer in range(len(be.storage.k_rows)) if be.storage.allocated(layer)
             for p in be.storage.pages(layer)]  # (kv_heads, len(ids), B, D) each
    mx.eval(pages)
    return pages


def assert_same_pages(got, expected):
    """A restore copies bytes, so the pages hold the evicted K/V bit for bit under any BLAS."""
    assert len(got) == len(expected) and all(a.shape == b.shape and mx.array_equal(a, b).item()
                                             for a, b in zip(got, expected))


def assert_recomputed_close(logits, reference):
    """A run with a prefix hit forwards only the uncached tokens, where the never-evicted reference forwarded the
    whole prompt: a BLAS may block (so sum) a matmul of fewer rows differently. n reordered float32 terms round by
    at most n * eps (1.2e-7) relative; the test llama's longest sums are 128 terms: 1e-5 of the logit magnitude.
    The greedy token is the same."""
    assert mx.argmax(logits).item() == mx.argmax(reference).item()
    assert mx.abs(logits - reference).max().item() <= 1e-5 * max(1.0, mx.abs(reference).max().item())


def tier_for(model, tmp_path, memory_bytes, disk_bytes, min_priority=35):
    fp = fingerprint_model(model)
    disk = DiskStore(tmp_path, fp, disk_bytes, block_size=B) if disk_bytes else None
    mem = HostMemoryStore(memory_bytes) if memory_bytes else None
    return SecondaryTier(min_priority, memory=mem, disk=disk)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_evict_offload_restore_gives_never_evicted_logits(model, tmp_path, where):
    reference, _ = run(backend(model, num_blocks=64), None, PROMPT)  # cold, never evicted
    be = backend(model)
    bridge = TierBridge(be, tier_for(model, tmp_path, 1 << 20 if where == "memory" else 0,
                                     1 << 20 if where == "disk" else 0))
    cold, cached = run(be, bridge, PROMPT)
    assert cached == 0 and mx.array_equal(cold, reference).item()  # the same forward as the reference
    evicted = prefix_pages(be, PROMPT)
    run(be, bridge, OTHER)  # evicts PROMPT's blocks from the primary pool into the tier
    assert be.manager.find_prefix_hit(PROMPT).num_full_blocks == 0
    assert bridge.tier.counters.offered >= 5
    logits, cached = run(be, bridge, PROMPT)
    assert cached == 20  # all 5 usable full blocks came back from the tier
    assert_same_pages(prefix_pages(be, PROMPT), evicted)
    assert_recomputed_close(logits, reference)
    s = bridge.stats()
    assert s["secondary_hit_blocks"] == 5 and s["secondary"][f"hits_{where}"] == 5
    be.check_invariants()


def test_restart_restores_from_disk(model, tmp_path):
    reference, _ = run(backend(model, num_blocks=64), None, PROMPT)
    be = backend(model)
    bridge = TierBridge(be, tier_for(model, tmp_path, 0, 1 << 20))
    run(be, bridge, PROMPT)
    evicted = prefix_pages(be, PROMPT)
    run(be, bridge, OTHER)
    be2 = backend(model)  # a "restart": fresh pool and pages, same folder
    bridge2 = TierBridge(be2, tier_for(model, tmp_path, 0, 1 << 20))
    logits, cached = run(be2, bridge2, PROMPT)
    assert cached == 20
    assert_same_pages(prefix_pages(be2, PROMPT), evicted)
    assert_recomputed_close(logits, reference)


def test_low_priority_blocks_are_dropped_and_salt_is_respected(model, tmp_path):
    be = backend(model)
    bridge = TierBridge(be, tier_for(model, tmp_path, 1 << 20, 0, min_priority=36))  # default 35 < 36
    run(be, bridge, PROMPT)
    run(be, bridge, OTHER)
    assert bridge.tier.counters.dropped_low_priority >= 5 and len(bridge.tier.memory) == 0
    be = backend(model)
    bridge = TierBridge(be, tier_for(model, tmp_path, 1 << 20, 0))
    run(be, bridge, PROMPT, salt="tenant-a")
    run(be, bridge, OTHER)
    _, cached = run(be, bridge, PROMPT, salt="tenant-b")  # another salt: different chain, no hit
    assert cached == 0
    _, cached = run(be, bridge, PROMPT, salt="tenant-a")
    assert cached == 20


def test_corrupt_disk_block_stops_restore_and_is_recomputed(model, tmp_path, caplog):
    reference, _ = run(backend(model, num_blocks=64), None, PROMPT)
    be = backend(model)
    bridge = TierBridge(be, tier_for(model, tmp_path, 0, 1 << 20))
    run(be, bridge, PROMPT)
    run(be, bridge, OTHER)
    disk = bridge.tier.disk
    hashes = extend_block_hashes(be.manager.hash_fn, PROMPT, 20, B, HashContext(), [])
    path = disk.path_for((0, hashes[2]))  # the third block: restore must stop after two
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="mlxkv.kv.tier"):
        logits, cached = run(be, bridge, PROMPT)
    assert cached == 8 and "does not decrypt" in caplog.text and not path.exists()
    assert_recomputed_close(logits, reference)


def test_attach_tier_reads_the_config_threshold(model, tmp_path):
    from mlxkv.kv.tier.bridge import attach_tier

    be = PagedBackend(model, KvCacheConfig(backend="paged", block_size=B, secondary_offload_min_priority=50),
                      num_blocks=12)
    assert attach_tier(be) is None
    bridge = attach_tier(be, memory_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert bridge.tier.min_priority == 50 and bridge.tier.memory is not None and bridge.tier.disk is not None
    be_builtin = PagedBackend(model, KvCacheConfig(backend="paged", block_size=B, hash_algo="builtin"),
                              num_blocks=12)
    with pytest.raises(ValueError, match="process-stable"):
        attach_tier(be_builtin, disk_dir=str(tmp_path), disk_bytes=1 << 20)
