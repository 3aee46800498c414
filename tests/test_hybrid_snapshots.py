"""Prefix caching for recurrent hybrids (qwen3_next: gated delta-net; nemotron_h: Mamba-2) through recurrent-state
snapshots at block boundaries: greedy output with reuse equals output without, hits end at the deepest block
boundary with a snapshot, snapshots live in the pool's budget and leave it by its eviction order."""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.blocks import BlockPool, KVCacheManager
from mlxkv.kv.blocks.snapshots import StateSnapshotIndex
from mlxkv.kv.layouts import install_attention_hook
from mlxkv.kv.store import CachePool

BS = 4
PARAMS = SamplingParams(max_tokens=12)
SYSTEM = [(5 * i + 7) % 900 + 10 for i in range(26)]  # a shared "system prompt": 6 full blocks and 2 tokens
QUESTIONS = [[(13 * i + 3 * q) % 900 + 10 for i in range(7 + q)] for q in range(3)]
ARCHS = ["qwen3_next", "nemotron_h"]

#: Bytes of one snapshot (every recurrent layer's conv + SSM state, float32), computed from the configs:
#: qwen3_next: conv (1, 3, 2*2*16 + 4*16) + delta state (1, 4, 16, 16); nemotron_h: two Mamba-2 layers of
#: conv (1, 3, 64 + 2*16) + SSM state (1, 4, 16, 16).
SNAPSHOT_BYTES = {"qwen3_next": 4 * (3 * 128 + 4 * 16 * 16), "nemotron_h": 2 * 4 * (3 * 96 + 4 * 16 * 16)}


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request):
    model, _ = build_model(request.param)
    install_attention_hook(model)
    return request.param, model


def reference(model, prompt, params=PARAMS):
    """Greedy tokens without any reuse (dense caches)."""
    return list(DirectEngine(model, None, pool=CachePool(model, max_sequences=1)).generate_tokens(prompt, params))


def paged(model, num_blocks=300, interval=0, max_sequences=4):
    return CachePool(model, backend="paged", num_blocks=num_blocks, max_sequences=max_sequences,
                     kv_config=KvCacheConfig(backend="paged", block_size=BS, state_snapshot_interval=interval))


def test_snapshot_size_and_cost_are_measured(hybrid):
    arch, model = hybrid
    backend = paged(model).paged
    assert backend.snapshot_bytes == SNAPSHOT_BYTES[arch]
    assert backend.blocks_per_snapshot == -(-SNAPSHOT_BYTES[arch] // backend.bytes_per_block)
    assert backend.manager.snapshots is not None and backend.manager.pool.enable_caching


def test_repeated_prompt_resumes_at_the_last_block_boundary(hybrid):
    _, model = hybrid
    prompt = SYSTEM + QUESTIONS[0]  # 33 tokens: the snapshot sits at 32 = all but the last token
    expected = reference(model, prompt)
    pool = paged(model)
    engine = DirectEngine(model, None, pool=pool)
    assert list(engine.generate_tokens(prompt, PARAMS)) == expected
    assert engine.last_stats.cached_prompt_tokens == 0
    assert list(engine.generate_tokens(prompt, PARAMS)) == expected
    assert engine.last_stats.cached_prompt_tokens == 32
    odd = prompt + [11, 12]  # 35 tokens: the prompt's last boundary before its last token is 32 again
    assert list(engine.generate_tokens(odd, PARAMS)) == reference(model, odd)
    assert engine.last_stats.cached_prompt_tokens == 32
    stats = pool.block_stats()["state_snapshots"]
    assert stats["hits"] == 2 and stats["count"] >= 2
    pool.check_invariants()


def test_shared_system_prompt_with_different_questions(hybrid):
    _, model = hybrid
    pool = paged(model, interval=2)  # snapshots every 2 blocks = 8 tokens of every prompt
    engine = DirectEngine(model, None, pool=pool)
    cached = []
    for q in QUESTIONS:
        prompt = SYSTEM + q
        assert list(engine.generate_tokens(prompt, PARAMS)) == reference(model, prompt)
        cached.append(engine.last_stats.cached_prompt_tokens)
    # SYSTEM's 26 tokens hold 6 full blocks; the deepest multiple of 2 blocks within them is 24 tokens
    assert cached == [0, 24, 24]
    pool.check_invariants()


def test_multi_turn_conversation_resumes_where_the_last_turn_ended(hybrid):
    _, model = hybrid
    pool = paged(model)
    engine = DirectEngine(model, None, pool=pool)
    turn1 = SYSTEM + QUESTIONS[0]
    answer = list(engine.generate_tokens(turn1, PARAMS))
    assert answer == reference(model, turn1)
    # the first sequence held 33 + 11 = 44 tokens (its last sampled token is never fed): a snapshot at 44
    turn2 = turn1 + answer + QUESTIONS[1]
    assert list(engine.generate_tokens(turn2, PARAMS)) == reference(model, turn2)
    assert engine.last_stats.cached_prompt_tokens == 44
    pool.check_invariants()


def run_batch(model, pool, requests):
    """Every request through a BatchEngine over ``pool``; per request, per sample, the tokens; and the stats."""
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=pool.max_sequences, prefill_chunk_size=16),
                         pool=pool, context_length=4096).start()
    try:
        out = []
        for request in requests:  # one after the other: each finds what the ones before it cached
            events = list(engine.submit(request))
            assert events[-1].kind == "done", events[-1]
            out.append([[e.token for e in events if e.kind == "token" and e.index == i] for i in range(request.n)])
        return out, engine.stats()
    finally:
        engine.stop()


