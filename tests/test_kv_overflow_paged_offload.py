"""--kv-overflow offload on the paged backend: h2o's pages copied to host memory, restored when their 8-bit key
proxy says the current queries attend them.

Checked here: the offloaded pages are bit-exact copies and come back bit-exact into a new block, in their table
entry, never cached; a crafted query attending an offloaded page restores it; the host store is freed with the
sequence (released or preempted), a fork shares it, and the pool's free blocks return to their start value.
Offload's logits against h2o's on the real model: tests/test_kv_overflow_real.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from test_kv_overflow_paged import PROMPT, model, overflow_state, pool_for, step_logits  # noqa: F401  (fixture)

from mlxkv.config import KvOverflowConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import CacheRequest
from mlxkv.kv.paged import PagedLayerCache

OFFLOAD = KvOverflowConfig("offload", budget=24, sinks=2, recent=4)


def page_rows(pool, layer, block, bs=4):
    """K and V of pool block ``block`` in ``layer``: ``(n_kv, bs, D)`` each."""
    kp, vp = pool.paged.storage.pages(layer)
    return kp[:, block], vp[:, block]


def decode(model, seq, n, token=5):
    """``n`` more greedy decode steps of ``seq`` from ``token``."""
    for _ in range(n):
        seq.feed([token])
        token = int(mx.argmax(model(mx.array([[token]], dtype=mx.uint32), cache=seq.caches)[0, -1]).item())
        seq.commit()


def paged_layers(seq):
    return [c.layer for c in seq.caches if isinstance(c, PagedLayerCache)]


def test_a_budget_above_the_context_is_the_plain_paged_cache(model):
    plain, plain_tokens = step_logits(model, pool_for(model).open(prompt=PROMPT), PROMPT, 8)
    pool = pool_for(model, KvOverflowConfig("offload", budget=512))
    seq = pool.open(prompt=PROMPT)
    ours, tokens = step_logits(model, seq, PROMPT, 8)
    assert tokens == plain_tokens and mx.array_equal(ours, plain).item()
    assert overflow_state(seq).evicted == 0 and not len(overflow_state(seq).host)


def test_offloaded_pages_round_trip_bit_exact_and_are_never_cached(model):
    plain_pool = pool_for(model)
    plain = plain_pool.open(prompt=PROMPT)
    step_logits(model, plain, PROMPT, 0)  # the prompt's K/V with the full context
    plain_table = plain_pool.paged.manager.block_tables(plain.paged.seq_id)[0]
    pool = pool_for(model, OFFLOAD)
    seq = pool.open(prompt=PROMPT)
    step_logits(model, seq, PROMPT, 0)  # the prefill's commit offloads the pages past the budget
    state = overflow_state(seq)
    assert state.dropped and set(state.host.pages) == state.dropped
    layers = paged_layers(seq)
    for entry, per in state.host.pages.items():  # the host copies are the plain cache's pages, every layer
        assert sorted(per) == layers
        for layer, (k, v) in per.items():
            pk, pv = page_rows(plain_pool, layer, plain_table[entry])
            assert np.array_equal(k, np.array(pk)) and np.array_equal(v, np.array(pv))
    entry = min(state.dropped)
    free, restored = pool.paged.manager.pool.num_free_blocks, state.restored
    state.host.picks = lambda *_: [(entry, 1.0)]  # what a passing estimate returns, once
    assert state.evict(seq.paged, seq.paged.num_committed)
    del state.host.picks
    seq.paged._changed()
    table = pool.paged.manager.block_tables(seq.paged.seq_id)[0]
    assert entry not in state.dropped and entry not in state.host.pages and table[entry] != 0
    assert state.kept_tokens(40) <= 24 and state.restored == restored + 1  # another page made room for it
    assert pool.paged.manager.pool.num_free_blocks == free  # one block taken, the evicted page's one freed
    for layer in layers:
        k, v = page_rows(pool, layer, table[entry])
        pk, pv = page_rows(plain_pool, layer, plain_table[entry])
        assert mx.array_equal(k, pk).item() and mx.array_equal(v, pv).item()
    assert not pool.paged.manager.pool.blocks[table[entry]].cached
    assert pool.block_stats()["kv_blocks"]["overflow_restored"] == state.restored
    pool.check_invariants()
    decode(model, seq, 4)  # decoding goes on over the restored page
    pool.check_invariants()
    hit = pool.open(prompt=PROMPT, cache_request=CacheRequest(overflow=KvOverflowConfig("preempt")))
    assert hit.num_cached == 36  # the prompt's blocks cached before the first eviction, nothing later


def test_a_query_attending_an_offloaded_page_restores_it(model):
    pool = pool_for(model, OFFLOAD)
    seq = pool.open(prompt=PROMPT)
    step_logits(model, seq, PROMPT, 2)
    state = overflow_state(seq)
    entry, restored = sorted(state.dropped)[len(state.dropped) // 2], state.restored
    layer = next(c for c in seq.caches if isinstance(c, PagedLayerCache))
    seq.feed([5])
    k, v = layer.update_and_fetch(mx.random.normal((1, 2, 1, 16), key=mx.random.key(1)),
                                  mx.random.normal((1, 2, 1, 16), key=mx.random.key(2)))
    hk = mx.array(state.host.pages[entry][layer.layer][0])  # (n_kv, bs, D) the page's keys
    q = mx.repeat(hk[:, 1], 2, axis=0)[None, :, None] * 8.0  # (1, 4, 1, 16): each head aims at the page's row 1
    mx.eval(layer.attend(q, k, v, 0.25))
    seq.commit()
    assert entry not in state.dropped and state.restored == restored + 1
    assert pool.paged.manager.block_tables(seq.paged.seq_id)[0][entry] != 0
    pool.check_invariants()


def test_a_query_attending_no_offloaded_page_restores_none(model):
    pool = pool_for(model, OFFLOAD)
    seq = pool.open(prompt=PROMPT)
    step_logits(model, seq, PROMPT, 2)
    state = overflow_state(seq)
    dropped, restored = set(state.dropped), state.restored
    layer = next(c for c in seq.caches if isinstance(c, PagedLayerCache))
    seq.feed([5])
    new_k = mx.random.normal((1, 2, 1, 16), key=mx.random.key(3))
    new_k = new_k * 12 / mx.linalg.norm(new_k, axis=-1, keepdims=True)  # longer than the model's keys (~10)
    k, v = layer.update_and_fetch(new_k, mx.random.normal((1, 2, 1, 16), key=mx.random.key(4)))
    q = mx.repeat(new_k[0, :, 0], 2, axis=0)[None, :, None] * 4.0  # (1, 4, 1, 16): aims at the new row
    mx.eval(layer.attend(q, k, v, 0.25))
    seq.commit()
    assert state.restored == restored and state.dropped >= dropped


def test_host_pages_are_freed_with_the_sequence_and_a_fork_shares_them(model):
    pool = pool_for(model, OFFLOAD)
    start = pool.paged.manager.pool.num_free_blocks
    seq = pool.open(prompt=PROMPT)
    step_logits(model, seq, PROMPT, 2)
    state = overflow_state(seq)
    (child,) = pool.fork(seq.id, 1)
    twin = overflow_state(child)
    assert twin.host is not state.host and set(twin.host.pages) == set(state.host.pages)
    entry = min(state.dropped)
    assert all(twin.host.pages[entry][layer][0] is state.host.pages[entry][layer][0] for layer in paged_layers(seq))
    twin.host.take(entry)  # the child's store changes, not the parent's
    assert entry in state.host.pages
    assert pool.block_stats()["kv_blocks"]["overflow_host_bytes"] > 0
    pool.release(seq.id)
    assert not len(state.host) and len(twin.host)
    pool.release(child.id)
    assert not len(twin.host) and pool.block_stats()["kv_blocks"]["overflow_host_bytes"] == 0
    assert pool.paged.manager.pool.num_free_blocks == start
    pool.check_invariants()


def test_preemption_and_forks_under_offload_free_every_block(model):
    """n=2 forks, a pool too small for three contexts preempts (a preempted sequence's host pages go with its
    blocks, its prefill starts over); every block is free again at the end."""
    pool = pool_for(model, KvOverflowConfig("offload", budget=64, sinks=2, recent=8), num_blocks=40)
    start = pool.paged.manager.pool.num_free_blocks
    engine = BatchEngine(model, None, pool=pool, config=EngineConfig(max_sequences=4)).start()
    try:
        handles = [engine.submit(GenerationRequest([t + k for t in PROMPT], SamplingParams(max_tokens=40, temp=0),
                                                   n=2 if k == 0 else 1)) for k in range(3)]
        results = [[e for e in h] for h in handles]
        stats = engine.stats()
    finally:
        engine.stop()
    for events in results:
        assert events[-1].kind == "done", events[-1]
    assert stats["preemptions"] > 0, stats
    assert pool.paged.manager.pool.num_free_blocks == start and pool.paged.overflow_host_bytes() == 0
    pool.check_invariants()
