"""Batched prefill: chunks of different sequences and lengths in one forward, equal to one-by-one prefill."""

import mlx.core as mx
import pytest
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.prefill_batch import last_rows, prefill_inputs, prefill_together
from mlxkv.engine.request import GenerationRequest, RequestHandle
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.scheduler import Job, Scheduler
from mlxkv.kv.batching.dense_views import BatchUnsupported
from mlxkv.kv.layouts import make_caches
from mlxkv.kv.layouts.attention_hook import install_attention_hook
from mlxkv.kv.store import CachePool

pytestmark = pytest.mark.float_order

SHARED = [(7 * i) % 800 + 20 for i in range(21)]  # 5 whole blocks of 4, then one token
SUFFIXES = [[101, 102, 103, 104, 105, 106], [201], [301, 302, 303]]
PARAMS = SamplingParams(max_tokens=5)


def paged_pool(model, **kw):
    return CachePool(model, max_sequences=8, backend="paged",
                     kv_config=KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22), **kw)


def close(a: mx.array, b: mx.array) -> bool:
    return mx.abs(a - b).max().item() <= 1e-5 * max(1.0, mx.abs(b).max().item())


def test_inputs_are_right_padded_with_each_rows_last_token_and_last_rows_pick_real_positions():
    assert prefill_inputs([[1, 2, 3], [4]]).tolist() == [[1, 2, 3], [4, 4, 4]]
    logits = mx.arange(2 * 3 * 2).reshape(2, 3, 2)  # (B, Lmax, vocab)
    assert last_rows(logits, [3, 1]).tolist() == [[4, 5], [6, 7]]


@pytest.mark.parametrize("backend", ["paged", "dense"])
def test_a_batched_prefill_equals_one_by_one(model, backend):
    """Three prompts sharing a cached prefix (paged: a prefix-cache hit, the suffixes in new pages) prefill
    their suffixes of 6, 1 and 3 tokens in one forward: each last position's logits and the next decode step
    equal a dense cache's that ran the whole prompt alone."""
    pool = paged_pool(model) if backend == "paged" else CachePool(model, max_sequences=8)
    prompts = [SHARED + s for s in SUFFIXES]
    if backend == "paged":  # cache the shared blocks first
        warm = pool.open(prompt=SHARED + [9])
        mx.eval(model(mx.array([SHARED + [9]], dtype=mx.uint32), cache=warm.caches))
        warm.commit()
        pool.release(warm.id)
    seqs = [pool.open(prompt_length=len(p), **({"prompt": p} if backend == "paged" else {})) for p in prompts]
    done = [s.num_cached for s in seqs]
    if backend == "paged":
        assert min(done) >= 20  # at least the five whole shared blocks from the prefix cache
    else:  # dense: prefill the shared part one by one first, so the batch runs over a cached prefix too
        for s in seqs:
            mx.eval(model(mx.array([SHARED], dtype=mx.uint32), cache=s.caches))
        done = [len(SHARED)] * 3
    chunks = [p[d:] for p, d in zip(prompts, done)]
    last = prefill_together(model, [s.caches for s in seqs], chunks)  # (3, vocab)
    for b, (seq, prompt) in enumerate(zip(seqs, prompts)):
        if backend == "paged":
            seq.commit()
        dense = make_caches(model)
        expected = model(mx.array([prompt], dtype=mx.uint32), cache=dense)[0, -1]
        assert close(last[b], expected)
        if backend == "paged":
            seq.feed([7])
        got = model(mx.array([[7]], dtype=mx.uint32), cache=seq.caches)[0, -1]  # the written rows are right
        assert close(got, model(mx.array([[7]], dtype=mx.uint32), cache=dense)[0, -1])
    for s in seqs:
        pool.release(s.id)
    if backend == "paged":
        pool.check_invariants()