def test_batch_engine_hits_and_parallel_samples_stay_exact(hybrid):
    _, model = hybrid
    prompt = SYSTEM + QUESTIONS[0]
    expected = reference(model, prompt)
    pool = paged(model, max_sequences=3)
    got, stats = run_batch(model, pool, [GenerationRequest(prompt, PARAMS), GenerationRequest(prompt, PARAMS, n=2)])
    assert got == [[expected], [expected, expected]]
    assert stats["prefix_cache"]["enabled"] and stats["prefix_cache"]["hits"] == 32  # the second request's
    assert stats["state_snapshots"]["hits"] == 1 and stats["kv_blocks"]["used"] == 0
    pool.check_invariants()


def test_batch_engine_preemption_stays_exact(hybrid):
    _, model = hybrid
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = [reference(model, p) for p in prompts]
    # 27 usable blocks of 4: three sequences of 11-12 blocks each do not fit together, so some are preempted
    pool = paged(model, num_blocks=28, max_sequences=3)
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=3, prefill_chunk_size=16), pool=pool,
                         context_length=4096).start()
    try:
        handles = [engine.submit(GenerationRequest(p, PARAMS)) for p in prompts]  # concurrently
        got = [[e.token for e in h if e.kind == "token"] for h in handles]
        stats = engine.stats()
    finally:
        engine.stop()
    assert got == expected
    assert stats["preemptions"] > 0 and stats["kv_blocks"]["used"] == 0
    pool.check_invariants()


def test_snapshots_are_evicted_whole_in_the_pools_order():
    pool = BlockPool(12, 4, eviction_policy="priority")
    index = StateSnapshotIndex(pool, group_id=1, blocks_per_snapshot=3)
    toks = (1, 2, 3, 4)
    a, b = ((1, 2, 3, 4), ((),)), ((5, 6, 7, 8), ((),))  # two one-block prefixes
    assert index.put("h1", 1, a, toks, (), (35, None), payload="a")
    assert index.put("h2", 1, b, toks, (), (35, None), payload="b")
    assert [blk.block_id for key, p in (("h1", a), ("h2", b)) for blk in index.find(key, lambda p=p: p).blocks] == \
        [1, 2, 3, 4, 5, 6]
    assert index.find("h1", lambda: b) is None  # the hash of h1, another prefix (a collision): never served
    assert index.take("h1", lambda: a) == "a"  # a hit moves h1 behind h2 in the eviction order
    got = pool.get_new_blocks(5 + 1)  # 5 plain free blocks, then the eviction of h2's first block
    assert [blk.block_id for blk in got] == [4, 7, 8, 9, 10, 11]
    assert index.find("h2", lambda: b) is None and index.find("h1", lambda: a) is not None  # h2 went whole
    assert [blk.block_id for blk in pool.eviction_order()[:2]] == [6, 5]  # its other blocks: plain free, at the head
    assert index.stats()["count"] == 1 and index.stats()["evicted"] == 1
    pool.free_blocks(got)
    pool.check_invariants()
    index.check_invariants()


def test_manager_hit_needs_both_blocks_and_a_snapshot():
    m = KVCacheManager(64, 4, state_snapshot_blocks=2)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks
    a = m.open(prompt)
    m.allocate_slots(a.seq_id)
    m.commit(a.seq_id)
    assert m.store_snapshot(a.seq_id, 2, payload="at 8")
    m.free(a.seq_id)
    b = m.open(prompt)  # five blocks cached, but a snapshot only after two
    assert (b.num_cached_tokens, b.state) == (8, "at 8")
    m.allocate_slots(b.seq_id)
    m.commit(b.seq_id)
    assert m.store_snapshot(b.seq_id, 5, payload="at 20")
    m.free(b.seq_id)
    c = m.open(prompt)
    assert (c.num_cached_tokens, c.state) == (20, "at 20")
    m.free(c.seq_id)
    d = m.open(prompt[:12] + [999] * 9)  # shares 3 blocks: the deepest snapshot within them is at 2 blocks
    assert (d.num_cached_tokens, d.state) == (8, "at 8")
    m.free(d.seq_id)
    m.check_invariants()


