"""The block pool's per-tenant quota on cached blocks: a tenant over its share loses its own blocks first, under
the quota eviction follows the plain order, and a tenant flooding a real server cannot push out another tenant's
cached prefix (pure Python, then a server on loopback with the openai client)."""

from __future__ import annotations

import httpx
import pytest

from mlxkv.config import EngineConfig, KvCacheConfig, RunConfig, SpeculativeConfig
from mlxkv.kv.blocks.block_pool import BlockPool
from mlxkv.kv.blocks.manager import KVCacheManager
from mlxkv.kv.blocks.specs import KVCacheGroupSpec
from mlxkv.kv.blocks.tenant_quota import TenantQuota

BS = 4


def cache_prompt(m: KVCacheManager, tokens: list[int], salt=None) -> list[int]:
    """Prefill ``tokens`` (full blocks only) for ``salt`` and free the sequence; returns its block ids."""
    s = m.open(tokens, salt=salt)
    a = m.allocate_slots(s.seq_id)
    assert a is not None
    m.commit(s.seq_id)
    ids = list(m.block_tables(s.seq_id)[0])
    m.free(s.seq_id)
    return ids


def prompt(base: int, blocks: int) -> list[int]:
    return list(range(base, base + blocks * BS)) + [7]  # one extra token: every full block is cached


def hit_tokens(m: KVCacheManager, tokens: list[int], salt=None) -> int:
    return m.find_prefix_hit(tokens, salt=salt).num_tokens


def test_tenants_of_chained_blocks_come_from_the_first_blocks_salt():
    m = KVCacheManager(21, BS, tenant_share=0.5)
    cache_prompt(m, prompt(0, 3), salt="a")
    cache_prompt(m, prompt(100, 2), salt=b"b")
    cache_prompt(m, prompt(200, 1))
    # every full block of a chain counts for its first block's salt; the lone trailing token is a partial block
    assert m.pool.cached_by_tenant() == {"a": 4, b"b": 3, None: 2}
    m.check_invariants()
    m.pool.reset_prefix_cache()
    assert m.pool.cached_by_tenant() == {} and m.pool.quota.over == frozenset()
    m.check_invariants()


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_flooding_tenant_evicts_its_own_blocks_first_only_under_a_quota(share):
    m = KVCacheManager(21, BS, tenant_share=share)  # 20 usable blocks; limit 10 at share 0.5
    b_prompt = prompt(1000, 3)
    cache_prompt(m, b_prompt, salt="b")  # the oldest cached blocks: first in plain eviction order
    assert hit_tokens(m, b_prompt, "b") == 3 * BS
    for i in range(6):  # tenant a sends 6 prompts of 4 blocks (+ a partial): far more than the pool holds
        cache_prompt(m, prompt(i * 100, 4), salt="a")
        m.check_invariants()
        assert sum(m.pool.cached_by_tenant().values()) <= 20
    if share < 1:
        assert hit_tokens(m, b_prompt, "b") == 3 * BS  # b's prefix survived the flood
        assert m.pool.cached_by_tenant()["b"] == 4
    else:
        assert hit_tokens(m, b_prompt, "b") == 0  # without the quota the flood evicted it
        assert "b" not in m.pool.cached_by_tenant()
    assert hit_tokens(m, prompt(500, 4), "a") == 4 * BS  # a's latest prompt is cached either way
    m.check_invariants()


def test_under_quota_eviction_follows_the_plain_order():
    def order_of_evictions(share):
        m = KVCacheManager(13, BS, tenant_share=share)  # 12 usable, limit 7 at share 0.6
        cache_prompt(m, prompt(0, 2), salt="a")  # 3 blocks each: 9 cached, none over 7
        cache_prompt(m, prompt(100, 2), salt="b")
        cache_prompt(m, prompt(200, 2), salt="c")
        assert m.pool.quota.over == frozenset()
        before = [b.block_id for b in m.pool.eviction_order() if b.cached]
        evicted = []
        m.pool.add_evict_hook(lambda blk: evicted.append(blk.block_id))
        m.pool.get_new_blocks(m.pool.num_free_blocks - 5)  # the 3 uncached, then 4 cached blocks
        m.pool.check_invariants()  # (blocks taken from the pool directly: no table holds them)
        return before, evicted

    before, evicted = order_of_evictions(0.6)
    assert evicted == before[:4]
    assert order_of_evictions(1.0)[1] == evicted