def test_layers_that_are_not_full_attention_are_refused_before_any_write():
    gemma = build_model("gemma3_text")[0]  # sliding-window layers
    install_attention_hook(gemma)
    pool = CachePool(gemma, max_sequences=2)
    seqs = [pool.open(prompt_length=3), pool.open(prompt_length=2)]
    with pytest.raises(BatchUnsupported, match="full-attention"):
        prefill_together(gemma, [s.caches for s in seqs], [[1, 2, 3], [4, 5]])
    assert all(c.offset == 0 for s in seqs for c in s.caches if hasattr(c, "offset"))


def new_job(prompt: list[int], params: SamplingParams = PARAMS) -> Job:
    request = GenerationRequest(prompt, params)
    return Job(request=request, handle=RequestHandle(request), max_tokens=params.max_tokens)


def run(sched: Scheduler, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[list]:
    jobs = [new_job(p, params) for p in prompts]
    for job in jobs:
        sched.add(job)
    while sched.has_work():
        sched.step()
    return [list(job.handle) for job in jobs]


def arriving_mid_step(model, pool, late: Job) -> Scheduler:
    """A scheduler whose intake (called after a step's prefills) adds ``late`` once, as if it arrived then."""
    arrivals = [late]
    sched = Scheduler(model, None, pool)
    sched.intake = lambda: bool(arrivals) and (sched.add(arrivals.pop()) or True)
    return sched


def test_the_scheduler_prefills_admitted_requests_together_with_directs_tokens(model):
    """Requests admitted in the same step share one prefill forward (cold: each writes its whole short prompt;
    then again over the cached prefix); greedy and seeded tokens equal DirectEngine's, and the pool ends clean."""
    pool = paged_pool(model)
    sched = Scheduler(model, None, pool, batched_prefill=True)
    prompts = [SHARED + s for s in SUFFIXES]
    results = run(sched, prompts)
    assert sched.totals["batched_prefills"] == 1 and sched.batched_prefill
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    for prompt, events in zip(prompts, results):
        assert [e.token for e in events if e.kind == "token"] == list(direct.generate_tokens(prompt, PARAMS))
    # Again, now over the cached prefix with new endings (a prompt cached but for its last token would join the
    # decode batch instead), sampled with seeds.
    prompts = [p + [500 + i, 600 + i] for i, p in enumerate(prompts)]
    seeded = SamplingParams(max_tokens=5, temp=0.8, seed=3)
    results = run(sched, prompts, seeded)
    assert sched.totals["batched_prefills"] == 2
    assert all(r[-1].usage.cached_tokens >= 20 for r in results)  # at least the five shared blocks
    for prompt, events in zip(prompts, results):
        assert [e.token for e in events if e.kind == "token"] == list(direct.generate_tokens(prompt, seeded))
    assert len(pool) == 0
    pool.check_invariants()


@pytest.mark.parametrize("batched", [True, False])
def test_a_prompt_cached_but_for_its_last_token_joins_the_decode_batch(model, monkeypatch, batched):
    """A repeated prompt (the prefix cache holds all but its last token) runs no prefill forward of its own when
    decode is batched: the step's decode forward feeds that token, alongside a running request, and samples its
    first token. Greedy and seeded tokens equal DirectEngine's; unbatched decode keeps the one-token prefill."""
    pool = paged_pool(model)
    sched = Scheduler(model, None, pool, batched=batched)
    chunks = []
    real = sched._forward_chunk
    monkeypatch.setattr(sched, "_forward_chunk", lambda task, n: chunks.append(n) or real(task, n))
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    repeated = SHARED + SUFFIXES[0]
    run(sched, [repeated])  # now cached
    chunks.clear()
    other = SHARED[:9] + [900, 901, 902]  # a request sharing some blocks, running alongside
    seeded = SamplingParams(max_tokens=6, temp=0.8, seed=5)
    results = run(sched, [other, repeated, repeated], seeded)
    assert results[1][-1].usage.cached_tokens == len(repeated) - 1
    rest = len(other) - results[0][-1].usage.cached_tokens
    # other's uncached part only (batched), in one forward with its last position's logits
    assert chunks == ([rest] if batched else [rest, 1, 1])
    assert sched.totals["prefills_joined_decode"] == (2 if batched else 0)
    for prompt, events in zip([other, repeated, repeated], results):
        assert [e.token for e in events if e.kind == "token"] == list(direct.generate_tokens(prompt, seeded))
    assert len(pool) == 0
    pool.check_invariants()


def test_a_repeated_prompt_with_two_samples_joins_and_samples_as_a_fresh_one(model):
    """n=2, seeded: a prompt cached but for its last token (both samples join the decode batch) gives the tokens
    the same request gives on a pool that never saw it (prefill, first token from its logits)."""
    repeated = SHARED + SUFFIXES[2]
    params = SamplingParams(max_tokens=6, temp=0.9, seed=11)

    def choices(sched):
        request = GenerationRequest(repeated, params, n=2)
        handle = RequestHandle(request)
        sched.add(Job(request=request, handle=handle, max_tokens=params.max_tokens))
        while sched.has_work():
            sched.step()
        events = [e for e in handle if e.kind == "token"]
        return [[e.token for e in events if e.index == i] for i in range(2)]

    fresh = choices(Scheduler(model, None, paged_pool(model)))
    pool = paged_pool(model)
    sched = Scheduler(model, None, pool)
    run(sched, [repeated])  # now cached
    assert choices(sched) == fresh and sched.totals["prefills_joined_decode"] == 1
    assert len(pool) == 0
    pool.check_invariants()


def test_a_joined_prompts_first_token_comes_out_in_the_step_that_computes_it(model):
    """Decode steps overlap (a step's tokens are read while the next is built), but a step computing a joined
    prompt's first token is read at once: after one step the request has its first token."""
    pool = paged_pool(model)
    sched = Scheduler(model, None, pool)
    repeated = SHARED + SUFFIXES[0]
    run(sched, [repeated])  # now cached
    running = new_job(SHARED + [900, 901])
    sched.add(running)
    sched.step()
    sched.step()  # running decodes, its tokens in flight
    joined = new_job(repeated)
    sched.add(joined)
    sched.step()
    assert sched.totals["prefills_joined_decode"] == 1 and joined.first_token_at is not None
    while sched.has_work():
        sched.step()
    assert len(pool) == 0


def test_requests_arriving_during_a_steps_prefill_prefill_before_its_decode(model):
    """The scheduler's intake, called after the step's prefills, adds a request that arrived meanwhile: it is
    prefilled (first token out) in the same step, before the decode of the running one; tokens stay DirectEngine's."""
    pool = paged_pool(model)
    late = new_job(SHARED + [700, 701, 702])
    sched = arriving_mid_step(model, pool, late)
    first = new_job(SHARED + SUFFIXES[1])
    sched.add(first)
    sched.step()
    assert first.first_token_at is not None and late.first_token_at is not None  # both prefilled in step 1
    assert sched.totals["decode_steps"] == 1 and sched.totals["requests"] == 2
    while sched.has_work():
        sched.step()
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    for job in (first, late):
        assert [e.token for e in job.handle if e.kind == "token"] == list(direct.generate_tokens(job.request.prompt,
                                                                                                   PARAMS))
    assert len(pool) == 0


def test_a_long_prompt_arriving_mid_step_waits_for_the_next_step(model):
    """Prefill-first covers short prompts only: a request arriving during a step with more than MAX_BATCHED_CHUNK
    uncached tokens is opened but left for the next step, so the running sequence's decode is not held up."""
    from mlxkv.engine.scheduler import MAX_BATCHED_CHUNK

    pool = paged_pool(model)
    long_prompt = [(11 * i) % 900 + 30 for i in range(MAX_BATCHED_CHUNK + 40)]
    late = new_job(long_prompt)
    sched = arriving_mid_step(model, pool, late)
    first = new_job(SHARED + SUFFIXES[1])
    sched.add(first)
    sched.step()
    assert first.first_token_at is not None and late.first_token_at is None
    assert late.opened and sched.totals["decode_steps"] == 1  # opened, not prefilled; the decode ran
    sched.step()
    assert late.first_token_at is not None
    while sched.has_work():
        sched.step()
    assert len(pool) == 0


def test_prompts_queued_behind_running_sequences_stop_prefilling_at_the_steps_deadline(model, monkeypatch):
    """With sequences decoding, a step starts no prefill past its deadline (here: at once, so one per step) and
    the running ones decode between the newcomers' prefills; into an idle engine a burst still prefills whole
    before the first decode. Tokens stay DirectEngine's and the pool ends clean."""
    from mlxkv.engine import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PREFILL_FIRST_S", 0.0)
    pool = paged_pool(model)
    sched = Scheduler(model, None, pool)
    idle_burst = [new_job(SHARED + [400 + i, 410 + i]) for i in range(3)]
    for job in idle_burst:
        sched.add(job)
    sched.step()
    assert all(job.first_token_at is not None for job in idle_burst) and sched.totals["decode_steps"] == 1
    queued = [new_job(SHARED + [500 + i, 510 + i]) for i in range(3)]
    for job in queued:
        sched.add(job)
    for step in range(3):
        sched.step()
        assert [job.first_token_at is not None for job in queued] == [i <= step for i in range(3)]
        assert sched.totals["decode_steps"] == 2 + step  # the running sequences decoded in every step
    while sched.has_work():
        sched.step()
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    for job in idle_burst + queued:
        assert [e.token for e in job.handle if e.kind == "token"] == list(direct.generate_tokens(job.request.prompt,
                                                                                                   PARAMS))
    assert len(pool) == 0
    pool.check_invariants()


class FailsOnToken:
    """A model whose prefill forward raises when any row starts with ``token`` (alone or batched), after every
    layer has written its cache rows."""

    def __init__(self, model, token: int):
        self.model, self.token, self.layers = model, token, model.layers

    def __call__(self, inputs, cache=None):
        out = self.model(inputs, cache=cache)
        if inputs.shape[1] > 1 and (inputs[:, 0] == self.token).any().item():
            raise RuntimeError("injected fault")
        return out


def test_a_failed_batched_prefill_is_rewound_and_only_the_faulty_request_fails(model):
    """The shared forward fails after writing: every sequence is trimmed back, the chunks run one by one, and only
    the request whose own forward fails fails; the others' tokens equal DirectEngine's."""
    pool = paged_pool(model)
    sched = Scheduler(FailsOnToken(model, 999), None, pool, batched_prefill=True)
    prompts = [SHARED + SUFFIXES[0], [999, 5, 6, 7], SHARED + SUFFIXES[2]]
    results = run(sched, prompts)
    assert results[1][-1].kind == "error" and "injected fault" in results[1][-1].message
    assert sched.totals["batched_prefills"] == 0 and sched.batched_prefill  # not the batch's fault: stays on
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    for i in (0, 2):
        assert [e.token for e in results[i] if e.kind == "token"] == list(direct.generate_tokens(prompts[i], PARAMS))
    assert len(pool) == 0
    pool.check_invariants()


@pytest.mark.parametrize("wanted", [True, False])
def test_the_engine_turns_batched_prefill_on_only_when_configured_and_probed(model, wanted):
    from mlxkv.engine.batch import BatchEngine, EngineConfig

    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=4, batched_prefill=wanted),
                         pool=paged_pool(model)).start()
    try:
        stats = engine.stats()
        prompts = [SHARED + s for s in SUFFIXES]
        handles = [engine.submit(GenerationRequest(p, PARAMS)) for p in prompts]
        tokens = [[e.token for e in h if e.kind == "token"] for h in handles]
    finally:
        engine.stop()
    assert stats["batched_prefill"] is wanted
    assert stats["batched_prefill_reason"] == ("ok" if wanted else "disabled by configuration")
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert tokens == [list(direct.generate_tokens(p, PARAMS)) for p in prompts]