def test_restored_state_is_shared_not_copied(hybrid):
    _, model = hybrid
    pool = paged(model)
    prompt = SYSTEM + QUESTIONS[0]
    engine = DirectEngine(model, None, pool=pool)
    list(engine.generate_tokens(prompt, SamplingParams(max_tokens=2)))
    seq = pool.open(prompt=prompt)
    snap = next(s for same in pool.paged.manager.snapshots._by_key.values() for s in same if s.num_blocks == 8)
    layer = pool.paged.recurrent_layers[0]
    assert seq.caches[layer].state[0][1] is snap.payload[0][0][1]  # the hit shares the snapshot's arrays
    mx.eval(model(mx.array([prompt[32:]], dtype=mx.uint32), cache=seq.caches))
    assert seq.caches[layer].state[0][1] is not snap.payload[0][0][1]  # the model assigned a new state
    pool.release(seq.id)
    pool.check_invariants()


def test_a_tenant_reset_drops_that_tenants_snapshots_only():
    model, _ = build_model("qwen3_next")
    install_attention_hook(model)
    pool = paged(model)
    engine = DirectEngine(model, None, pool=pool)
    prompt = SYSTEM + QUESTIONS[0]
    for salt in ("alice", "bob"):
        list(engine.generate_tokens(prompt, SamplingParams(max_tokens=2), salt=salt))
    snaps = pool.paged.manager.snapshots
    assert snaps.stats()["count"] == 2
    pool.evict_cached(salt="alice")
    assert snaps.stats()["count"] == 1
    list(engine.generate_tokens(prompt, SamplingParams(max_tokens=2), salt="bob"))
    assert engine.last_stats.cached_prompt_tokens == 32  # bob's snapshot survived alice's reset
    list(engine.generate_tokens(prompt, SamplingParams(max_tokens=2), salt="alice"))
    assert engine.last_stats.cached_prompt_tokens == 0
    pool.check_invariants()


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_decoding_on_a_hit_stays_exact(arch):
    """Speculative rounds (scripted drafts: every rewind length, replays of the recurrent layers) commit only
    verified tokens, so the snapshots they leave are exact: a repeat and a next turn resume from them."""
    from testkit.speculative import ScriptedDrafter

    from mlxkv.engine.speculative import SpeculativeEngine

    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged(model, max_sequences=1)
    prompt = SYSTEM + QUESTIONS[0]
    params = SamplingParams(max_tokens=20)
    expected = reference(model, prompt, params)
    engine = SpeculativeEngine(model, None, ScriptedDrafter(expected), num_draft_tokens=3, pool=pool)
    assert list(engine.generate_tokens(prompt, params)) == expected
    assert list(engine.generate_tokens(prompt, params)) == expected
    assert engine.last_stats.cached_prompt_tokens == 32 and engine.last_stats.replay_forwards > 0
    turn2 = prompt + expected + QUESTIONS[1]
    engine.drafter = ScriptedDrafter(reference(model, turn2, params))
    assert list(engine.generate_tokens(turn2, params)) == reference(model, turn2, params)
    assert engine.last_stats.cached_prompt_tokens >= 32
    pool.check_invariants()


def test_a_recurrent_layer_without_readable_state_warns_and_keeps_prefix_caching_off(monkeypatch, caplog):
    import mlxkv.kv.paged.backend as backend_module

    model, _ = build_model("qwen3_next")
    monkeypatch.setattr(backend_module, "can_snapshot", lambda cache: False)
    with caplog.at_level("WARNING", logger="mlxkv.kv.paged.backend"):
        pool = paged(model)
    assert "prefix caching is off for this model" in caplog.text and "ArraysCache" in caplog.text
    assert not pool.prefix_caching and pool.block_stats()["state_snapshots"] == {"enabled": False}


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 6, 6, 6, 6]]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 9), st.integers(0, 3),
                          st.sampled_from([None, "a"])), min_size=1, max_size=25))
def test_random_workloads_never_restore_a_wrong_state(ops):
    """Random prompts sharing prefixes, salts, snapshots at random depths, in a pool small enough to evict: a hit's
    state is always the one stored for exactly its prefix (the payload here *is* that prefix), the hit ends at a
    block boundary where the payload was stored, and the pool's invariants hold."""
    m = KVCacheManager(24, 4, state_snapshot_blocks=2)
    for p1, p2, tail, k, salt in ops:
        prompt = PREFIXES[p1] + PREFIXES[p2][:4] + list(range(100, 100 + tail))
        res = m.open(prompt, salt=salt)
        if res.num_cached_tokens:
            assert res.num_cached_tokens % 4 == 0
            assert res.state == (salt, tuple(prompt[:res.num_cached_tokens]))
        else:
            assert res.state is None
        if m.allocate_slots(res.seq_id) is None:  # no room: give up on this one
            m.free(res.seq_id)
            continue
        m.commit(res.seq_id)
        k = min(k, len(prompt) // 4)
        if k:
            m.store_snapshot(res.seq_id, k, payload=(salt, tuple(prompt[:4 * k])))
        m.check_invariants()
        m.free(res.seq_id)
        m.check_invariants()
        assert m.pool.num_free_blocks == m.pool.num_usable_blocks
