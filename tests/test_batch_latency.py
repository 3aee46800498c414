"""Latency mechanisms: event-driven engine wake-up, coalesced event delivery, in-flight prefix sharing.

No timing asserts: each test checks the mechanism (counts of wake-ups, polls, cached tokens) instead.
"""

import asyncio
import queue
import sys
import time

import pytest

from mlxkv.config import KvCacheConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.output import LoopDelivery, batched_wakeups, delivery_for
from mlxkv.engine.request import Event, GenerationRequest, RequestHandle, Usage
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.scheduler import Job, Scheduler
from mlxkv.kv.paged.paged_sequence import PLACEHOLDER
from mlxkv.kv.store import CachePool
from mlxkv.server.app import _stream
from mlxkv.server.choice_output import ChoiceOutput
from mlxkv.server.responses import ResponseBuilder
from mlxkv.server.runner import set_switch_interval

PARAMS = SamplingParams(max_tokens=6)
SHARED = [(5 * i) % 900 + 10 for i in range(40)]  # 10 blocks of 4
PROMPTS = [SHARED + [100 + j, 200 + j, 300 + j] for j in range(3)]



# ---- event delivery ----------------------------------------------------------------------------------------
def test_a_burst_of_events_wakes_the_loop_once_and_arrives_in_order():
    loop = asyncio.new_event_loop()
    try:
        delivery, got = LoopDelivery(loop), []
        for i in range(5):  # the loop is not running: every put after the first rides on the pending drain
            delivery.put(got.append, lambda: None, i)
        assert delivery.wakeups == 1 and got == []
        loop.run_until_complete(asyncio.sleep(0))
        assert got == [0, 1, 2, 3, 4] and delivery.delivered == 5
        delivery.put(got.append, lambda: None, 5)  # the drain ran: the next event wakes the loop again
        loop.run_until_complete(asyncio.sleep(0))
        assert delivery.wakeups == 2 and got[-1] == 5
    finally:
        loop.close()


def test_batched_wakeups_wake_each_loop_once_at_the_end():
    loops = [asyncio.new_event_loop() for _ in range(2)]
    try:
        deliveries, got = [LoopDelivery(lp) for lp in loops], []
        with batched_wakeups():
            for i in range(6):
                deliveries[i % 2].put(got.append, lambda: None, i)
            with batched_wakeups():  # nested: the outer block wakes
                deliveries[0].put(got.append, lambda: None, 6)
            assert [d.wakeups for d in deliveries] == [0, 0]
        assert [d.wakeups for d in deliveries] == [1, 1]
        for lp in loops:
            lp.run_until_complete(asyncio.sleep(0))
        assert sorted(got) == list(range(7))
    finally:
        for lp in loops:
            lp.close()


def test_events_for_a_closed_loop_cancel_the_request():
    loop = asyncio.new_event_loop()
    handle = RequestHandle(GenerationRequest([1, 2]), loop=loop)
    loop.close()
    handle.put(Event("token", token=3))
    assert handle.cancelled


def test_stream_writes_every_event_that_has_arrived_in_one_chunk():
    async def run() -> list[str]:
        handle = RequestHandle(GenerationRequest([1, 2]), loop=asyncio.get_running_loop())
        with batched_wakeups():
            handle.put(Event("token", text="a"))
            handle.put(Event("token", text="b"))
            handle.put(Event("token", text="c", finish_reason="length"))
            handle.put(Event("done", usage=Usage(2, 3)))
        return [chunk async for chunk in _stream(handle, ResponseBuilder(chat=True, model="m"), [ChoiceOutput()], True)]

    chunks = asyncio.run(run())
    assert len(chunks) == 2  # the role chunk, then the three tokens, the finish, the usage and [DONE] together
    assert chunks[0].count("data: ") == 1 and '"role":"assistant"' in chunks[0]
    assert chunks[1].count("data: ") == 6 and chunks[1].endswith("data: [DONE]\n\n")


# ---- engine wake-up ----------------------------------------------------------------------------------------
class CountingInbox:
    """The engine's inbox, counting blocking gets and non-blocking polls."""

    def __init__(self):
        self.q, self.gets, self.polls = queue.SimpleQueue(), 0, 0

    def put(self, item):
        self.q.put(item)

    def get(self):
        self.gets += 1
        return self.q.get()

    def get_nowait(self):
        self.polls += 1
        return self.q.get_nowait()


