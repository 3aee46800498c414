"""Prefix caching over paged storage: hits recompute only the uncached tail with equal logits; salts isolate;
shared prefixes hit; trim then regenerate is exact; release returns every block; invariants hold throughout."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import trim_prompt_cache
from testkit.archs import ARCHITECTURES, build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.layouts import install_attention_hook, make_caches
from mlxkv.kv.store import CachePool, CacheRequest

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]
OTHER_TAIL = [(11 * i + 5) % 900 + 10 for i in range(13)]
BS = 4


def scale_close(paged, dense, tol=1e-5):
    """Logits equal within 1e-5 of their scale (see tests/test_paged_cache.py for why not bit-equal)."""
    return mx.abs(paged - dense).max().item() <= tol * max(1.0, mx.abs(dense).max().item())


def paged_pool(model, num_blocks=200, **kw):
    return CachePool(model, backend="paged", num_blocks=num_blocks, max_sequences=4,
                     kv_config=KvCacheConfig(backend="paged", block_size=BS, **kw))


def all_blocks_free(pool):
    return pool.paged.manager.pool.num_free_blocks == pool.paged.num_blocks - 1


def prefill(model, seq, prompt):
    """Prefill the uncached part of ``prompt`` in the chunks the sequence asks for (a recurrent hybrid's
    snapshots are taken between them), committing each; return the last logits (vocab,)."""
    pos = seq.num_cached
    while len(prompt) - 1 - pos > 0:
        n = seq.prefill_chunk(pos, len(prompt) - 1 - pos)
        mx.eval(model(mx.array(prompt[pos:pos + n], dtype=mx.uint32)[None], cache=seq.caches))
        seq.commit()
        pos += n
    logits = model(mx.array(prompt[pos:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]
    mx.eval(logits)
    seq.commit()
    return logits


def dense_logits(model, prompt):
    return model(mx.array(prompt, dtype=mx.uint32)[None], cache=make_caches(model))[0, -1]


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch_model(request):
    model, _ = build_model(request.param)
    install_attention_hook(model)
    return request.param, model


def test_second_run_hits_and_recomputes_one_token(arch_model):
    arch, model = arch_model
    pool = paged_pool(model)
    first = pool.open(prompt=PROMPT)
    assert first.num_cached == 0
    l1 = prefill(model, first, PROMPT)
    pool.release(first.id)
    pool.check_invariants()
    second = pool.open(prompt=PROMPT)
    # the last prompt token is always recomputed; qwen3_next resumes from its recurrent-state snapshot at the
    # prompt's last block boundary, here 44 = len - 1 as well (45 tokens, blocks of 4)
    assert second.num_cached == len(PROMPT) - 1
    l2 = prefill(model, second, PROMPT)
    assert scale_close(l2, dense_logits(model, PROMPT)) and scale_close(l1, l2)
    pool.check_invariants()
    pool.release(second.id)
    assert all_blocks_free(pool)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "llama4"])
def test_salts_isolate_and_shared_prefixes_hit(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model)
    a = pool.open(prompt=PROMPT, cache_request=CacheRequest(salt="tenant-a"))
    prefill(model, a, PROMPT)
    pool.release(a.id)
    b = pool.open(prompt=PROMPT, cache_request=CacheRequest(salt="tenant-b"))
    assert b.num_cached == 0  # other salt: never a hit
    prefill(model, b, PROMPT)
    pool.release(b.id)
    unsalted = pool.open(prompt=PROMPT)
    assert unsalted.num_cached == 0  # no salt is a salt of its own
    pool.release(unsalted.id)
    shared = PROMPT[:32] + OTHER_TAIL  # shares 8 full blocks with tenant a's prompt
    c = pool.open(prompt=shared, cache_request=CacheRequest(salt="tenant-a"))
    assert c.num_cached == 32
    assert scale_close(prefill(model, c, shared), dense_logits(model, shared))
    d = pool.open(prompt=PROMPT, cache_request=CacheRequest(salt="tenant-a"))  # while c runs: a's blocks are shared, not copied
    assert d.num_cached == len(PROMPT) - 1
    assert scale_close(prefill(model, d, PROMPT), dense_logits(model, PROMPT))
    pool.check_invariants()
    pool.release(c.id)
    pool.release(d.id)
    pool.check_invariants()
    assert all_blocks_free(pool)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "llama4"])
def test_trim_then_regenerate_is_exact(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    logits = prefill(model, seq, PROMPT)
    tokens, history = [], []
    for _ in range(20):
        tok = int(mx.argmax(logits).item())
        tokens.append(tok)
        seq.feed([tok])
        logits = model(mx.array([[tok]], dtype=mx.uint32), cache=seq.caches)[0, -1]
        mx.eval(logits)
        seq.commit()
        history.append(logits)
    used = pool.paged.manager.pool.num_used_blocks
    assert trim_prompt_cache(seq.caches, 9) == 9  # mlx-lm's helper: every layer trims through the manager
    assert all(c.offset == len(PROMPT) + 11 for c in seq.caches if hasattr(c, "offset"))
    assert pool.paged.manager.num_tokens(seq.paged.seq_id) == len(PROMPT) + 11
    assert pool.paged.manager.pool.num_used_blocks < used  # emptied tail blocks went back to the pool
    pool.check_invariants()
    for i in range(11, 20):  # regenerate the trimmed tokens: the same logits as the first time
        seq.feed([tokens[i]])
        logits = model(mx.array([[tokens[i]]], dtype=mx.uint32), cache=seq.caches)[0, -1]
        seq.commit()
        # The regenerated rows may sit in other blocks than the first time (the emptied tail block stays cached),
        # so attention may run over page runs instead of one view: equal up to float rounding, not bit for bit.
        assert scale_close(logits, history[i], tol=1e-5)
    pool.release(seq.id)
    pool.check_invariants()
    assert all_blocks_free(pool)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_direct_engine_paged_equals_dense_and_hits_on_rerun(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    params = SamplingParams(max_tokens=24)
    expected = list(DirectEngine(model, None, pool=CachePool(model)).generate_tokens(PROMPT, params))
    pool = paged_pool(model)
    engine = DirectEngine(model, None, pool=pool)
    assert list(engine.generate_tokens(PROMPT, params)) == expected
    assert engine.last_stats.cached_prompt_tokens == 0
    assert list(engine.generate_tokens(PROMPT, params)) == expected
    assert engine.last_stats.cached_prompt_tokens == len(PROMPT) - 1  # qwen3_next: a snapshot at 44 (see above)
    # a continuation of the first conversation hits its decoded tokens too (they were committed)
    follow = PROMPT + expected[:16]
    list(engine.generate_tokens(follow, SamplingParams(max_tokens=4)))
    # qwen3_next: the snapshots lie at the prompt's end (44) and the first run's end (68, past this prompt)
    assert engine.last_stats.cached_prompt_tokens >= (44 if arch == "qwen3_next" else len(PROMPT))
    assert len(pool) == 0
    pool.check_invariants()
    assert all_blocks_free(pool)


def test_eviction_under_pressure_stays_exact():
    model, _ = build_model("llama")
    install_attention_hook(model)
    pool = paged_pool(model, num_blocks=20)  # 19 blocks: each 45-token prompt + 8 tokens needs 14
    engine = DirectEngine(model, None, pool=pool)
    params = SamplingParams(max_tokens=8)
    prompts = [[(t + k * 97) % 1000 for t in PROMPT] for k in range(3)] + [PROMPT]
    for p in prompts:
        expected = list(DirectEngine(model, None, pool=CachePool(model)).generate_tokens(p, params))
        assert list(engine.generate_tokens(p, params)) == expected
        pool.check_invariants()
        assert all_blocks_free(pool)
    assert pool.paged.manager.pool.stats().evictions > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_partial_block_reuse_copies_the_matching_rows(arch, monkeypatch):
    """A prompt matching 2 rows into a cached full block: the manager hands out a CopyOp (the block stays
    cached for others), the storage copies those rows, and prefill continues from inside the block."""
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model)
    copies = []
    real = pool.paged.storage.copy_blocks
    monkeypatch.setattr(pool.paged.storage, "copy_blocks", lambda ops: copies.extend(ops) or real(ops))
    base = PROMPT + OTHER_TAIL[:3]  # 48 tokens: 12 full blocks of 4
    first = pool.open(prompt=base)
    prefill(model, first, base)
    pool.release(first.id)
    prompt = base[:46] + [3, 4, 5]  # diverges at position 46, inside block 11
    seq = pool.open(prompt=prompt)
    assert seq.num_cached == 46
    assert copies and all(c[3] == 2 for c in copies)  # (layer, src, dst, 2 rows) for every layer of the group
    assert scale_close(prefill(model, seq, prompt), dense_logits(model, prompt))
    pool.check_invariants()
    pool.release(seq.id)
    assert all_blocks_free(pool)
