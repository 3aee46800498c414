"""--kv-overflow window|h2o on the paged backend: whole pages of one sequence evicted past its budget.

Checked here: a budget above the context changes nothing (tokens and logits of the plain paged cache); paged
window with one-token pages is the dense window; with larger pages the exact pages kept; h2o drops the pages a
crafted mass makes lowest and never a protected one; eviction only drops the evicting sequence's reference (a
shared prefix block stays for the sequence beside it, whose tokens do not change); blocks written after an
eviction never enter the prefix cache; fork and preemption run with a policy on; the attention over kept pages
matches dense attention over the same rows, on the reference path and the kernel's. Offload's own checks (host
store, restore): test_kv_overflow_paged_offload.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig, KvOverflowConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import CacheRequest
from mlxkv.kv.layouts import install_attention_hook
from mlxkv.kv.paged import PagedLayerCache
from mlxkv.kv.paged.page_overflow import PageOverflow
from mlxkv.kv.store import CachePool

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(40)]
N = 24


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama")
    install_attention_hook(m)
    return m


def pool_for(model, overflow=None, bs=4, num_blocks=160, **kw):
    return CachePool(model, backend="paged", num_blocks=num_blocks, max_sequences=4, overflow=overflow,
                     kv_config=KvCacheConfig(backend="paged", block_size=bs, **kw))


def greedy(model, pool, prompt=PROMPT, n=N):
    out = list(DirectEngine(model, None, pool=pool).generate_tokens(prompt, SamplingParams(max_tokens=n, temp=0)))
    pool.check_invariants()
    return out


def step_logits(model, seq, prompt, n):
    """Prefill ``prompt`` then ``n`` greedy decode steps through ``seq``; the logits of every step ``(n + 1, V)``
    and the tokens (checking the pool's invariants is the caller's)."""
    pos = seq.num_cached
    if len(prompt) - 1 > pos:
        mx.eval(model(mx.array(prompt[pos:-1], dtype=mx.uint32)[None], cache=seq.caches))
        seq.commit()
    logits = [model(mx.array(prompt[-1:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]]
    seq.commit()
    tokens = []
    for _ in range(n):
        tokens.append(int(mx.argmax(logits[-1]).item()))
        seq.feed([tokens[-1]])
        logits.append(model(mx.array([[tokens[-1]]], dtype=mx.uint32), cache=seq.caches)[0, -1])
        mx.eval(logits[-1])
        seq.commit()
    return mx.stack(logits), tokens


def overflow_state(seq):
    (state,) = seq.paged.overflow.values()
    return state


@pytest.mark.parametrize("policy", ["window", "h2o"])
def test_a_budget_above_the_context_is_the_plain_paged_cache(model, policy):
    plain_pool, ov_pool = pool_for(model), pool_for(model, KvOverflowConfig(policy, budget=512))
    plain, plain_tokens = step_logits(model, plain_pool.open(prompt=PROMPT), PROMPT, 8)
    seq = ov_pool.open(prompt=PROMPT)
    ours, tokens = step_logits(model, seq, PROMPT, 8)
    assert tokens == plain_tokens and mx.array_equal(ours, plain).item()
    assert overflow_state(seq).evicted == 0
    ov_pool.check_invariants()


def test_window_with_one_token_pages_is_the_dense_window(model):
    """Paged evicts after a step down to the budget, the dense rotating window before it: budget B paged keeps the
    rows the dense window of B + 1 keeps."""
    prompt = PROMPT[:20]
    paged = greedy(model, pool_for(model, KvOverflowConfig("window", budget=24, sinks=2), bs=1), prompt, 30)
    dense = greedy(model, CachePool(model, overflow=KvOverflowConfig("window", budget=25, sinks=2)), prompt, 30)
    assert paged == dense
    assert paged != greedy(model, pool_for(model, bs=1), prompt, 30)


def test_window_keeps_the_sinks_page_and_the_most_recent_pages(model):
    pool = pool_for(model, KvOverflowConfig("window", budget=20, sinks=2))
    seq = pool.open(prompt=PROMPT)
    step_logits(model, seq, PROMPT, 9)  # 49 tokens
    state = overflow_state(seq)
    # after each commit the oldest pages after the sinks' page go until at most 20 tokens stay: 49 -> 17
    assert state.dropped == set(range(1, 9)) and state.kept_tokens(49) == 17
    table = pool.paged.manager.block_tables(seq.paged.seq_id)[0]
    assert [i for i, b in enumerate(table) if b == 0] == list(range(1, 9))
    assert pool.block_stats()["kv_blocks"]["overflow_dropped"] == 8
    layer = next(c for c in seq.caches if isinstance(c, PagedLayerCache))
    assert layer.offset == 49 and layer.size() == 17  # true positions, kept rows
    keys, _ = layer.state  # the rows the last token attended
    assert keys.shape[2] == 17
    k_rows = pool.paged.storage.k_rows[layer.layer]  # (1, H, pages * 4, D)
    slots = [table[p // 4] * 4 + p % 4 for p in [*range(4), *range(36, 49)]]
    assert mx.array_equal(keys, k_rows[:, :, mx.array(slots)]).item()
    pool.check_invariants()


def test_h2o_drops_the_lowest_mass_pages_and_never_a_protected_one():
    state = PageOverflow(KvOverflowConfig("h2o", budget=24, sinks=2, recent=6), group=0, block_size=4)
    mass = np.full(40, 1.0, np.float32)
    mass[[0, 1]] = 0.0  # the sinks' page: lowest, protected
    mass[[12, 13, 14, 15]] = 0.01  # page 3
    mass[[25]] = -0.5  # page 6 lowest of all after the sinks
    mass[[36, 37]] = 0.0  # the recent pages: protected
    state.add_mass(mx.array(mass)[None], list(range(10)))  # one layer's (n_kv=1, 40 rows)
    assert state.plan(24) == []  # within the budget
    # 40 tokens, budget 24: 16 over -> 4 of pages 1..7 (0: the sinks', 8 and 9: the last 6 tokens'); page sums
    # 1: 4, 2: 4, 3: 0.04, 4: 4, 5: 4, 6: 2.5, 7: 4 -> 3, 6, then the oldest of the ties
    assert state.plan(40) == [1, 2, 3, 6]
    state.add_mass(mx.array(mass)[None], list(range(10)))  # a second layer adds to the same pages
    assert state.plan(40) == [1, 2, 3, 6]


def test_h2o_runs_past_its_budget_with_mass_from_every_layer(model):
    pool = pool_for(model, KvOverflowConfig("h2o", budget=24, sinks=2, recent=4))
    seq = pool.open(prompt=PROMPT)
    _, tokens = step_logits(model, seq, PROMPT, 16)
    state = overflow_state(seq)
    assert state.evicted >= 8 and state.kept_tokens(56) <= 24
    assert 0 not in state.dropped and not state.dropped & set(range(13, 14))  # sinks' page, page being written
    assert float(state._mass.sum().item()) > 0
    pool.check_invariants()
    assert tokens != step_logits(model, pool_for(model).open(prompt=PROMPT), PROMPT, 16)[1]


def test_eviction_drops_only_this_sequences_reference_to_a_shared_block(model):
    pool = pool_for(model)
    reference = greedy(model, pool)  # the prompt's blocks are now cached
    other = pool.open(prompt=PROMPT)  # both take the cached prompt blocks
    ours = pool.open(prompt=PROMPT, cache_request=CacheRequest(overflow=KvOverflowConfig("window", budget=20, sinks=2)))
    assert ours.num_cached == other.num_cached == 39
    shared = pool.paged.manager.block_tables(other.paged.seq_id)[0][:9]
    step_logits(model, ours, PROMPT, 6)
    assert overflow_state(ours).dropped  # it dropped pages of the shared prompt
    blocks = pool.paged.manager.pool.blocks
    assert all(blocks[b].ref_cnt == 1 for b in shared[1:5])  # still held by `other`
    assert step_logits(model, other, PROMPT, N)[1] == reference  # unchanged K/V, unchanged tokens
    pool.check_invariants()
    limit = pool.paged.manager._get(ours.paged.seq_id).cache_limit
    assert limit == 40 // 4  # the blocks written after the eviction are never cached
    pool.release(ours.id)
    pool.release(other.id)
    pool.check_invariants()


def test_blocks_written_after_an_eviction_never_serve_a_prefix_hit(model):
    pool = pool_for(model, KvOverflowConfig("window", budget=20, sinks=2))
    out = greedy(model, pool)  # the first eviction comes after the prompt's first 39 tokens
    hit = pool.open(prompt=PROMPT + out, cache_request=CacheRequest(overflow=KvOverflowConfig("preempt")))
    assert hit.num_cached == 36  # the 9 full blocks computed before it, none after
    pool.check_invariants()


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("policy", ["window", "h2o", "offload"])
def test_attention_over_kept_pages_is_dense_attention_over_those_rows(model, kernel, policy, monkeypatch):
    """One layer after an eviction: its output equals SDPA over the kept rows (the reference path, and the
    paged kernel over the kept pages' table; offload also scores its offloaded pages); h2o's and offload's mass
    (the kernel's own, or the second pass) is each kept page's share of that attention."""
    import mlxkv.kv.paged.sequence_attention as lc
    from mlxkv.kv.overflow.mass import decode_mass

    monkeypatch.setattr(lc, "reference_on_views", lambda: not kernel)
    config = KvOverflowConfig(policy, budget=24, sinks=2, **({"recent": 4} if policy != "window" else {}))
    pool = pool_for(model, config)
    seq = pool.open(prompt=PROMPT)
    step_logits(model, seq, PROMPT, 3)
    state = overflow_state(seq)
    assert state.dropped
    layer = next(c for c in seq.caches if isinstance(c, PagedLayerCache))
    seq.feed([5])
    k, v = layer.update_and_fetch(mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 1, 16)))
    q = mx.random.normal((1, 4, 1, 16))
    before = state._mass
    out = layer.attend(q, k, v, 0.25)
    expect = mx.fast.scaled_dot_product_attention(q, mx.array(k), mx.array(v), scale=0.25)
    assert mx.allclose(out, expect, atol=1e-5).item()
    if policy != "window":
        entries, _ = state.kept_pages(seq.paged.step.host_table(0), layer.offset)
        rows = decode_mass(q, mx.array(k), 0.25).sum(axis=0)  # (K,)
        pages = mx.pad(rows, (0, len(entries) * 4 - rows.shape[0])).reshape(-1, 4).sum(axis=1)
        added = (state._mass - mx.pad(before, (0, state._mass.shape[0] - before.shape[0])))[mx.array(entries)]
        assert mx.allclose(added, pages, atol=1e-5).item() and abs(pages.sum().item() - 4.0) < 1e-4


def test_fork_and_preemption_run_with_a_policy(model):
    """n=2 forks the sequence with its statistics; a pool too small for three contexts preempts and resumes."""
    pool = pool_for(model, KvOverflowConfig("h2o", budget=64, sinks=2, recent=8), num_blocks=40)
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
        assert sum(e.kind == "token" for e in events) == (80 if events is results[0] else 40)
    assert stats["preemptions"] > 0 and stats["batched_decode"] and stats["batched_steps_total"] > 0, stats
    pool.check_invariants()


def test_batched_decode_over_kept_pages_matches_one_by_one(model):
    """Four sequences (h2o, window, none, offload) past their budgets decoded in one batched forward per step give
    the tokens each gives decoded alone (offload restoring pages on the way)."""
    from mlxkv.kv import make_batch_views

    policies = [KvOverflowConfig("h2o", budget=24, sinks=2, recent=4), KvOverflowConfig("window", budget=20), None,
                KvOverflowConfig("offload", budget=24, sinks=2, recent=4)]
    prompts = [PROMPT, PROMPT[5:], PROMPT[:30], PROMPT[3:]]

    def run(batched):
        pool = pool_for(model)
        seqs = [pool.open(prompt=p, cache_request=CacheRequest(overflow=o)) for p, o in zip(prompts, policies)]
        last = [int(mx.argmax(step_logits(model, s, p, 2)[0][-1]).item()) for s, p in zip(seqs, prompts)]
        out = []
        for _ in range(12):
            for s, t in zip(seqs, last):
                s.feed([t])
            inputs = mx.array([[t] for t in last], dtype=mx.uint32)  # (4, 1)
            if batched:
                logits = model(inputs, cache=make_batch_views([s.caches for s in seqs]))[:, -1]
            else:
                logits = mx.concatenate([model(inputs[b:b + 1], cache=s.caches)[:, -1] for b, s in enumerate(seqs)])
            last = mx.argmax(logits, axis=-1).tolist()
            for s in seqs:
                s.commit()
            out.append(last)
        assert all(overflow_state(s).evicted for s in seqs[:2]) and overflow_state(seqs[3]).restored
        pool.check_invariants()
        return out

    assert run(True) == run(False)


def test_distributed_ranks_refuse_a_policy(model):
    from mlxkv.distributed.leader import build_rank_pool

    kv = KvCacheConfig(backend="paged", overflow=KvOverflowConfig("window", budget=96))
    with pytest.raises(ValueError, match="not supported with --distributed"):
        build_rank_pool(model, kv, max_sequences=2, context_tokens=None, group=None)