def test_an_idle_engine_blocks_on_its_inbox_and_a_submit_wakes_it(model):
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=2), context_length=4096)
    engine._inbox = inbox = CountingInbox()
    engine.start()
    try:
        time.sleep(0.2)
        idle = (inbox.gets, inbox.polls, engine.stats()["steps_total"])
        time.sleep(0.2)
        assert (inbox.gets, inbox.polls, engine.stats()["steps_total"]) == idle  # no polling while idle
        assert inbox.gets == idle[0] >= 1  # it sits in one blocking get
        events = list(engine.submit(GenerationRequest(PROMPTS[0], PARAMS)))
        assert events[-1].kind == "done"
    finally:
        engine.stop()
    assert inbox.gets > idle[0]  # the submit ended the blocking get


def test_set_switch_interval():
    before = sys.getswitchinterval()
    try:
        set_switch_interval(0.001)
        assert sys.getswitchinterval() == pytest.approx(0.001)
        set_switch_interval(None)
        assert sys.getswitchinterval() == pytest.approx(0.001)
        with pytest.raises(ValueError, match="> 0"):
            set_switch_interval(0)
    finally:
        sys.setswitchinterval(before)


# ---- in-flight prefix sharing ------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [64, 8])
def test_requests_admitted_together_compute_their_shared_prefix_once(model, chunk):
    pool = CachePool(model, max_sequences=4, backend="paged",
                     kv_config=KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22))
    sched = Scheduler(model, None, pool, prefill_chunk_size=chunk)
    handles = []
    for prompt in PROMPTS:  # queued together: admitted in one step, none of SHARED is cached yet
        request = GenerationRequest(prompt, PARAMS)
        handles.append(RequestHandle(request))
        sched.add(Job(request=request, handle=handles[-1], max_tokens=PARAMS.max_tokens))
    while sched.has_work():
        sched.step()
    results = [list(h) for h in handles]
    assert [r[-1].usage.cached_tokens for r in results] == [0, len(SHARED), len(SHARED)]
    assert sched.totals["prefix_hits"] == 2 * len(SHARED)
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    for prompt, events in zip(PROMPTS, results):
        assert [e.token for e in events if e.kind == "token"] == list(direct.generate_tokens(prompt, PARAMS))
    pool.check_invariants()


# ---- first token from the prefill ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["paged", "dense"])
def test_the_first_token_comes_from_the_prefill_not_a_decode_step(model, backend):
    """A request's prefill covers its whole prompt and samples the first token from the last position's logits:
    a one-token request finishes in one engine step with no decode step, and longer ones match DirectEngine."""
    kv = ({"backend": "paged", "kv_config": KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22)}
          if backend == "paged" else {})
    pool = CachePool(model, max_sequences=4, **kv)
    sched = Scheduler(model, None, pool)
    request = GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=1))
    handle = RequestHandle(request)
    sched.add(Job(request=request, handle=handle, max_tokens=1))
    sched.step()
    assert not sched.has_work() and sched.totals["decode_steps"] == 0
    events = list(handle)
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    assert [e.token for e in events if e.kind == "token"] == list(direct.generate_tokens(PROMPTS[0], request.params))
    for prompt in PROMPTS[1:]:  # longer requests: the same tokens as DirectEngine
        request = GenerationRequest(prompt, PARAMS)
        handle = RequestHandle(request)
        sched.add(Job(request=request, handle=handle, max_tokens=PARAMS.max_tokens))
        while sched.has_work():
            sched.step()
        assert [e.token for e in handle if e.kind == "token"] == list(direct.generate_tokens(prompt, PARAMS))
    # Decode steps overlap reading the previous step's tokens, and none is spent past a known last token.
    assert sched.totals["decode_steps"] == 2 * (PARAMS.max_tokens - 1)
    assert sched.totals["overlapped_steps"] == 2 * (PARAMS.max_tokens - 2)
    assert len(pool) == 0
    if backend == "paged":
        pool.check_invariants()


