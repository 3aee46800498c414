"""Write-behind: cached blocks reach the disk tier without being evicted (a background writer, a bounded and
coalesced queue), so a fresh pool over the same folder (a restart) hits them; the engine flushes at stop."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from mlxkv.config import EngineConfig, KvCacheConfig
from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.store import CachePool
from mlxkv.kv.tier.format import TierBlock
from mlxkv.kv.tier.write_behind import WriteBehind
from testkit.pool_runs import prefill_and_release

B = 4
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(42)]  # 10 full usable blocks


def pool_for(model, folder, num_blocks=64, **kw):
    config = KvCacheConfig(backend="paged", block_size=B, secondary_disk_dir=str(folder),
                           secondary_disk_bytes=1 << 24, **kw)
    return CachePool(model, max_sequences=2, backend="paged", kv_config=config, num_blocks=num_blocks)




def test_cached_blocks_are_written_behind_and_a_restart_hits_them(model, tmp_path):
    first = pool_for(model, tmp_path)
    reference, cached = prefill_and_release(first, PROMPT)
    assert cached == 0
    bridge = first.paged.tier
    assert bridge.writer is not None and bridge.due_in() is not None  # blocks are pending
    assert first.persist_tier() == 0  # not due yet: the sweep waits for the interval
    assert bridge.persist(force=True) == 10
    assert bridge.writer.flush(10)
    assert first.paged.manager.pool.stats().evictions == 0  # nothing was evicted: written behind
    assert bridge.persist(force=True) == 0  # coalesced: a block is written once
    s = first.block_stats()["tier"]["secondary"]
    assert s["disk"]["blocks"] == 10 and s["writes"] == 10 and s["drops"]["queue_full"] == 0

    restarted = pool_for(model, tmp_path)
    logits, cached = prefill_and_release(restarted, PROMPT)
    assert cached == 40 and mx.array_equal(logits, reference).item()
    assert restarted.block_stats()["tier"]["secondary"]["hits_disk"] == 10


def test_blocks_below_the_priority_threshold_are_not_written(model, tmp_path):
    pool = pool_for(model, tmp_path, secondary_offload_min_priority=50)  # default retention is 35
    prefill_and_release(pool, PROMPT)
    assert pool.flush_tier(10) == {"written": 0, "lost": 0, "on_disk": 0, "seconds": pytest.approx(0, abs=5)}
    assert not list(tmp_path.glob("*.mlxkvblk"))


def test_write_interval_zero_turns_write_behind_off(model, tmp_path):
    pool = pool_for(model, tmp_path, secondary_write_interval_s=0)
    prefill_and_release(pool, PROMPT)
    assert pool.paged.tier.writer is None and pool.tier_due_in() is None
    with pytest.raises(ValueError, match="secondary_write_interval_s"):
        KvCacheConfig(backend="paged", secondary_write_interval_s=-1)


def test_engine_stop_flushes_the_tier_and_the_restart_is_warm(model, tmp_path):
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=2), pool=pool_for(model, tmp_path)).start()
    handle = engine.submit(GenerationRequest(PROMPT, SamplingParams(temp=0.0, max_tokens=3)))
    while not handle.get(timeout=60).terminal:
        pass
    engine.stop(flush_timeout=10)
    assert engine.last_flush["written"] >= 10 and engine.last_flush["lost"] == 0
    assert len(list(tmp_path.glob("*.mlxkvblk"))) >= 10
    restarted = pool_for(model, tmp_path)
    assert prefill_and_release(restarted, PROMPT)[1] == 40


def test_the_idle_engine_writes_behind_after_the_interval(model, tmp_path):
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=2), pool=pool_for(model, tmp_path, secondary_write_interval_s=0.2)).start()
    try:
        handle = engine.submit(GenerationRequest(PROMPT, SamplingParams(temp=0.0, max_tokens=2)))
        while not handle.get(timeout=60).terminal:
            pass
        deadline = time.monotonic() + 10
        while len(list(tmp_path.glob("*.mlxkvblk"))) < 10:  # no request, no stop: the idle engine's sweep
            assert time.monotonic() < deadline, "write-behind did not run while idle"
            time.sleep(0.05)
    finally:
        engine.stop()


class _SlowTier:
    """A tier whose disk writes wait for a gate (the writer thread blocks inside one)."""

    def __init__(self):
        self.disk = object()
        self.gate = threading.Event()
        self.written: list[bytes] = []

    def store_on_disk(self, block):
        self.gate.wait(10)
        self.written.append(block.block_hash)
        return True


def _block(i: int, nbytes: int = 64) -> TierBlock:
    import numpy as np

    a = np.zeros(nbytes // 4, dtype=np.float32).reshape(1, 1, -1)
    return TierBlock(block_hash=bytes([i]) * 32, parent_hash=None, group_id=0, layers=(0,), token_ids=(i,),
                     extra_digest="", priority=35, arrays=[a, a], dtypes=["float32", "float32"])


def test_the_queue_is_bounded_coalesced_and_flushed():
    tier = _SlowTier()
    size = _block(0).nbytes
    writer = WriteBehind(tier, max_bytes=2 * size)
    try:
        assert writer.offer(_block(1))
        deadline = time.monotonic() + 5
        while writer.pending() != (1, size) or writer.room() != size:  # the writer took block 1 and waits
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert writer.offer(_block(2)) and writer.offer(_block(2)) and writer.coalesced == 1
        assert writer.offer(_block(3)) is False  # full: refused at once, the engine never waits
        assert not writer.flush(0.1)  # still blocked
        tier.gate.set()
        assert writer.flush(5) and tier.written == [bytes([1]) * 32, bytes([2]) * 32]
        assert writer.pending() == (0, 0) and writer.room() == 2 * size
    finally:
        tier.gate.set()
        assert writer.close() == 0


def test_a_block_evicted_before_its_file_is_written_is_restored_from_the_queue(model, tmp_path):
    """Eviction hands a block to the writer; a restore in the meantime reads it from the queue (or from the
    writer's hands), not from a file that does not exist yet."""
    pool = pool_for(model, tmp_path, num_blocks=12)
    tier = pool.paged.tier.tier
    gate, store = threading.Event(), tier.store_on_disk
    tier.store_on_disk = lambda block: gate.wait(10) and store(block)
    try:
        reference, cached = prefill_and_release(pool, PROMPT)
        other = [(11 * i + 5) % 900 + 10 for i in range(42)]  # 11 blocks: every free block, so PROMPT's are evicted
        prefill_and_release(pool, other)
        assert pool.paged.manager.find_prefix_hit(PROMPT).num_full_blocks == 0
        assert not list(tmp_path.glob("*.mlxkvblk"))  # nothing written yet: the writer waits at the gate
        logits, cached = prefill_and_release(pool, PROMPT)
        assert cached == 40 and mx.array_equal(logits, reference).item()
        assert pool.block_stats()["tier"]["secondary"]["hits_disk"] == 10
    finally:
        gate.set()
