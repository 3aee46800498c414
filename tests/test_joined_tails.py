"""A request whose prompt is cached but for a short end joins the running decode batch: that end is fed in the
batch's decode forward (a row of several positions), its first token sampled with the others' tokens — one forward
for the step the running sequences wait for, instead of its own prefill forwards and then theirs."""

import pytest
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.request import GenerationRequest, RequestHandle
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.scheduler import MAX_JOINED_TAIL, Job, Scheduler
from mlxkv.kv.layouts.attention_hook import install_attention_hook
from mlxkv.kv.store import CachePool

pytestmark = pytest.mark.float_order

SHARED = [(7 * i) % 800 + 20 for i in range(24)]  # 6 whole blocks of 4
GREEDY = SamplingParams(max_tokens=6)
SEEDED = SamplingParams(max_tokens=6, temp=0.8, seed=7)


def paged_pool(model, **kw):
    return CachePool(model, max_sequences=8, backend="paged",
                     kv_config=KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22), **kw)


def new_job(prompt: list[int], params: SamplingParams) -> Job:
    request = GenerationRequest(prompt, params)
    return Job(request=request, handle=RequestHandle(request), max_tokens=params.max_tokens)


def tokens(job: Job) -> list[int]:
    return [e.token for e in job.handle if e.kind == "token"]


def joined_beside_a_running_request(model, monkeypatch, tail: list[int], params: SamplingParams, rows: int = 1,
                                    **sched_kw):
    """``SHARED`` cached; ``rows`` requests decoding; then ``SHARED + tail`` arrives. Returns (scheduler, the first
    running job, the new job, prefill chunk lengths run after the arrival, whether the new job had its first token
    after one step, whether it joined the decode batch)."""
    pool = paged_pool(model)
    sched = Scheduler(model, None, pool, **sched_kw)
    warm = new_job(SHARED + [5], SamplingParams(max_tokens=1))
    sched.add(warm)
    while sched.has_work():
        sched.step()
    running = [new_job(SHARED[:8] + [900 + r, 901, 902], params) for r in range(rows)]
    for job in running:
        sched.add(job)
    sched.step()
    sched.step()  # they decode, a token in flight
    assert len(sched.running) == rows
    chunks: list[int] = []
    real = sched._forward_chunk
    monkeypatch.setattr(sched, "_forward_chunk", lambda task, n: chunks.append(n) or real(task, n))
    joined_before = sched.totals["prefills_joined_decode"]
    arriving = new_job(SHARED + tail, params)
    sched.add(arriving)
    sched.step()
    first_at_once = arriving.first_token_at is not None
    while sched.has_work():
        sched.step()
    assert len(pool) == 0
    pool.check_invariants()
    return sched, running[0], arriving, chunks, first_at_once, sched.totals["prefills_joined_decode"] - joined_before


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_short_uncached_prompt_end_joins_the_running_batch(model, monkeypatch, params):
    """Six uncached tokens: no prefill forward of its own; the step's decode forward writes them and samples the
    request's first token, which is out after that one step. Both requests' tokens equal DirectEngine's, each
    alone on a dense cache."""
    tail = [401, 402, 403, 404, 405, 406]
    sched, running, arriving, chunks, first_at_once, joined = joined_beside_a_running_request(model, monkeypatch, tail,
                                                                                               params)
    assert chunks == [] and first_at_once and joined == 1
    assert sched.totals["prompt_tokens_joined_decode"] == len(tail)
    assert arriving.cached_tokens == len(SHARED)
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert tokens(arriving) == list(direct.generate_tokens(SHARED + tail, params))
    assert tokens(running) == list(direct.generate_tokens(running.request.prompt, params))


def test_a_longer_end_prefills_as_before(model, monkeypatch):
    """Past ``MAX_JOINED_TAIL`` uncached tokens the request prefills them first, and its tokens are the same."""
    tail = [(3 * i) % 500 + 40 for i in range(MAX_JOINED_TAIL + 1)]
    _, _, arriving, chunks, _, joined = joined_beside_a_running_request(model, monkeypatch, tail, GREEDY)
    assert chunks == [len(tail)] and joined == 0
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert tokens(arriving) == list(direct.generate_tokens(SHARED + tail, GREEDY))


@pytest.mark.parametrize("tail_length, joins", [(3, True), (6, False)])
def test_an_end_joins_only_while_the_padding_it_adds_stays_small(model, monkeypatch, tail_length, joins):
    """Beside four decoding rows, a joined 3-token end makes a forward of 15 positions, 12 more than its own prefill
    (joins); a 6-token one 24 more, past ``MAX_JOINED_EXTRA`` (prefills first). The tokens are the same either way."""
    tail = [401 + i for i in range(tail_length)]
    _, _, arriving, chunks, _, joined = joined_beside_a_running_request(model, monkeypatch, tail, GREEDY, rows=4)
    assert (chunks == []) is joins and joined == int(joins)
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert tokens(arriving) == list(direct.generate_tokens(SHARED + tail, GREEDY))


def test_unbatched_decode_prefills_the_end(model, monkeypatch):
    """Decoding one sequence at a time there is no batch to join."""
    tail = [401, 402, 403]
    _, _, arriving, chunks, _, joined = joined_beside_a_running_request(model, monkeypatch, tail, GREEDY,
                                                                        batched=False)
    assert chunks == [3] and joined == 0
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert tokens(arriving) == list(direct.generate_tokens(SHARED + tail, GREEDY))


def test_layers_that_cannot_batch_a_joined_row_run_it_alone():
    """Sliding-window layers refuse the batched prefill views before any write: the joined step runs row by row,
    with the same tokens."""
    gemma = build_model("gemma3_text")[0]
    install_attention_hook(gemma)
    pool = paged_pool(gemma)
    sched = Scheduler(gemma, None, pool)
    warm = new_job(SHARED + [5], SamplingParams(max_tokens=1))
    sched.add(warm)
    while sched.has_work():
        sched.step()
    running = new_job(SHARED[:8] + [900, 901], GREEDY)
    sched.add(running)
    sched.step()
    sched.step()
    unbatched = sched.totals["unbatched_steps"]
    arriving = new_job(SHARED + [401, 402, 403], GREEDY)
    sched.add(arriving)
    sched.step()
    while sched.has_work():
        sched.step()
    assert sched.totals["prefills_joined_decode"] == 1 and sched.totals["unbatched_steps"] > unbatched
    direct = DirectEngine(gemma, None, pool=CachePool(gemma, max_sequences=1))
    assert tokens(arriving) == list(direct.generate_tokens(SHARED + [401, 402, 403], GREEDY))
    assert tokens(running) == list(direct.generate_tokens(running.request.prompt, GREEDY))
    assert len(pool) == 0
