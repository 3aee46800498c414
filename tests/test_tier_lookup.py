"""One prefix lookup per prompt: ``tier_ready`` hashes a queued prompt's blocks and searches the pool once, saying how
much of its hit is on disk (read ahead meanwhile, then brought back a slice per step); the open takes that lookup,
so the restore and the block manager's open hash nothing again and search again only where the pool's cache
changed in between."""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from mlxkv.config import KvCacheConfig
from mlxkv.kv.tier import bridge as tier_bridge
from mlxkv.kv.store import CachePool
from testkit.pool_runs import prefill_and_release

B = 4
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(42)]  # 10 full blocks, all usable by a hit
LONGER = PROMPT + [(5 * i + 1) % 900 + 10 for i in range(20)]  # PROMPT's blocks, then 5 more


def pool_for(model, folder):
    config = KvCacheConfig(backend="paged", block_size=B, secondary_disk_dir=str(folder), secondary_disk_bytes=1 << 24)
    return CachePool(model, max_sequences=2, backend="paged", kv_config=config, num_blocks=64)


def counted(pool) -> dict:
    """Count the block hashes the pool computes and the prefix searches it runs (every caller: tier and manager)."""
    manager = pool.paged.manager
    counts = {"hashed": 0, "searched": 0}
    hash_fn, find = manager.hash_fn, manager.tables.find

    def counting_hash(*args):
        counts["hashed"] += 1
        return hash_fn(*args)

    def counting_find(*args, **kwargs):
        counts["searched"] += 1
        return find(*args, **kwargs)

    manager.hash_fn = manager.tables.hash_fn = counting_hash
    manager.tables.find = counting_find
    return counts


def wait_ready(pool, prompt) -> None:
    deadline = time.monotonic() + 30
    while not pool.tier_ready(prompt):
        assert time.monotonic() < deadline, "the disk reads never finished"
        pool.wait_tier_reads(0.5)


