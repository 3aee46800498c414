"""The scheduler's plans with a fake runner and a fake pool: no model runs.

Each test drives ``begin_step`` / ``schedule`` / ``schedule_decode`` / ``update`` (or ``step``) and checks what
the plans name: admission order by priority, chunked prefill ranges, preemption when blocks run out, release at
EOS and at ``max_tokens``.
"""

import itertools

import mlx.core as mx
import pytest

from mlxkv.engine.plan import StepOutput, StepPlan
from mlxkv.engine.runner import ModelRunner
from mlxkv.engine.request import GenerationRequest, RequestHandle
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.scheduler import Job, Scheduler

EOS = 2
BLOCK = 4


class FakeSeq:
    def __init__(self, pool, sid, rank, prompt):
        self.pool, self.id, self.rank, self.length = pool, sid, rank, 0
        self.num_cached, self.preempted, self.overflow = 0, False, None

    def prefill_chunk(self, start, n):
        return n

    def reserve(self, start, end):
        self.length = max(self.length, end)

    def reserve_last(self):
        self.length += 1

    def feed(self, tokens):
        self.length += len(tokens)

    def feed_placeholder(self):
        self.length += 1
        return self.length - 1

    def name_token(self, position, token):
        pass

    def commit(self):
        pass

    def rewind_to(self, n):
        self.length = n
        return True


class FakePool:
    """Blocks of ``BLOCK`` tokens; no prefix cache; preemption victim: lowest rank, then newest."""

    is_paged = True

    def __init__(self, num_blocks, max_sequences=8):
        self.num_blocks, self.max_sequences = num_blocks, max_sequences
        self.seqs, self._ids = {}, itertools.count()
        self.preemptions = []

    def _blocks(self, n):
        return -(-n // BLOCK)

    def used(self):
        return sum(self._blocks(s.length) for s in self.seqs.values())

    def free_capacity(self):
        return self.num_blocks - self.used()

    def admission_cost(self, n):
        return self._blocks(n)

    def open(self, prompt_length=0, *, prompt=None, cache_request=None):
        seq = FakeSeq(self, next(self._ids), cache_request.preemption_rank, prompt)
        self.seqs[seq.id] = seq
        return seq

    def resume(self, sid, tokens):
        seq = self.seqs[sid] = self.seqs.get(sid) or self._preempted.pop(sid)
        seq.preempted, seq.length = False, 0
        return seq

    def can_extend(self, seq, n):
        return self._blocks(seq.length + n) - self._blocks(seq.length) <= self.free_capacity()

    def victim_for(self, seq):
        below = [s for s in self.seqs.values() if s is not seq and (s.rank, -s.id) < (seq.rank, -seq.id)]
        return min(below, key=lambda s: (s.rank, -s.id)) if below else None

    def preempt(self, sid):
        seq = self.seqs.pop(sid)
        seq.preempted, seq.length = True, 0
        self.preemptions.append(sid)
        self._preempted = {**getattr(self, "_preempted", {}), sid: seq}

    def release(self, sid):
        self.seqs.pop(sid)

    def fork(self, sid, n):
        parent = self.seqs[sid]
        kids = []
        for _ in range(n):
            kid = FakeSeq(self, next(self._ids), parent.rank, None)
            kid.length = parent.length
            self.seqs[kid.id] = kid
            kids.append(kid)
        return kids

    def has_decode_headroom(self, n):
        return self.free_capacity() >= n

    def __len__(self):
        return len(self.seqs)

    def __contains__(self, sid):
        return sid in self.seqs


class FakeRunner:
    """Records each plan; writes chunk lengths into the fake sequences; decodes ``script(choice)`` per row."""

    batched, batched_prefill, mrope = True, False, False
    sample_first = staticmethod(ModelRunner.sample_first)  # the first token, from all-zero logits: 0

    def __init__(self, script=lambda choice: 7):
        self.plans, self.script = [], script

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        out = StepOutput()
        for chunk in plan.prefills:
            chunk.task.seq.length = max(chunk.task.seq.length, chunk.end)
            out.prefill_logits.append(mx.zeros((1, 8)) if chunk.want_logits else None)
        if plan.decode:
            out.tokens = mx.array([self.script(c) for c in plan.decode], dtype=mx.uint32)
        return out


class FakeDetokenizer:
    last_segment = ""

    def add_token(self, token):
        self.last_segment = "x"

    def finalize(self):
        self.last_segment = ""


class FakeTokenizer:
    eos_token_ids = {EOS}

    @property
    def detokenizer(self):
        return FakeDetokenizer()


def job(prompt, max_tokens=4, priority=0):
    request = GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens), priority=priority)
    return Job(request=request, handle=RequestHandle(request), max_tokens=max_tokens)


def scheduler(pool, runner=None, **kwargs):
    return Scheduler(None, FakeTokenizer(), pool, runner=runner or FakeRunner(), **kwargs)


def tokens(j):
    return [e.token for e in j.handle if e.kind == "token"]


def test_admission_follows_priority_then_arrival():
    sched = scheduler(FakePool(64), max_sequences=2)
    low, high, mid = job([1] * 5, priority=5), job([1] * 5, priority=-1), job([1] * 5, priority=0)
    for j in (low, high, mid):
        sched.add(j)
    head = sched.begin_step()
    assert [t.job for t in head.admitted] == [high, mid]  # two fit max_sequences; the lowest priority waits
    assert [entry[2] for entry in sched.waiting] == [low]


