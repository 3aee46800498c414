"""Absorbed MLA on latent pages (MLXKV_MLA_ABSORBED=1, paged backend): equal to the dense absorbed path for prefill
chunks and decode (split-KV too), prefix hits reuse all but the last token, fork, batched decode, batched prefill and
preemption in the batch engine, speculative verification and rewinds, the secondary tier round-trips latent pages,
and a block's bytes are the latent rows'."""

from __future__ import annotations

import mlx.core as mx
import pytest
from testkit.deepseek import ARCHS, build_deepseek

from mlxkv.config import KvCacheConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.env import reload as reload_flags
from mlxkv.kv import make_batch_views
from mlxkv.kv.layouts import make_caches
from mlxkv.kv.paged import PagedBackend
from mlxkv.kv.paged.latent_pages import LatentPagedCache
from mlxkv.kv.store import CachePool
from mlxkv.mla import apply_mla, set_mla_mode

BS = 4
PROMPT = [(13 * i + 7) % 900 + 10 for i in range(37)]
OTHER = [(11 * i + 5) % 900 + 10 for i in range(44)]
STEPS = 10


@pytest.fixture(scope="module", params=ARCHS)
def mla(request):
    """(arch, model with absorbed MLA swapped in) under MLXKV_MLA_ABSORBED=1; the flags are re-read after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXKV_MLA_ABSORBED", "1")
        reload_flags()
        model, config = build_deepseek(request.param)
        assert apply_mla(model)
        yield request.param, model, config
    reload_flags()


@pytest.fixture
def model(mla):
    m = mla[1]
    yield m
    set_mla_mode(m, "auto")
    for layer in m.layers:
        layer.self_attn.split_kv = False


def close(a, b, tol=1e-5):
    """Within ``tol`` of the logits' scale (a gather of pages vs a dense buffer may block a matmul differently)."""
    return mx.abs(a - b).max().item() <= tol * max(1.0, mx.abs(b).max().item())


def paged_pool(model, num_blocks=200, max_sequences=4, **kw):
    return CachePool(model, backend="paged", num_blocks=num_blocks, max_sequences=max_sequences,
                     kv_config=KvCacheConfig(backend="paged", block_size=BS, **kw))