def test_a_first_token_is_delivered_before_the_steps_decode_runs(model):
    """In the step where a request prefills, its first token wakes the client's loop right after the prefill,
    before the same step's decode runs (that decode's token is read, overlapped, in the next step)."""
    loop = asyncio.new_event_loop()
    try:
        pool = CachePool(model, max_sequences=2)
        sched = Scheduler(model, None, pool)
        request = GenerationRequest(PROMPTS[0], PARAMS)
        handle = RequestHandle(request, loop=loop)
        sched.add(Job(request=request, handle=handle, max_tokens=PARAMS.max_tokens))
        delivery = delivery_for(loop)
        before, at_decode = delivery.wakeups, []
        decode = sched._decode
        sched._decode = lambda: at_decode.append(delivery.wakeups - before) or decode()
        with batched_wakeups():
            sched.step()  # prefill (first token) + one decode step (second token)
        assert at_decode == [1] and sched.totals["decode_steps"] == 1  # the loop was woken before the decode
        loop.run_until_complete(asyncio.sleep(0))
        assert handle.get_nowait().token is not None  # the first token; the decode's token is still in flight
        assert handle.get_nowait() is None
        with batched_wakeups():
            sched.step()  # builds the next decode step, then reads and emits the previous one's token
        loop.run_until_complete(asyncio.sleep(0))
        assert handle.get_nowait().token is not None
        handle.cancel()
        sched.step()
    finally:
        loop.close()


def test_each_prefill_wakes_its_client_before_the_next_prefill_runs(model):
    """Requests admitted in the same step prefill one after the other: each one's first token wakes the client's
    loop as soon as its own prefill ends, not when the step's last prefill does."""
    loop = asyncio.new_event_loop()
    try:
        pool = CachePool(model, max_sequences=3)
        sched = Scheduler(model, None, pool)
        handles = []
        for prompt in PROMPTS[:3]:
            request = GenerationRequest(prompt, PARAMS)
            handles.append(RequestHandle(request, loop=loop))
            sched.add(Job(request=request, handle=handles[-1], max_tokens=PARAMS.max_tokens))
        delivery = delivery_for(loop)
        before, at_open = delivery.wakeups, []
        open_ = sched._open
        sched._open = lambda task: at_open.append(delivery.wakeups - before) or open_(task)
        with batched_wakeups():
            sched.step()  # three prefills, then one decode step
        assert at_open == [0, 1, 1]  # woken after the first prefill; the second's token joins the pending drain
        loop.run_until_complete(asyncio.sleep(0))
        assert all(h.get_nowait().token is not None for h in handles)  # every first token arrived
        for h in handles:
            h.cancel()
        sched.step()
        assert len(pool) == 0
    finally:
        loop.close()


def test_a_stop_met_in_flight_spends_one_dropped_step_and_leaves_the_pool_clean(model):
    """Overlapped decode: the step after a token that stops the request (a stop string here) is already built
    when the token is read; its token is dropped, the sequence released, and the manager's placeholder id never
    reaches a cached block."""
    pool = CachePool(model, max_sequences=2, backend="paged",
                     kv_config=KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22))
    sched = Scheduler(model, None, pool)
    direct = DirectEngine(model, None, pool=CachePool(model, max_sequences=1))
    free = list(direct.generate_tokens(PROMPTS[1], SamplingParams(max_tokens=8)))
    stop_at = free[4]  # stop on the 5th greedy token (as a token id: the model has no tokenizer here)
    params = SamplingParams(max_tokens=8)
    request = GenerationRequest(PROMPTS[1], params)
    handle = RequestHandle(request)
    job = Job(request=request, handle=handle, max_tokens=8)
    sched.add(job)
    sched.step()  # prefill + the first decode
    choice = sched.running[0]
    real_emit = sched._emit

    def emit(c, token, now):  # finish the choice at stop_at, as a stop string would
        real_emit(c, token, now)
        if token == stop_at and not c.done:
            sched._close_choice(c, "stop")

    sched._emit = emit
    while sched.has_work():
        sched.step()
    tokens = [e.token for e in handle if e.kind == "token"]
    assert tokens == free[: free.index(stop_at) + 1] and choice.done
    assert sched.totals["decode_steps"] == len(tokens)  # one step more than the tokens it emitted after the first
    assert len(pool) == 0
    pool.check_invariants()
    for block in pool.paged.manager.pool.blocks:
        assert PLACEHOLDER not in block.token_ids