def test_a_disk_tier_hit_is_hashed_once_and_read_off_the_caller(model, tmp_path):
    first = pool_for(model, tmp_path)
    reference, _ = prefill_and_release(first, PROMPT)
    assert first.flush_tier(10)["on_disk"] == 10
    restarted = pool_for(model, tmp_path)  # a restart: the primary pool is empty, the blocks are on disk
    counts = counted(restarted)
    ahead, opened = restarted.paged.tier.tier.ahead, threading.Event()
    read = ahead._read
    ahead._read = lambda key: opened.wait(30) and read(key)  # the reads wait for the checks below

    assert restarted.tier_ready(PROMPT) is False  # its blocks are being read on the read-ahead thread
    (lookup,) = restarted.paged.tier.lookups._kept.values()
    assert (lookup.first, lookup.length, lookup.host_blocks, len(lookup.disk_keys)) == (0, 10, 0, 10)
    opened.set()
    wait_ready(restarted, PROMPT)
    assert counts == {"hashed": 10, "searched": 1}  # asking again while reading reuses the lookup

    seq = restarted.open(prompt=PROMPT)
    assert seq.num_cached == 40
    # the restore took the lookup's hit and plan as they were and extended the hit; the open took both
    assert counts == {"hashed": 10, "searched": 1}
    assert len(restarted.paged.tier.lookups) == 0
    manager = restarted.paged.manager  # the blocks a search finds now are the ones the open took
    found = [b.block_id for b in manager.find_prefix_hit(PROMPT).blocks[0]]
    assert manager.block_tables(seq.paged.seq_id)[0][:10] == found
    logits = model(mx.array(PROMPT[40:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]
    assert mx.array_equal(logits, reference).item()
    secondary = restarted.block_stats()["tier"]["secondary"]
    assert secondary["hits_disk"] == 10 and secondary["disk"]["read_ahead"]["blocks"] == 10


def test_a_primary_hit_is_looked_up_once(model, tmp_path):
    pool = pool_for(model, tmp_path)
    prefill_and_release(pool, PROMPT)
    counts = counted(pool)
    assert pool.tier_ready(PROMPT) is True  # every block in the pool: nothing to read
    seq = pool.open(prompt=PROMPT)
    assert seq.num_cached == 41 and counts == {"hashed": 10, "searched": 1}  # 10 blocks and 1 token of the 11th


def test_a_lookup_made_before_the_pool_changed_is_searched_again(model, tmp_path):
    pool = pool_for(model, tmp_path)
    assert pool.tier_ready(LONGER) is True  # looked up while the pool held nothing
    prefill_and_release(pool, PROMPT)  # another request caches LONGER's first 10 blocks meanwhile
    counts = counted(pool)
    seq = pool.open(prompt=LONGER)
    assert seq.num_cached == 42  # PROMPT's 10 blocks and its last 2 tokens: the stale lookup was not taken as it was
    assert counts == {"hashed": 0, "searched": 1}


def test_a_long_disk_hit_comes_back_a_slice_per_step(model, tmp_path, monkeypatch):
    monkeypatch.setattr(tier_bridge, "RESTORE_SLICE_TOKENS", 4 * B)  # 4 blocks a step
    first = pool_for(model, tmp_path)
    reference, _ = prefill_and_release(first, PROMPT)
    first.flush_tier(10)
    restarted = pool_for(model, tmp_path)
    bridge = restarted.paged.tier
    counts = counted(restarted)
    slices: list[int] = []
    restore_blocks = bridge.restore_blocks

    def recording(tokens, ctx, hashes, hit_blocks, held, wanted, **kw):
        slices.append(len(wanted))
        return restore_blocks(tokens, ctx, hashes, hit_blocks, held, wanted, **kw)

    bridge.restore_blocks = recording
    wait_ready(restarted, PROMPT)
    assert slices == [4, 4, 2]  # each step the prompt waited brought 4 blocks back; the others decode between
    seq = restarted.open(prompt=PROMPT)
    assert slices == [4, 4, 2] and seq.num_cached == 40 and counts == {"hashed": 10, "searched": 1}
    logits = model(mx.array(PROMPT[40:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]
    assert mx.array_equal(logits, reference).item()
    tier = restarted.block_stats()["tier"]
    assert (tier["prompt_blocks"], tier["primary_hit_blocks"], tier["secondary_hit_blocks"]) == (10, 0, 10)


def test_a_slice_comes_back_while_later_blocks_are_still_read(model, tmp_path, monkeypatch):
    """The read-ahead reads the hit's blocks in order; a slice whose blocks are read comes back at once, while the
    thread still reads later ones (their reads held here until the first slice is in the pool)."""
    monkeypatch.setattr(tier_bridge, "RESTORE_SLICE_TOKENS", 4 * B)
    first = pool_for(model, tmp_path)
    reference, _ = prefill_and_release(first, PROMPT)
    first.flush_tier(10)
    restarted = pool_for(model, tmp_path)
    bridge, ahead = restarted.paged.tier, restarted.paged.tier.tier.ahead
    slices: list[int] = []
    restore_blocks = bridge.restore_blocks
    bridge.restore_blocks = lambda *a, **kw: slices.append(len(a[5])) or restore_blocks(*a, **kw)
    read, held, reads = ahead._read, threading.Event(), []

    def slow_after_four(key):
        reads.append(key)
        if len(reads) > 4:
            held.wait(30)
        return read(key)

    ahead._read = slow_after_four
    deadline = time.monotonic() + 30
    while not slices:
        assert restarted.tier_ready(PROMPT) is False and time.monotonic() < deadline
        restarted.wait_tier_reads(0.05)
    (lookup,) = bridge.lookups._kept.values()
    assert slices == [4] and ahead.pending(lookup.disk_keys[4:])  # the rest is still being read
    held.set()
    wait_ready(restarted, PROMPT)
    seq = restarted.open(prompt=PROMPT)
    assert slices == [4, 4, 2] and seq.num_cached == 40
    logits = model(mx.array(PROMPT[40:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]
    assert mx.array_equal(logits, reference).item()