def test_an_over_quota_tenant_keeps_its_share_and_the_rest_go_in_its_own_order():
    m = KVCacheManager(21, BS, tenant_share=0.25)  # limit 5
    cache_prompt(m, prompt(1000, 2), salt="b")  # 3 blocks of b, oldest
    a_ids = []
    for i in range(3):
        a_ids += cache_prompt(m, prompt(i * 100, 2), salt="a")  # 9 blocks of a: 4 over the limit
    assert m.pool.quota.over == frozenset({"a"})
    a_order = [b.block_id for b in m.pool.eviction_order() if b.cached and b.tenant == "a"]
    evicted = []
    m.pool.add_evict_hook(lambda blk: evicted.append((blk.tenant, blk.block_id)))
    uncached = m.pool.num_free_blocks - 12
    m.pool.get_new_blocks(uncached + 6)  # 6 evictions: a's 4 over-quota blocks, then the global head (b's)
    assert evicted[:4] == [("a", i) for i in a_order[:4]]
    assert [t for t, _ in evicted[4:]] == ["b", "b"]
    assert m.pool.cached_by_tenant() == {"a": 5, "b": 1}
    m.pool.check_invariants()


def test_held_blocks_count_but_only_free_ones_are_evicted():
    m = KVCacheManager(13, BS, tenant_share=0.5)  # limit 6
    s = m.open(prompt(0, 8), salt="a")  # 9 blocks held by a running sequence
    assert m.allocate_slots(s.seq_id) is not None
    m.commit(s.seq_id)
    cache_prompt(m, prompt(500, 1), salt="b")  # b: 2 blocks, the only free cached ones
    assert m.pool.quota.over == frozenset({"a"})
    m.pool.get_new_blocks(m.pool.num_free_blocks)  # a has nothing free to give: b's go, nothing breaks
    assert "b" not in m.pool.cached_by_tenant()
    m.pool.check_invariants()


def test_windowed_blocks_take_the_tenant_of_their_chain():
    groups = [KVCacheGroupSpec("full"), KVCacheGroupSpec("sliding", window=2 * BS)]
    m = KVCacheManager(41, BS, groups, tenant_share=0.5)
    cache_prompt(m, prompt(0, 4), salt="a")
    assert set(m.pool.cached_by_tenant()) == {"a"}
    m.check_invariants()


def test_the_share_is_validated():
    for bad in (0, -0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="tenant_share"):
            BlockPool(4, BS, tenant_share=bad)
        with pytest.raises(ValueError, match="primary_tenant_share"):
            KvCacheConfig(primary_tenant_share=bad)
    assert TenantQuota(1.0, 10).limit == 10 and KvCacheConfig().primary_tenant_share == 1.0
    m = KVCacheManager.from_config(KvCacheConfig(backend="paged", primary_tenant_share=0.3), 11)
    assert m.pool.quota.limit == 3


# ---- through a real server ----------------------------------------------------------------------------------
B_QUESTION = "Explain, in a few words, what a Python generator is and when one would use it instead of a list."


@pytest.fixture(params=[0.5, 1.0], ids=["quota", "no-quota"])
def small_server(request, test_model_dir):
    from testkit.serve_thread import serve_in_thread

    kv = KvCacheConfig(backend="paged", kv_cache_budget=320 << 10, primary_tenant_share=request.param)
    config = RunConfig(model=str(test_model_dir("llama")), kv=kv, speculative=SpeculativeConfig(),
                       engine=EngineConfig(max_sequences=1))
    with serve_in_thread(config, model_name="m") as srv:
        yield srv, request.param


def ask(server, text: str, salt: str) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one greedy chat request."""
    from testkit.serve_thread import openai_client

    client = openai_client(server.url, api_key="k")
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=1,
                                           temperature=0, extra_body={"cache_salt": salt})
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


def test_a_flooding_tenant_leaves_another_tenants_prefix_cached_only_under_the_quota(small_server):
    server, share = small_server
    blocks = httpx.get(server.url + "/v1/cache/stats", timeout=30).json()["kv_blocks"]
    total, bs = blocks["total"], blocks["block_size"]
    prompt_tokens, cached = ask(server, B_QUESTION, "tenant-b")
    assert cached == 0 and 4 * prompt_tokens < total * bs  # b's prompt takes well under a quarter of the pool
    assert ask(server, B_QUESTION, "tenant-b")[1] > 0
    flooded = 0
    for i in range(100):  # tenant a: distinct prompts until they have cached twice the pool
        n, _ = ask(server, f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(12)), "tenant-a")
        flooded += n
        if flooded > 2 * total * bs:
            break
    stats = httpx.get(server.url + "/v1/cache/stats", timeout=30).json()
    assert stats["evictions"] > 0
    hit = ask(server, B_QUESTION, "tenant-b")[1]
    if share < 1:
        assert hit >= (prompt_tokens - 1) // bs * bs  # every full block of b's prompt survived the flood
    else:
        assert hit == 0  # plain LRU: the flood evicted b's older prefix