def run(model, caches, prompt, chunks, steps, seq=None):
    """Prefill ``prompt`` in ``chunks`` pieces (from ``seq.num_cached`` on a paged sequence), then greedy decode;
    returns (tokens, logits per step). ``seq``: the paged bridge (feed / commit), None on dense caches."""
    start = seq.num_cached if seq is not None else 0
    rest = prompt[start:]
    cut = [start + len(rest) * i // chunks for i in range(chunks + 1)]
    for a, b in zip(cut, cut[1:]):
        logits = model(mx.array(prompt[a:b], dtype=mx.uint32)[None], cache=caches)[0, -1]
        mx.eval(logits)
        if seq is not None:
            seq.commit()
    tokens, history = [], [logits]
    for _ in range(steps):
        tok = int(mx.argmax(logits).item())
        tokens.append(tok)
        if seq is not None:
            seq.feed([tok])
        logits = model(mx.array([[tok]], dtype=mx.uint32), cache=caches)[0, -1]
        mx.eval(logits)
        if seq is not None:
            seq.commit()
        history.append(logits)
    return tokens, history


def split(model, chunk):
    for layer in model.layers:
        layer.self_attn.split_kv, layer.self_attn.split_chunk = True, chunk


def test_block_bytes_are_latent_rows_and_the_budget_counts_them(mla):
    _, model, config = mla
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    assert all(isinstance(c, LatentPagedCache) for c in seq.caches)
    pool.release(seq.id)
    per_token = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4  # float32
    assert pool.paged.bytes_per_block == BS * per_token
    budget = paged_pool(model, num_blocks=None, kv_cache_budget=100 * BS * per_token)
    assert budget.paged.num_blocks == 100


@pytest.mark.parametrize("mode,split_chunk", [("auto", None), ("absorbed", None), ("absorbed", 8)])
def test_paged_latent_equals_dense_absorbed(model, mode, split_chunk):
    set_mla_mode(model, mode)
    if split_chunk:
        split(model, split_chunk)
    want_tokens, want = run(model, make_caches(model), PROMPT, 3, STEPS)
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    tokens, got = run(model, seq.caches, PROMPT, 3, STEPS, seq.paged)
    assert tokens == want_tokens
    assert all(close(g, w) for g, w in zip(got, want))
    pool.release(seq.id)
    pool.check_invariants()


def test_prefix_hit_reuses_all_but_the_last_token(model):
    set_mla_mode(model, "absorbed")  # the suffix chunk attends over shared pages then new ones
    want_tokens, want = run(model, make_caches(model), PROMPT, 1, STEPS)
    pool = paged_pool(model)
    first = pool.open(prompt=PROMPT)
    run(model, first.caches, PROMPT, 1, 0, first.paged)
    pool.release(first.id)
    second = pool.open(prompt=PROMPT)
    assert second.num_cached == len(PROMPT) - 1
    tokens, got = run(model, second.caches, PROMPT, 1, STEPS, second.paged)
    assert tokens == want_tokens and all(close(g, w) for g, w in zip(got, want))
    shared = PROMPT[:32] + OTHER[:9]  # 8 full blocks in common with PROMPT
    third = pool.open(prompt=shared)
    assert third.num_cached == 32
    assert run(model, third.caches, shared, 1, STEPS, third.paged)[0] == run(model, make_caches(model), shared, 1,
                                                                          STEPS)[0]
    for s in (second, third):
        pool.release(s.id)
    pool.check_invariants()


def test_fork_children_share_latent_pages_and_continue_exactly(model):
    want_tokens, _ = run(model, make_caches(model), PROMPT, 1, STEPS)
    pool = paged_pool(model, max_sequences=4)
    parent = pool.open(prompt=PROMPT)
    run(model, parent.caches, PROMPT, 1, 0, parent.paged)
    used = pool.paged.manager.pool.num_used_blocks
    children = pool.fork(parent.id, 3)
    assert pool.paged.manager.pool.num_used_blocks == used  # shared, nothing copied yet
    pool.release(parent.id)
    assert all(isinstance(c, LatentPagedCache) for child in children for c in child.caches)
    first = want_tokens[0]
    for child in children:
        tokens, y = [], first
        for _ in range(STEPS - 1):
            tokens.append(y)
            child.feed([y])
            y = int(mx.argmax(model(mx.array([[y]], dtype=mx.uint32), cache=child.caches)[0, -1]).item())
            child.commit()
        assert tokens + [y] == want_tokens
    for child in children:
        pool.release(child.id)
    pool.check_invariants()
    assert pool.paged.manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("split_chunk", [None, 8])
def test_batched_decode_view_equals_each_sequence_alone(model, split_chunk):
    """Three sequences of different lengths in one batched decode forward; with split-KV chunks of 8 keys, the
    short sequence's padded rows fill whole chunks (their LSE weight must be 0)."""
    if split_chunk:
        split(model, split_chunk)
    prompts = [PROMPT[:5], PROMPT, OTHER[:21]]
    last = [13, 99, 400]
    single = []
    for p, t in zip(prompts, last):
        caches = make_caches(model)
        model(mx.array(p, dtype=mx.uint32)[None], cache=caches)
        single.append(model(mx.array([[t]], dtype=mx.uint32), cache=caches)[0, -1])
    pool = paged_pool(model)
    seqs = []
    for p in prompts:
        seq = pool.open(prompt=p)  # PROMPT hits the first block of PROMPT[:5]
        model(mx.array(p[seq.num_cached:], dtype=mx.uint32)[None], cache=seq.caches)
        seq.commit()
        seqs.append(seq)
    for seq, t in zip(seqs, last):
        seq.feed([t])
    views = make_batch_views([s.caches for s in seqs])
    batched = model(mx.array([[t] for t in last], dtype=mx.uint32), cache=views)[:, -1]  # (3, vocab)
    assert all(v.attended for v in views)
    for b in range(3):
        assert close(batched[b], single[b])
        assert int(mx.argmax(batched[b]).item()) == int(mx.argmax(single[b]).item())
    for seq in seqs:
        seq.commit()
        pool.release(seq.id)
    pool.check_invariants()


PROMPTS = [PROMPT[:n] for n in (3, 11, 26)] + [OTHER[:17]]
PARAMS = SamplingParams(max_tokens=12)


def test_batch_engine_batches_decode_and_prefill_preempts_and_equals_direct(model):
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    expected = [list(direct.generate_tokens(p, PARAMS)) for p in PROMPTS]
    # 14 blocks: 13 of 4 tokens for 4 sequences of up to 38 tokens
    for num_blocks, preempts, batched_prefill in ((200, False, True), (14, True, False)):
        pool = paged_pool(model, num_blocks=num_blocks)
        config = EngineConfig(max_sequences=4, prefill_chunk_size=8, batched_prefill=batched_prefill)
        engine = BatchEngine(model, None, config=config, pool=pool, context_length=4096).start()
        try:
            handles = [engine.submit(GenerationRequest(p, PARAMS)) for p in PROMPTS]
            got = [[e.token for e in h if e.kind == "token"] for h in handles]
            stats = engine.stats()
        finally:
            engine.stop()
        assert got == expected
        assert stats["batched_decode"] and stats["batched_steps_total"] > 0
        assert (stats["preemptions"] > 0) == preempts
        assert stats["batched_prefill"] == batched_prefill, stats["batched_prefill_reason"]
        assert (stats["batched_prefills_total"] > 0) == batched_prefill
        assert stats["kv_blocks"]["used"] == 0
        pool.check_invariants()


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_secondary_tier_round_trips_latent_pages(model, tmp_path, where):
    tier = dict(secondary_memory_bytes=1 << 20) if where == "memory" else dict(secondary_disk_dir=str(tmp_path),
                                                                              secondary_disk_bytes=1 << 20)
    be = PagedBackend(model, KvCacheConfig(backend="paged", block_size=BS, **tier), num_blocks=12)

    def once(tokens):
        caches, seq = be.open(tokens)
        cached = seq.num_cached
        logits = model(mx.array(tokens[cached:], dtype=mx.uint32)[None], cache=caches)[0, -1]
        mx.eval(logits)
        seq.commit()
        be.release(seq)
        return logits, cached

    def pages(tokens):
        ids = [b.block_id for b in be.manager.find_prefix_hit(tokens).blocks[0]]
        out = [p[:, ids] for layer in range(len(be.storage.k_rows)) if be.storage.allocated(layer)
               for p in be.storage.pages(layer)]  # (1, n, BS, R) latent and (1, n, BS, dr) rope-key pages
        mx.eval(out)
        return out

    prompt = PROMPT[:22]  # 5 usable full blocks
    reference, cached = once(prompt)
    assert cached == 0
    before = pages(prompt)
    assert {p.shape[-1] for p in before} == {model.layers[0].self_attn.kv_lora_rank,
                                             model.layers[0].self_attn.qk_rope_head_dim}
    once(OTHER)  # 11 blocks: evicts every block of prompt into the tier
    assert be.manager.find_prefix_hit(prompt).num_full_blocks == 0
    logits, cached = once(prompt)
    st = be.tier_stats()
    assert cached == 20 and st["secondary_hit_blocks"] == 5 and st["secondary"][f"hits_{where}"] == 5
    after = pages(prompt)
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, before))
    assert close(logits, reference) and int(mx.argmax(logits).item()) == int(mx.argmax(reference).item())
    be.check_invariants()


def test_speculative_verification_on_latent_pages_equals_greedy(model):
    """Multi-token verification steps over latent pages, then rewinds of every length through the manager."""
    from testkit.speculative import ScriptedDrafter

    from mlxkv.engine.speculative import SpeculativeEngine

    reference = list(DirectEngine(model, None, pool=CachePool(model, max_sequences=1)).generate_tokens(
        PROMPT, SamplingParams(max_tokens=16)))
    pool = paged_pool(model, max_sequences=1)
    rounds = []
    engine = SpeculativeEngine(model, None, ScriptedDrafter(reference), num_draft_tokens=3, pool=pool,
                               on_round=lambda seq, r: rounds.append(r))
    assert list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=16))) == reference
    assert {r.accepted for r in rounds if r.drafted == 3} == {0, 1, 2, 3}  # every rewind length
    pool.check_invariants()
    assert pool.paged.manager.pool.num_used_blocks == 0
