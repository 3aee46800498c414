"""A paged pool whose page arrays grow in chunks as blocks are needed and give chunks back when idle: the budget
stays the capacity everyone counts, cached content is kept exactly as long as in a pool allocated whole, logits
equal dense attention across growth and release, and a release evicts through the usual path (hooks, events,
the secondary tier)."""

import random

import mlx.core as mx
import pytest
from testkit.archs import build_from_config, build_model, get_config

from mlxkv.config import KvCacheConfig
from mlxkv.kv.blocks import KVCacheManager
from mlxkv.kv.blocks.block_pool import BlockPool
from mlxkv.kv.blocks.events import BlockRemoved
from mlxkv.kv.layouts import install_attention_hook, make_caches
from mlxkv.kv.store import CachePool

BS = 4
PROMPTS = [[(7 * i + 3 * k) % 900 + 10 for i in range(n)] for k, n in enumerate((21, 45, 70, 33))]


def scale_close(a, b, tol=1e-5):
    return mx.abs(a - b).max().item() <= tol * max(1.0, mx.abs(b).max().item())


# ---- the block pool alone ------------------------------------------------------------------------------------
def test_a_growing_pool_counts_its_budget_and_backs_ids_in_chunks():
    sizes = []
    pool = BlockPool(100, BS, initial_blocks=1, grow_blocks=8)
    pool.add_resize_hook(sizes.append)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.allocated, pool.stats().allocated) == (99, 0, 1, 0)
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [1, 2, 3] and sizes == [9]  # one chunk of 8 behind the null block
    more = pool.get_new_blocks(10)  # 5 left in the chunk: grows by max(5, 8, 9 // 4) = 8
    assert sizes == [9, 17] and max(b.block_id for b in more) < 17
    assert (pool.num_free_blocks, pool.num_used_blocks) == (86, 13)
    pool.get_new_blocks(80)  # 3 left: grows by exactly what is short (77, more than a chunk or a quarter)
    assert pool.allocated == 94 and pool.num_free_blocks == pool.num_reserve_blocks == 6
    pool.get_new_blocks(1)  # a quarter of 94 is more than the 6 the budget has left: capped
    assert pool.allocated == 100 and pool.num_reserve_blocks == 0 and pool.num_free_blocks == 5
    pool.check_invariants()


def _run(manager, prompts, rng):
    """Open, fill and release sequences in a random order; each step's prefix hit (tokens) and eviction count."""
    trace = []
    for _ in range(60):
        prompt = rng.choice(prompts)
        res = manager.open(prompt)
        manager.allocate_slots(res.seq_id, len(prompt) - res.num_cached_tokens)
        manager.commit(res.seq_id)
        trace.append((res.num_cached_tokens, manager.pool.num_evictions))
        manager.free(res.seq_id)
    return trace


def test_growth_keeps_cached_content_exactly_as_a_pool_allocated_whole():
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(5, 60))] for _ in range(12)]
    whole = KVCacheManager(40, BS, hash_algo="builtin")
    growing = KVCacheManager(40, BS, hash_algo="builtin", initial_blocks=1, grow_blocks=3)
    assert _run(whole, prompts, random.Random(1)) == _run(growing, prompts, random.Random(1))
    assert growing.pool.allocated == 40 and growing.pool.num_evictions > 0  # it filled its budget, then evicted
    growing.check_invariants()


def test_release_tail_evicts_through_hooks_and_events_and_keeps_held_blocks():
    pool = BlockPool(64, BS, initial_blocks=1, grow_blocks=8)
    evicted, sizes = [], []
    pool.add_evict_hook(lambda b: evicted.append(b.block_id))
    pool.add_resize_hook(sizes.append)
    blocks = pool.get_new_blocks(20)  # ids 1..20: one growth of 20
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, group_id=0, block_hash=i, parent_hash=None, parent_ref=None,
                              token_ids=[i] * BS, extra_keys=())
    held = blocks[9]  # block 10 stays held: nothing at or below it is given back
    pool.free_blocks([b for b in blocks if b is not held])
    cursor = pool.events.last_seq
    assert pool.release_tail(keep=9) == 10
    assert pool.allocated == 11 and sizes[-1] == 11
    assert sorted(evicted) == list(range(11, 21))
    removed = [e for _, e in pool.events.read(cursor).events if isinstance(e, BlockRemoved)]
    assert sorted(e.block_hashes[0] for e in removed) == list(range(10, 20))
    assert pool.lookup(0, 3) and not pool.lookup(0, 15)  # content below the cut is still cached
    assert pool.num_free_blocks == 63 - 1 and pool.stats().allocated == 10
    pool.free_blocks([held])
    assert pool.release_tail(keep=9) == 2 and pool.allocated == 9  # down to the reserve it keeps
    pool.check_invariants()
    again = pool.get_new_blocks(12)  # grows again, the same ids
    assert max(b.block_id for b in again) < pool.allocated <= 64
    pool.check_invariants()


# ---- the paged backend: page arrays follow the pool ------------------------------------------------------------
def _pool(model, **kv):
    return CachePool(model, backend="paged", num_blocks=120, max_sequences=4, grow_blocks=4,
                     kv_config=KvCacheConfig(backend="paged", block_size=BS, **kv))


