"""The --kv-overflow layouts (mlxkv.kv.overflow): exact while nothing overflows, eviction order, offload round
trips, the budget invariants, rewind, and the pool (preemption, release) with a policy on."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest
from testkit import cache_runs
from testkit.archs import ARCH_NAMES, build_model

from mlxkv.config import KvCacheConfig, KvOverflowConfig
from mlxkv.kv import CachePool, RewindError, each_layer_cache, make_caches
from mlxkv.kv.layouts import RotatingKVCache, install_attention_hook
from mlxkv.kv.overflow import OverflowKVCache
from mlxkv.kv.overflow.selection import compaction_plan, eviction_scores

PROMPT = [(i * 37 + 11) % 1000 + 3 for i in range(40)]
POLICIES = ("window", "h2o", "offload")
ARCHS = [a for a in ARCH_NAMES if a != "deepseek_v3"]  # MLA: its own test below


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(arch):
        if arch not in built:
            built[arch] = build_model(arch)[0]
            install_attention_hook(built[arch])
        return built[arch]

    return get


def overflow(policy, budget, **kw):
    return KvOverflowConfig(policy=policy, budget=budget, **kw)


def overflow_layers(caches):
    return [c for c in each_layer_cache(caches) if isinstance(c, OverflowKVCache)]


# -- exact while the budget holds the context ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_every_policy_is_token_exact_when_the_budget_holds_the_context(arch, models):
    model = models(arch)
    ref, fed = cache_runs.run(model, make_caches(model), PROMPT, (24,), steps=16)
    for policy in POLICIES:
        caches = make_caches(model, overflow=overflow(policy, 64))
        ours, _ = cache_runs.run(model, caches, PROMPT, (24,), steps=16)
        assert cache_runs.max_diff(ours, ref) == 0.0, policy  # the same attention kernel over the same rows
        assert [mx.argmax(x).item() for x in ours[:-1]] == fed, policy
        assert all(c.evicted == 0 for c in overflow_layers(caches))


def test_layers_get_the_policy_only_where_attention_is_full(models):
    kinds = {p: [type(c).__name__ for c in make_caches(models("gemma3_text"), overflow=overflow(p, 32))]
             for p in POLICIES}
    assert kinds["h2o"] == ["RotatingKVCache", "OverflowKVCache"]  # the sliding layer keeps its own window
    window = make_caches(models("llama"), overflow=overflow("window", 32, sinks=2))
    assert all(isinstance(c, RotatingKVCache) and (c.max_size, c.keep) == (32, 2) for c in window)


def test_latent_attention_refuses_the_ranking_policies(models):
    model = models("deepseek_v3")
    for policy in ("h2o", "offload"):
        with pytest.raises(ValueError, match="latent.*--kv-overflow window"):
            make_caches(model, overflow=overflow(policy, 32))
    make_caches(model, overflow=overflow("window", 32))


# -- eviction order ------------------------------------------------------------------------------------------------
def test_the_plan_keeps_sinks_recent_and_the_heaviest_rows():
    positions = mx.arange(12)
    mass = mx.array([[0.0, 0.0, 5.0, 1.0, 9.0, 2.0, 0.5, 7.0, 0.1, 0.0, 0.0, 0.0]])  # (1, 12)
    scores = eviction_scores(mass, positions, offset=12, sinks=2, recent=3)
    holes, movers, evicted = compaction_plan(scores, budget=8)  # keep 2 sinks + 3 recent + 3 heaviest
    assert sorted(evicted.tolist()) == [3, 5, 6, 8]  # the lowest-mass unprotected rows, exactly
    kept = np.array(positions.tolist())
    kept[np.array(holes.tolist())] = kept[np.array(movers.tolist())]
    assert sorted(kept[:8].tolist()) == [0, 1, 2, 4, 7, 9, 10, 11]


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_packs_exactly_the_best_rows_for_random_masses(seed):
    rng = np.random.default_rng(seed)
    R, budget = int(rng.integers(10, 40)), None
    budget = int(rng.integers(6, R))
    mass = rng.permutation(R).astype(np.float32)[None]  # (1, R) distinct masses
    scores = eviction_scores(mx.array(mass), mx.arange(R), offset=R, sinks=2, recent=3)
    holes, movers, evicted = compaction_plan(scores, budget)
    best = set(np.argsort(-np.where((np.arange(R) < 2) | (np.arange(R) >= R - 3), np.inf, mass[0]))[:budget])
    assert set(evicted.tolist()) == set(range(R)) - best
    slots = np.arange(R)
    slots[np.array(holes.tolist())] = slots[np.array(movers.tolist())]
    assert set(slots[:budget].tolist()) == best


def test_attention_decides_which_rows_stay():
    """Orthogonal keys and queries aimed at chosen positions: those positions gather the mass and survive."""
    D, budget = 32, 12
    cache = OverflowKVCache("h2o", budget, sinks=1, recent=2)
    keys = (mx.eye(D)[:20] * 4.0).reshape(1, 1, 20, D)  # (1, 1, 20, D): key p is the unit vector e_p
    cache.update_and_fetch(keys, keys)
    favourites = [3, 7, 8, 11, 12, 13, 15, 16, 17]  # 9 = budget - sinks - recent - 0 new
    q = (mx.eye(D)[mx.array(favourites)] * 4.0).reshape(1, 1, len(favourites), D)  # (1, 1, 9, D)
    k, v = cache._store.read(0, cache.size())
    cache.attend(q, k, v, scale=1.0, mask=None)
    cache.update_and_fetch(mx.zeros((1, 1, 1, D)), mx.zeros((1, 1, 1, D)))  # evicts down to 12, then appends
    kept = sorted(cache.positions.tolist())
    assert kept == [0, 3, 7, 8, 11, 12, 13, 15, 16, 17, 18, 19, 20]  # sink, favourites, recent 18-19, new 20
    assert cache.evicted == 8 and cache.rewindable() == 1


# -- offload -------------------------------------------------------------------------------------------------------
def _rows(n, D=16, seed=0):
    mx.random.seed(seed)
    return mx.random.normal((1, 2, n, D)), mx.random.normal((1, 2, n, D))  # (1, n_kv=2, n, D)


def test_offload_then_restore_equals_never_evicting():
    k, v = _rows(33)
    cache = OverflowKVCache("offload", 16, sinks=2, recent=4, restore_threshold=1e-9, restore_limit=64)
    cache.update_and_fetch(k[:, :, :32], v[:, :, :32])
    kk, vv = cache._store.read(0, cache.size())
    q = mx.random.normal((1, 4, 1, 16))  # (1, n_q=4, 1, D): two query heads per KV head
    cache.attend(q, kk, vv, scale=0.25)
    fk, fv = cache.update_and_fetch(k[:, :, 32:], v[:, :, 32:])  # 16 rows go to host memory, the new row comes
    assert (cache.size(), len(cache.tier), cache.evicted) == (17, 16, 16)
    assert cache.tier.host_nbytes > 0 and cache.tier.proxy_nbytes > 0
    out = cache.attend(q, fk, fv, scale=0.25)  # every host row passes the (tiny) threshold: all come back
    assert (len(cache.tier), cache.tier.host_nbytes, cache.restored) == (0, 0, 16)
    full = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert mx.allclose(out, full, atol=1e-6).item()
    order = mx.argsort(cache.positions)
    kept_k, kept_v = cache._store.read(0, cache.size())
    assert mx.array_equal(kept_k[:, :, order], k).item() and mx.array_equal(kept_v[:, :, order], v).item()


def test_offload_restores_only_what_the_queries_want():
    D = 32
    keys = (mx.eye(D)[:24] * 6.0).reshape(1, 1, 24, D)
    cache = OverflowKVCache("offload", 10, sinks=1, recent=2, restore_threshold=0.2)
    cache.update_and_fetch(keys, keys)
    cache.attend(mx.zeros((1, 1, 1, D)), *cache._store.read(0, 24), scale=1.0)  # uniform mass: the oldest stay
    new = (mx.eye(D)[24:25] * 6.0).reshape(1, 1, 1, D)
    fk, fv = cache.update_and_fetch(new, new)
    gone = set(cache.tier.positions.tolist())
    target = max(gone)
    q = (mx.eye(D)[target:target + 1] * 6.0).reshape(1, 1, 1, D)  # a query aimed at one offloaded key
    out = cache.attend(q, fk, fv, scale=1.0)
    assert target not in set(cache.tier.positions.tolist()) and target in set(cache.positions.tolist())
    assert cache.restored == 1  # the others get nothing from this query
    assert mx.allclose(out[0, 0, 0], keys[0, 0, target], atol=0.05).item()  # it attends the restored row


@pytest.mark.parametrize("policy", ["h2o", "offload"])
def test_budget_invariants_over_a_long_run(policy, models):
    model = models("llama")
    budget = 24
    caches = make_caches(model, overflow=overflow(policy, budget, recent=6))
    tokens = PROMPT[:20]
    logits = model(mx.array(tokens)[None], cache=caches)[0, -1]
    for _ in range(40):
        token = mx.argmax(logits).item()
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
        mx.eval(logits)
        for c in overflow_layers(caches):
            pos = sorted(c.positions.tolist())
            assert c.size() <= budget + 1 + c.restore_limit and len(set(pos)) == len(pos)
            assert set(range(4)) <= set(pos) and set(range(c.offset - 6, c.offset)) <= set(pos)
            if policy == "offload":  # every token is resident or on the host, exactly once
                assert sorted(pos + c.tier.positions.tolist()) == list(range(c.offset))
            else:
                assert c.size() + c.evicted == c.offset
    assert all(c.evicted > 0 for c in overflow_layers(caches))


# -- rewind --------------------------------------------------------------------------------------------------------
def test_trim_is_exact_before_eviction_and_bounded_after():
    k, v = _rows(40)
    cache = OverflowKVCache("h2o", 30, sinks=2, recent=8)
    cache.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert cache.rewindable() == 20 and cache.trim(5) == 5 and cache.offset == 15
    rk, _ = cache.update_and_fetch(k[:, :, 15:35], v[:, :, 15:35])  # 35 rows, over budget after this step
    assert mx.array_equal(rk, k[:, :, :35]).item()
    cache.update_and_fetch(k[:, :, 35:38], v[:, :, 35:38])  # evicts 5, appends 3
    assert cache.rewindable() == 3
    with pytest.raises(RewindError):
        cache.trim(4)
    assert cache.trim(3) == 3 and cache.offset == 35 and cache.size() == 30
    assert max(cache.positions.tolist()) == 34


# -- the pool ------------------------------------------------------------------------------------------------------
def test_preemption_resumes_with_fresh_caches_of_the_same_policy(models):
    model = models("llama")
    pool = CachePool(model, max_sequences=2, overflow=overflow("offload", 16, recent=4))
    seq = pool.open(len(PROMPT))
    first = model(mx.array(PROMPT)[None], cache=seq.caches)[0, -1]
    mx.eval(first)
    tier = weakref.ref(overflow_layers(seq.caches)[0].tier)
    pool.preempt(seq.id)
    pool.resume(seq.id, PROMPT)
    assert all(c.offset == 0 for c in overflow_layers(seq.caches)) and len(overflow_layers(seq.caches)) == 2
    again = model(mx.array(PROMPT)[None], cache=seq.caches)[0, -1]
    assert mx.array_equal(first, again).item()
    model(mx.array([[5]]), cache=seq.caches)  # over budget: rows go to the host tier
    assert all(len(c.tier) > 0 for c in overflow_layers(seq.caches))
    held = weakref.ref(overflow_layers(seq.caches)[0].tier)
    pool.release(seq.id)
    gc.collect()
    assert tier() is None and held() is None  # no host rows outlive their sequence
    assert len(pool) == 0


def test_the_paged_backend_and_other_caps_refuse_the_policies():
    with pytest.raises(ValueError, match="too small for pages of 16 tokens"):
        KvCacheConfig(backend="paged", overflow=overflow("h2o", 64))  # sinks' page + 32 recent + 2 pages > 64
    with pytest.raises(ValueError, match="full-precision pages"):
        KvCacheConfig(backend="paged", kv_bits=8, overflow=overflow("window", 64))
    for policy in ("window", "h2o", "offload"):
        KvCacheConfig(backend="paged", overflow=overflow(policy, 96))
    for policy in ("window", "h2o", "offload"):
        with pytest.raises(ValueError, match="max_kv_size"):
            KvCacheConfig(max_kv_size=64, overflow=overflow(policy, 64))
    with pytest.raises(ValueError, match="kv_bits"):
        KvCacheConfig(kv_bits=8, overflow=overflow("h2o", 64))
    with pytest.raises(ValueError, match="needs kv_overflow_budget"):
        KvOverflowConfig(policy="h2o")
    with pytest.raises(ValueError, match="apply to kv_overflow window"):
        KvOverflowConfig(budget=64)
    with pytest.raises(ValueError, match="room is needed"):
        KvOverflowConfig(policy="offload", budget=10, sinks=4, recent=6)
    assert KvOverflowConfig(policy="h2o", budget=100).recent_tokens == 50


def test_the_engine_builder_gives_dense_sequences_the_policy(models):
    from mlxkv.engine.build import build_pool

    pool = build_pool(models("llama"), KvCacheConfig(overflow=overflow("h2o", 32)), max_sequences=2,
                      context_tokens=None)
    seq = pool.open(4)
    assert [type(c).__name__ for c in seq.caches] == ["OverflowKVCache"] * 2
    assert seq.caches[0].budget == 32 and seq.caches[0].recent == 16


def test_forked_sequences_continue_alike_with_their_own_host_rows(models):
    model = models("llama")
    pool = CachePool(model, max_sequences=3, overflow=overflow("offload", 16, recent=4))
    parent = pool.open(30)
    model(mx.array(PROMPT[:30])[None], cache=parent.caches)
    model(mx.array([[5]]), cache=parent.caches)  # over budget: host rows exist before the fork
    kids = pool.fork(parent.id, 2)
    a, b = (model(mx.array([[7]]), cache=k.caches)[0, -1] for k in kids)
    assert mx.array_equal(a, b).item()
    tiers = [overflow_layers(s.caches)[0].tier for s in (parent, *kids)]
    assert len({id(t) for t in tiers}) == 3 and len(tiers[0]) < len(tiers[1]) == len(tiers[2])
