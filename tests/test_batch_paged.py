"""BatchEngine over a paged CachePool: exact tokens, prefix hits, salts, preemption, disconnects."""

import time

import httpx
import pytest

from mlxkv.config import KvCacheConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.request import (
    GenerationRequest,
    PromptTooLongError,
    RetentionRange,
    RetentionSpec,
)
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.store import CachePool
from testkit.run_config import run_config
from testkit.serve_thread import serve_in_thread

PROMPTS = [[(7 * i + 11 * j) % 900 + 10 for i in range(n)] for j, n in enumerate((1, 6, 13, 29, 47))]
PARAMS = SamplingParams(max_tokens=16)



@pytest.fixture(scope="module")
def expected(model):
    return [list(DirectEngine(model, None, pool=CachePool(model, max_sequences=1)).generate_tokens(p, PARAMS))
            for p in PROMPTS]


def paged_engine(model, num_blocks=None, max_sequences=4, block_size=4):
    pool = CachePool(model, max_sequences=max_sequences, backend="paged", num_blocks=num_blocks,
                     kv_config=KvCacheConfig(backend="paged", block_size=block_size, kv_cache_budget=1 << 22))
    cfg = EngineConfig(max_sequences=max_sequences, prefill_chunk_size=8)
    return BatchEngine(model, None, config=cfg, pool=pool, context_length=4096).start(), pool


def run_all(engine, requests):
    handles = [engine.submit(r) for r in requests]
    out = []
    for h in handles:
        events = list(h)
        assert events[-1].kind == "done", events[-1]
        out.append([e.token for e in events if e.kind == "token"])
    return out


def test_concurrent_greedy_over_paged_pool_equals_direct_engine(model, expected):
    engine, pool = paged_engine(model)
    try:
        got = run_all(engine, [GenerationRequest(p, PARAMS) for p in PROMPTS])
        # parallel samples: each sample's sequence takes the prompt's cached blocks
        events = list(engine.submit(GenerationRequest(PROMPTS[4], PARAMS, n=3)))
        fork = [[e.token for e in events if e.kind == "token" and e.index == i] for i in range(3)]
        stats = engine.stats()
    finally:
        engine.stop()
    assert got == expected
    assert events[-1].kind == "done" and fork == [expected[4]] * 3  # greedy: every sample equals the direct run
    assert stats["batched_decode"] and stats["batched_steps_total"] > 0 and stats["max_batch"] == 4
    assert stats["kv_blocks"]["paged"] and stats["kv_blocks"]["used"] == 0 and stats["kv_blocks"]["cached"] > 0
    assert stats["pool_sequences"] == 0 and stats["running"] == 0 and stats["preemptions"] == 0
    pool.check_invariants()


def test_prefix_hits_and_salts(model):
    shared = PROMPTS[4] + [5, 6, 7]
    engine, pool = paged_engine(model)
    try:
        a = run_all(engine, [GenerationRequest(shared, PARAMS)])
        s1 = engine.stats()["prefix_cache"]
        b = run_all(engine, [GenerationRequest(PROMPTS[4] + [9], PARAMS)])  # shares 47 tokens = 11 blocks of 4
        s2 = engine.stats()["prefix_cache"]
        c = run_all(engine, [GenerationRequest(shared, PARAMS, cache_salt="tenant-a")])
        s3 = engine.stats()["prefix_cache"]
        d = run_all(engine, [GenerationRequest(shared, PARAMS, cache_salt="tenant-b")])
        s4 = engine.stats()["prefix_cache"]
        e = run_all(engine, [GenerationRequest(shared, PARAMS, cache_salt="tenant-a")])
        s5 = engine.stats()["prefix_cache"]
    finally:
        engine.stop()
    assert s1["hits"] == 0 and s1["queries"] == len(shared)
    assert s2["hits"] - s1["hits"] == 47  # the shared 47 tokens: 11 full blocks + 3 tokens by partial reuse
    assert s3["hits"] == s2["hits"] and s4["hits"] == s3["hits"]  # new salts: nothing cached under them
    assert s5["hits"] - s4["hits"] == len(shared) - 1  # same salt again: all but the last token (recomputed)
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert a == c == d == e == [list(direct.generate_tokens(shared, PARAMS))]
    assert b == [list(direct.generate_tokens(PROMPTS[4] + [9], PARAMS))]
    pool.check_invariants()