def _generate(model, pool, prompt, steps=6):
    """Prefill ``prompt`` (from its prefix hit) and decode greedily; (cached tokens, every step's logits)."""
    seq = pool.open(prompt=prompt)
    cached = seq.num_cached
    logits = model(mx.array(prompt[cached:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]
    seq.commit()
    out = [logits]
    for _ in range(steps):
        tok = int(mx.argmax(logits).item())
        seq.feed([tok])
        logits = model(mx.array([[tok]], dtype=mx.uint32), cache=seq.caches)[0, -1]
        seq.commit()
        out.append(logits)
    pool.release(seq.id)
    return cached, out


def _dense(model, prompt, steps=6):
    caches = make_caches(model)
    logits = model(mx.array(prompt, dtype=mx.uint32)[None], cache=caches)[0, -1]
    out = [logits]
    for _ in range(steps):
        logits = model(mx.array([[int(mx.argmax(logits).item())]], dtype=mx.uint32), cache=caches)[0, -1]
        out.append(logits)
    return out


@pytest.fixture(scope="module")
def llama():
    model, _ = build_model("llama")
    install_attention_hook(model)
    return model


def test_logits_equal_dense_across_growth_release_and_regrowth(llama):
    pool = _pool(llama)
    paged = pool.paged
    storage = paged.storage
    assert paged.num_blocks == 120 and paged.allocated_blocks == 1  # nothing but the null block yet
    sizes = []
    for prompt in PROMPTS:
        cached, got = _generate(llama, pool, prompt)
        assert cached == 0
        assert all(scale_close(g, d) for g, d in zip(got, _dense(llama, prompt)))
        sizes.append(paged.allocated_blocks)
    assert sizes == sorted(sizes) and len(set(sizes)) >= 3 and sizes[-1] < 120  # grew in several chunks
    assert storage.k_rows[0].shape[2] == sizes[-1] * BS
    cached, got = _generate(llama, pool, PROMPTS[0])  # written before three growths: still a hit, still exact
    assert cached == len(PROMPTS[0]) - 1 and all(scale_close(g, d) for g, d in zip(got, _dense(llama, PROMPTS[0])))
    before = mx.get_active_memory()
    released = pool.release_unused()
    assert released > 0 and paged.allocated_blocks == 1 + paged.grow_blocks == 5
    assert storage.k_rows[0].shape[2] == 5 * BS and storage.nbytes() == 5 * paged.bytes_per_block
    assert mx.get_active_memory() < before  # the page arrays' memory is given back, not only the count
    pool.check_invariants()
    for prompt in PROMPTS[::-1]:  # the blocks given back held these prompts: computed again, exactly
        cached, got = _generate(llama, pool, prompt)
        assert cached < len(PROMPTS[0])
        assert all(scale_close(g, d) for g, d in zip(got, _dense(llama, prompt)))
    assert paged.allocated_blocks > 5
    pool.check_invariants()


def test_idle_release_waits_for_the_period_and_for_every_sequence_to_close(llama):
    pool = _pool(llama, idle_release_s=0.05)
    assert pool.release_due_in() is None  # nothing above the first chunk yet
    seq = pool.open(prompt=PROMPTS[2])
    mx.eval(llama(mx.array(PROMPTS[2], dtype=mx.uint32)[None], cache=seq.caches))
    seq.commit()
    assert pool.paged.allocated_blocks > 5 and pool.release_due_in() is None  # a sequence is open
    pool.release(seq.id)
    assert 0 < pool.release_due_in() <= 0.05
    preallocated = _pool(llama, preallocate=True)
    assert preallocated.paged.allocated_blocks == 120 and preallocated.release_due_in() is None
    assert preallocated.block_stats()["kv_blocks"]["preallocated"] is True


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_pages_grow_and_shrink_with_the_same_logits_as_a_preallocated_pool(kv_bits):
    config = get_config("llama")
    config.update(hidden_size=128)  # head_dim 32: quantization groups need at least 32
    llama = build_from_config(config)[0]
    install_attention_hook(llama)
    growing = _pool(llama, kv_bits=kv_bits, kv_group_size=32)
    whole = _pool(llama, kv_bits=kv_bits, kv_group_size=32, preallocate=True)
    for prompt in [*PROMPTS, PROMPTS[1]]:
        a, b = _generate(llama, growing, prompt, 3), _generate(llama, whole, prompt, 3)
        assert a[0] == b[0] and all(scale_close(x, y) for x, y in zip(a[1], b[1]))
    assert 1 < growing.paged.allocated_blocks < 120 and growing.release_unused() > 0
    assert growing.paged.storage.k_rows[0][0].shape[2] == 5 * BS  # every plane shrank
    a, b = _generate(llama, growing, PROMPTS[2], 3), _generate(llama, whole, PROMPTS[2], 3)
    assert all(scale_close(x, y) for x, y in zip(a[1], b[1]))


def test_a_release_offloads_cached_blocks_to_the_host_tier_and_they_come_back(llama):
    pool = _pool(llama, secondary_memory_bytes=1 << 24, hash_algo="sha256")
    _, first = _generate(llama, pool, PROMPTS[2])
    assert pool.paged.allocated_blocks > 5
    stored = pool.paged.tier_stats()["secondary"]["stored_memory"]
    assert pool.release_unused() > 0
    assert pool.paged.tier_stats()["secondary"]["stored_memory"] > stored  # offloaded, not dropped
    cached, again = _generate(llama, pool, PROMPTS[2])
    assert cached == len(PROMPTS[2]) // BS * BS  # its full blocks restored from the host tier into new pages
    assert all(scale_close(a, b) for a, b in zip(again, first))
    pool.check_invariants()