@pytest.mark.parametrize("last_token_alone", [False, True])
def test_chunked_prefill_ranges_then_the_first_token_from_the_last_chunk(last_token_alone):
    """10 tokens in chunks of 4: [0, 4), [4, 8), then [8, 10) with its last position's logits — or, in mlx-lm's
    order (generate and chat), [8, 9) and the last token alone."""
    runner = FakeRunner()
    sched = scheduler(FakePool(64), runner, prefill_chunk_size=4, last_token_alone=last_token_alone)
    a = job(range(10, 20))
    sched.add(a)
    ranges = []
    for _ in range(3):
        sched.begin_step()
        while (plan := sched.schedule()) is not None:
            ranges += [(c.start, c.end, c.want_logits) for c in plan.prefills]
            sched.update(plan, runner.execute(plan))
    ending = [(8, 9, False), (9, 10, True)] if last_token_alone else [(8, 10, True)]
    assert ranges == [(0, 4, False), (4, 8, False)] + ending
    assert len(sched.running) == 1 and a.first_token_at is not None  # sampled from the last chunk's logits


def test_decode_plans_name_every_running_row_and_release_at_max_tokens():
    pool = FakePool(64)
    runner = FakeRunner()
    sched = scheduler(pool, runner)
    a, b = job([5] * 3, max_tokens=3), job([6] * 6, max_tokens=5)
    sched.add(a)
    sched.add(b)
    while sched.has_work():
        sched.step()
    decode_plans = [p for p in runner.plans if p.decode]
    assert [c.job for c in decode_plans[0].decode] == [a, b]  # both decode in one plan
    # b, short and planned once a decodes, runs no prefill: its prompt is fed in that plan (all but its last token,
    # the row's input), which samples its first token
    assert decode_plans[0].prompt_tails == [[], [6] * 5] and not any(p.prompt_tails for p in decode_plans[1:])
    assert not any(c.task.job is b for p in runner.plans for c in p.prefills)
    assert tokens(a) == [0, 7, 7] and tokens(b) == [7] * 5  # a's first token sampled from its prefill's zeros: 0
    assert a.finished and b.finished and len(pool) == 0  # released at max_tokens


def test_release_at_eos():
    pool = FakePool(64)
    decoded = iter([9, EOS, 9, 9])  # the step after EOS is built before EOS is read: its token is dropped
    runner = FakeRunner(script=lambda c: next(decoded))
    sched = scheduler(pool, runner)
    a = job([5] * 3, max_tokens=10)
    sched.add(a)
    while sched.has_work():
        sched.step()
    assert tokens(a) == [0, 9, EOS] and a.finished and len(pool) == 0
    assert sched.totals["finished"] == 1


def test_the_lowest_ranked_sequence_is_preempted_when_blocks_run_out_and_resumes():
    pool = FakePool(num_blocks=4)  # 16 tokens in all
    runner = FakeRunner()
    sched = scheduler(pool, runner)
    important, casual = job([1] * 7, max_tokens=6, priority=-1), job([2] * 7, max_tokens=6, priority=3)
    sched.add(important)
    sched.add(casual)
    while sched.has_work() and not pool.preemptions:
        sched.step()
    assert pool.preemptions and sched.totals["preemptions"] >= 1
    assert all(t.job is casual for t in sched.preempted)  # the lower priority waits, the other keeps decoding
    assert any(c.job is important for c in sched.running)
    while sched.has_work():
        sched.step()
    assert len(tokens(important)) == 6 and len(tokens(casual)) == 6  # the preempted one resumed and finished
    assert len(pool) == 0


def test_a_cancelled_request_is_named_by_the_next_step_and_released():
    pool = FakePool(64)
    sched = scheduler(pool)
    a = job([1] * 5, max_tokens=8)
    sched.add(a)
    sched.step()
    a.handle.cancel()
    head = sched.begin_step()
    assert head.cancelled == [a] and a.finished and len(pool) == 0


class ReadingPool(FakePool):
    """A pool whose disk tier is still reading ``slow_prompt``'s blocks until ``reads_done`` is set."""

    def __init__(self, num_blocks, slow_prompt):
        super().__init__(num_blocks)
        self.slow_prompt, self.reads_done, self.waits = list(slow_prompt), False, 0

    def tier_ready(self, prompt, cache_request=None):
        return self.reads_done or list(prompt) != self.slow_prompt

    def wait_tier_reads(self, timeout):
        self.waits += 1


def test_a_request_waiting_for_disk_reads_stays_unopened_while_the_others_decode():
    slow = list(range(30, 40))
    pool = ReadingPool(64, slow)
    sched = scheduler(pool, max_sequences=4)
    running, waiting = job(range(10, 15), max_tokens=6), job(slow, max_tokens=2)
    sched.add(running)
    sched.step()  # `running` prefills and decodes
    sched.add(waiting)
    for _ in range(3):
        sched.step()
    assert len(sched.running) == 1 and len(sched.running[0].generated) >= 3  # decoding went on
    assert sched.running[0].job is running and waiting.first_token_at is None  # the reader is unopened
    assert all(t.seq is None for t in sched.prefilling) and len(pool.seqs) == 1 and pool.waits == 0
    for _ in range(6):
        if not running.finished:
            sched.step()
    assert running.finished and waiting.first_token_at is None
    before = pool.waits
    sched.step()
    sched.step()
    assert pool.waits == before + 2  # nothing but the reads left: each step waits on them (no busy loop)
    pool.reads_done = True
    for _ in range(3):
        sched.step()
    assert waiting.finished and len(tokens(waiting)) == 2