def test_tiny_budget_preempts_and_every_request_completes_exactly(model, expected):
    engine, pool = paged_engine(model, num_blocks=20)  # 19 blocks of 4 tokens for 5 sequences of up to 63
    try:
        with pytest.raises(PromptTooLongError, match="KV cache budget"):
            engine.submit(GenerationRequest(list(range(1, 100)), PARAMS))
        got = run_all(engine, [GenerationRequest(p, PARAMS) for p in PROMPTS])
        stats = engine.stats()
    finally:
        engine.stop()
    assert got == expected
    assert stats["preemptions"] > 0 and stats["evictions"] > 0
    assert stats["pool_sequences"] == 0 and stats["preempted"] == 0 and stats["kv_blocks"]["used"] == 0
    pool.check_invariants()


def test_retention_rules_reach_the_cached_blocks(model, expected):
    engine, pool = paged_engine(model)
    retention = RetentionSpec(ranges=(RetentionRange(0, None, 90),), decode_priority=10)
    try:
        got = run_all(engine, [GenerationRequest(PROMPTS[2], PARAMS, retention=retention, priority=3)])
        by_priority = engine.stats()["kv_blocks"]["cached_by_priority"]
    finally:
        engine.stop()
    assert got == [expected[2]]
    # 13 prompt + 15 fed decode tokens in blocks of 4: blocks 0-3 hold prompt tokens (90), blocks 4-6 decode only
    assert {k: v for k, v in by_priority.items() if k in ("10", "90")} == {"90": 4, "10": 3}
    pool.check_invariants()


@pytest.mark.server
def test_server_prefix_metrics_reset_and_disconnect(test_model_dir):
    config = run_config(str(test_model_dir("llama")), engine=EngineConfig(max_sequences=2), kv_backend="paged",
                        kv_block_size=4, kv_cache_budget=1 << 22)
    prefix = "You are a careful assistant. " * 8
    with serve_in_thread(config, model_name="tiny") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        for q in ("What is a tuple?", "What is a list?"):
            r = http.post("/v1/completions", json={"prompt": prefix + q, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
        stats = http.get("/v1/cache/stats").json()
        assert stats["kv_backend"] == "paged" and stats["prefix_cache"]["hits"] > 40
        metrics = http.get("/metrics").text
        hits = [line for line in metrics.splitlines() if line.startswith("mlxkv_prefix_cache_hits_total")]
        assert float(hits[0].split()[-1]) == stats["prefix_cache"]["hits"]
        assert "mlxkv_kv_blocks_cached_by_priority{priority=\"35\"}" in metrics
        cached = []
        for salt in ("alice", "bob", "alice"):  # the same prompt under two salts: no hit across them
            body = {"prompt": prefix + "Hi", "max_tokens": 2, "temperature": 0, "cache_salt": salt}
            cached.append(http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"])
        assert [c["cached_tokens"] > 0 for c in cached] == [False, False, True]
        too_long = http.post("/v1/completions", json={"prompt": list(range(5, 5 + 40000)), "max_tokens": 1})
        assert too_long.status_code == 400
        body = {"prompt": prefix, "max_tokens": 4096, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(4))
        engine = srv.parts.engine
        deadline = time.monotonic() + 20
        while engine.stats()["pool_sequences"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = http.get("/v1/cache/stats").json()
        assert stats["running"] == 0 and stats["pool_sequences"] == 0 and stats["cancelled_total"] == 1
        cached = stats["kv_blocks"]["cached"]
        reset = http.post("/v1/cache/reset").json()
        assert reset["prefix_cache_blocks_freed"] == cached > 0
        assert http.get("/v1/cache/stats").json()["kv_blocks"]["cached"] == 0
    srv.parts.engine.pool.check_invariants()
