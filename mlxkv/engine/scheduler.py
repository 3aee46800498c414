"""The continuous-batching scheduler: who is admitted, who is preempted, which prompt chunks prefill, who decodes.

Runs on the engine thread only. It decides each forward as a :class:`~mlxkv.engine.plan.StepPlan` (:meth:`Scheduler.
schedule`, :meth:`Scheduler.schedule_decode`), :meth:`~mlxkv.engine.runner.ModelRunner.execute` runs its forwards
and sampling, and :meth:`Scheduler.update` applies the output; :mod:`mlxkv.engine.decode_loop` holds the tokens in
flight between decode steps, :mod:`mlxkv.engine.output` turns
tokens into text and events, and the KV cache is reached only through its facade (:mod:`mlxkv.kv`). A step drops
cancelled requests; admits preempted sequences, then waiting requests by priority, while their sequences fit
``max_sequences`` and their blocks the pool; prefills up to ``prefill_chunk_size`` prompt tokens in admission order
(a sequence opens, taking its prefix hit, only when its turn comes, so requests admitted together share what the
first computes; short chunks may share one forward); and decodes every running sequence once. A request's own
prompt is prefilled whole and its first token sampled from the last logits (one cached but for its last token,
or while sequences decode for a short end, joins the decode batch instead); ``n > 1`` forks the prefilled
sequence. When a sequence needs room, the lowest-ranked one (lowest priority, then newest) is preempted and
resumes, under the same id, with its prompt and generated tokens as a prefix hit. Failures are contained to the
requests they touch; every sequence a request opened is released when it ends, however it ends
(docs/architecture.md has the whole picture).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from typing import Any, Callable, Iterator

import mlx.core as mx

from mlxkv.engine.constraints import consume, constraints_for, step_masks, verify_masks
from mlxkv.engine.decode_loop import DecodeLoop, decode_inputs, ends_in_flight
from mlxkv.engine.jobs import Choice, EngineObserver, Job, Prefill, cache_request
from mlxkv.engine.output import TextStream, emit_token, end_event, flush_wakeups
from mlxkv.engine.plan import PrefillChunk, StepOutput, StepPlan
from mlxkv.engine.request import Event
from mlxkv.engine.row_sampler import RowSampler
from mlxkv.engine.rewind import CacheRewinder
from mlxkv.engine.runner import ModelRunner
from mlxkv.engine.speculation import Speculation, may_speculate, propose_rows
from mlxkv.kv import CachePool, Sequence
from mlxkv.vision.spans import image_tokens_before

__all__ = ["MAX_BATCHED_CHUNK", "Choice", "EngineObserver", "Job", "Prefill", "PrefillChunk", "Scheduler", "StepOutput",
           "StepPlan"]

#: How long past a step's start prefills may still start before that step's decode (seconds): new arrivals when the
#: engine was idle, any prompt when sequences are decoding (they wait at most this long plus one prefill).
PREFILL_FIRST_S = 0.1
#: An engine whose only work is a request waiting for disk-tier reads sleeps at most this long per step.
TIER_READ_WAIT_S = 0.05
#: Prefill chunks of at most this many tokens may share one batched forward (a longer one would pad every row of
#: the batch to its length); see :mod:`mlxkv.engine.prefill_batch`.
MAX_BATCHED_CHUNK = 128
#: A request whose uncached prompt end is this short may join a running decode batch: that end is fed in the batch's
#: forward, its first token sampled with theirs (one forward for the step instead of its prefill's and theirs).
MAX_JOINED_TAIL = 32
#: ... when the joined forward (every row padded to the longest) computes at most this many positions more than the
#: request's own prefill would: joining saves every running row a forward's fixed cost (reading every weight: ~65 ms
#: for SmolLM2-135M in float32 on this CPU) and makes the request's first token wait for those positions (~3 ms each
#: there). One running row takes an end of up to 20 tokens, three of up to 6, seven of up to 2.
MAX_JOINED_EXTRA = 20


class Scheduler:
    """Continuous batching over one model and its CachePool (engine thread only).

    Args:
        model: the mlx-lm model (attention hook installed for batched decode).
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``None``: tokens only).
        pool: the KV store of every sequence (dense or paged).
        max_sequences: most sequences prefilling or decoding at once (default: the pool's ``max_sequences``).
        prefill_chunk_size: most prompt tokens prefilled per step (over all admitted requests).
        observer: receives timings.
        on_dequeue: called once per request leaving the waiting queue (admitted or dropped).
        batched: ``False`` decodes sequences one by one; ``True`` uses batch views.
        batched_prefill: prefill chunks of up to ``MAX_BATCHED_CHUNK`` tokens of different sequences in one
            forward; switched off by the first step that cannot.
        runner: executes the plans (default: a :class:`~mlxkv.engine.runner.ModelRunner` over ``model``).
        intake: called by :meth:`schedule` once the step's prefills are planned, to :meth:`add` requests that
            arrived meanwhile, True if it added any: those are admitted and their short prompts prefilled before the
            step's decode, up to ``PREFILL_FIRST_S`` after the step began.
        speculation: speculative decoding by prompt lookup or a draft model (:mod:`mlxkv.engine.speculation`; None:
            off): rows that propose tokens make the decode step a verification step.
        last_token_alone: a request's prompt ends as mlx-lm runs it: its last token in a forward of its own, after
            the rest filled the caches without logits, so the first token and the caches are ``mlx_lm.generate``'s
            bit for bit (``generate`` and ``chat``). Off (``serve``): the last chunk computes its last position's
            logits in the same forward, one forward less before the first token (the same tokens; logits equal but
            for float summation order).
    """

    def __init__(self, model: Any, tokenizer: Any, pool: CachePool, *, max_sequences: int | None = None,
                 prefill_chunk_size: int = 512,
                 observer: EngineObserver | None = None, on_dequeue: Callable[[], None] = lambda: None,
                 batched: bool = True, batched_prefill: bool = False, runner: Any = None,
                 intake: Callable[[], bool] | None = None, speculation: Speculation | None = None,
                 last_token_alone: bool = False):
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        self.tokenizer = tokenizer
        self.pool = pool
        self.last_token_alone = last_token_alone
        self.max_sequences = pool.max_sequences if max_sequences is None else min(max_sequences, pool.max_sequences)
        self.prefill_chunk_size = prefill_chunk_size
        self.observer = observer or EngineObserver()
        self._on_dequeue = on_dequeue
        self._order = itertools.count()
        self.waiting: list[tuple[int, int, Job]] = []  # heap of (priority, arrival, job)
        self.preempted: collections.deque[Prefill] = collections.deque()  # resumed before any new admission
        self.prefilling: list[Prefill] = []
        self.running: list[Choice] = []
        self._owners: dict[Any, Prefill | Choice] = {}  # sequence id -> the task prefilling it or the choice
        self.totals = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0, generation_tokens=0,
                           steps=0, decode_steps=0, batched_steps=0, unbatched_steps=0, max_batch=0,
                           preemptions=0, prefix_queries=0, prefix_hits=0, overlapped_steps=0,
                           batched_prefills=0, prefills_joined_decode=0, prompt_tokens_joined_decode=0,
                           image_tokens=0, image_tokens_cached=0, decode_rows=0, decode_tokens=0, verify_steps=0,
                           batched_verify_steps=0, unbatched_verify_steps=0, draft_tokens=0, accepted_draft_tokens=0)
        self.speculation = speculation
        self.runner = runner if runner is not None else ModelRunner(model, batched=batched,
                                                                    batched_prefill=batched_prefill, totals=self.totals)
        self.decode_loop = DecodeLoop()
        self.intake = intake
        self._plans: Iterator[StepPlan] = iter(())
        self._reading: set[int] = set()  # this step's tasks (by id) waiting for disk-tier reads ahead of their open

    @property
    def batched(self) -> bool:
        """Whether decode steps run batched (batch views); the runner's switch."""
        return self.runner.batched

    @property
    def batched_prefill(self) -> bool:
        """Whether short prefill chunks of several sequences share one forward; the runner's switch."""
        return self.runner.batched_prefill

    def set_batching(self, decode: bool, prefill: bool) -> None:
        """Switch batched decode and batched prefill (the engine's start-up probes decide them)."""
        self.runner.batched, self.runner.batched_prefill = decode, prefill

    # ---- queue ---------------------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        """Queue a job for admission."""
        self.totals["requests"] += 1
        heapq.heappush(self.waiting, (job.request.priority, next(self._order), job))

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.prefilling or self.running or self.decode_loop.in_flight)

    def jobs(self) -> list[Job]:
        """Every job not finished yet (waiting, preempted, prefilling or running)."""
        seen = {id(j): j for _, _, j in self.waiting}
        seen.update({id(t.job): t.job for t in (*self.preempted, *self.prefilling)})
        seen.update({id(c.job): c.job for c in self.running})
        return list(seen.values())

    def fail(self, job: Job, exc: BaseException) -> None:
        """End ``job`` with an error event naming ``exc``; its sequences are released."""
        self._fail(job, exc)

    def end_all(self, event: Event, outcome: str = "failed") -> int:
        """End every unfinished job with ``event`` (counted as ``outcome``); returns how many."""
        jobs = self.jobs()
        for job in jobs:
            self._end(job, event, outcome)
        return len(jobs)

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Cancel, admit, prefill a chunk, decode one token for every running sequence: each forward planned
        (:meth:`schedule`, :meth:`schedule_decode`), executed by the runner, and applied (:meth:`update`)."""
        self.begin_step()
        forwards = 0
        while (plan := self.schedule()) is not None:
            self.update(plan, self._execute(plan))
            forwards += 1
        flush_wakeups()  # anything this step's prefills emitted goes out before its decode runs
        self._decode()
        if not forwards and not self.running and self._reading:
            self.pool.wait_tier_reads(TIER_READ_WAIT_S)  # only disk reads are left to wait for: no busy loop

    def begin_step(self) -> StepPlan:
        """Start a step: drop cancelled requests and admit what fits (requests added since the last step join
        here); returns those decisions. :meth:`schedule` then gives the step's prefill forwards."""
        self.totals["steps"] += 1
        self._reading.clear()
        head = StepPlan()
        for job in self.jobs():
            if job.handle.cancelled:
                head.cancelled.append(job)
                self._end(job, Event("error", finish_reason="cancelled", message="the request was cancelled"),
                          "cancelled")
        # Sequences already decoding wait for this step's prefills: none starts past the limit (a burst of
        # prompts into a busy engine spreads over steps instead of stalling every running stream for all of them).
        limit = time.perf_counter() + PREFILL_FIRST_S
        head.admitted = self._admit()
        self._plans = self._step_plans(limit, deadline=limit if self.running else None)
        return head

    def _step_plans(self, limit: float, deadline: float | None) -> Iterator[StepPlan]:
        """The step's prefill plans; then, while the running sequences' token has waited < ``PREFILL_FIRST_S``,
        those of requests the intake brought meanwhile (new short prompts only: a long uncached prompt waits for
        the next step)."""
        yield from self._prefill_plans(deadline)
        flush_wakeups()  # anything the prefills emitted goes out before the intake's prefills
        while self.intake is not None and time.perf_counter() < limit and self.intake():
            self._admit()
            new = [t for t in self.prefilling if t.seq is None]
            if not new:
                break
            yield from self._prefill_plans(deadline, new, short_only=True)
            flush_wakeups()

    def _execute(self, plan: StepPlan) -> StepOutput:
        """``plan`` through the runner (a single chunk as :meth:`_forward_chunk`)."""
        if len(plan.prefills) == 1 and not plan.together:
            return self._forward_chunk(plan.prefills[0].task, len(plan.prefills[0]))
        return self.runner.execute(plan)

    def _forward_chunk(self, task: Prefill, n: int) -> StepOutput:
        """``task``'s next ``n`` prompt tokens through the runner; the chunk's logits kept when it ends a request's
        own prompt (its first token is sampled from them)."""
        ends = task.first_from_prefill and task.done + n == task.target
        return self.runner.execute(StepPlan(prefills=[PrefillChunk(task, task.done, task.done + n, ends)]))

    def schedule(self) -> StepPlan | None:
        """This step's next prefill forward (None: its prefills are done). Each is decided after the one before
        it was applied: a sequence opens, taking its prefix hit, when its turn comes, so requests admitted
        together share what the first computes."""
        return next(self._plans, None)

    def update(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply ``out``, what the runner produced for ``plan``: prefilled positions committed and prompts that
        are complete start decoding (a request's own sampling its first token); decode tokens held in flight,
        the previous step's read and emitted; a verification step's accepted tokens emitted; a failed forward fails
        the requests it touched."""
        if plan.drafts:
            self._verified(plan, out)
            return
        if plan.decode:
            self._decoded(plan, out)
            return
        for task in plan.started:
            self._start(task)
        if not plan.prefills:
            return
        if out.error is None:
            self._prefilled(plan.prefills, out.prefill_logits)
        elif not plan.together:
            self._fail(plan.prefills[0].task.job, out.error)
        else:  # rewind, then one by one: only a request that fails alone fails
            tasks = [c.task for c in plan.prefills]
            if not all(t.seq.rewind_to(t.done) for t in tasks):
                for job in {id(t.job): t.job for t in tasks}.values():
                    self._fail(job, out.error)
                return
            for chunk in plan.prefills:
                single = StepPlan(prefills=[chunk])
                self.update(single, self._execute(single))

    def _sequences_held(self) -> int:
        """Sequences counted against ``max_sequences``: running, and those prefilling (``n`` for a request)."""
        return len(self.running) + sum(t.sequences for t in self.prefilling)

    def _admit(self) -> list[Prefill]:
        """Preempted sequences first (in preemption order), then waiting jobs by priority; each while its
        sequences fit in ``max_sequences`` and its blocks in the pool's free capacity. Returns the admitted."""
        admitted: list[Prefill] = []
        free = self.pool.free_capacity()
        while self.preempted:
            task = self.preempted[0]
            need = self.pool.admission_cost(len(task.tokens) + 1)
            if self._sequences_held() + task.sequences > self.max_sequences or need > free:
                return admitted  # nothing new is admitted before the preempted sequences are back
            self.preempted.popleft()
            free -= need
            self.prefilling.append(task)  # opened when its turn to prefill comes (see _prefill_plans)
            admitted.append(task)
        while self.waiting:
            job = self.waiting[0][2]
            if job.request.n > self.max_sequences:
                self._fail(job, ValueError(f"n={job.request.n} exceeds max_sequences={self.max_sequences}"))
                continue
            need = self.pool.admission_cost(len(job.request.prompt) + 1)
            if self._sequences_held() + job.request.n > self.max_sequences or (need > free and self._sequences_held()):
                return admitted
            heapq.heappop(self.waiting)
            self._on_dequeue()
            free -= need
            self.totals["prompt_tokens"] += len(job.request.prompt)
            self.prefilling.append(Prefill(job, list(job.request.prompt), sequences=job.request.n))
            admitted.append(self.prefilling[-1])
        return admitted

    def _tier_ready(self, task: Prefill) -> bool:
        """Whether ``task`` can open now without reading disk-tier files on this thread (else they are being read
        ahead and it waits in ``prefilling``, unopened, while the running sequences keep decoding)."""
        try:
            ready = self.pool.tier_ready(task.tokens, cache_request(task.job.request))
        except Exception:  # noqa: BLE001 - the read-ahead is an optimisation: open as without it
            ready = True
        if not ready:
            self._reading.add(id(task))
        return ready

    def _open(self, task: Prefill) -> bool:
        """Open ``task``'s sequence, or resume it after a preemption (prefix hit taken). False if that failed
        (the request has failed)."""
        job, request = task.job, task.job.request
        try:
            if task.seq is not None:  # preempted: the same sequence again
                self.pool.resume(task.seq.id, task.tokens)
            elif job.sequence is not None:  # continued: what it caches is the prompt's prefix; it stays open
                task.seq = job.sequence
            else:
                task.seq = self.pool.open(prompt_length=len(request.prompt), prompt=task.tokens,
                                          cache_request=cache_request(request))
                job.opened.append(task.seq)
            self._owners[task.seq.id] = task
            task.done = task.seq.offset if task.seq is job.sequence else task.seq.num_cached
            if not job.queried:  # the request's own prefix lookup (not a sample's or a resume's)
                job.queried, job.cached_tokens = True, task.done
                self.totals["prefix_queries"] += len(request.prompt)
                self.totals["prefix_hits"] += task.done
                self.totals["image_tokens"] += image_tokens_before(request.media, len(request.prompt))
                self.totals["image_tokens_cached"] += image_tokens_before(request.media, task.done)
        except Exception as exc:  # noqa: BLE001 - fail this request, not the engine
            self._fail(job, exc)
            return False
        return True

    # ---- room and preemption -------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Whether ``n`` more tokens of ``seq`` fit, preempting lower-ranked sequences (lower priority, then
        newer) if needed; False when they do not fit and no sequence ranks below ``seq``."""
        while not self.pool.can_extend(seq, n):
            victim = self.pool.victim_for(seq)
            if victim is None:
                return False
            owner = self._owners[victim.id]
            self._preempt_prefill(owner) if isinstance(owner, Prefill) else self._preempt_choice(owner)
        return True

    def _release(self, seq: Sequence) -> None:
        self._owners.pop(seq.id, None)
        if seq.id in self.pool:
            self.pool.release(seq.id)  # verified blocks stay cached

    def _preempt(self, seq: Sequence) -> None:
        self._owners.pop(seq.id, None)
        self.pool.preempt(seq.id)  # verified blocks stay cached: the resume takes them as a prefix hit
        self.totals["preemptions"] += 1

    def _preempt_prefill(self, task: Prefill) -> None:
        self.prefilling.remove(task)
        self._preempt(task.seq)
        task.done = 0
        self.preempted.append(task)

    def _preempt_choice(self, choice: Choice) -> None:
        """Preempt a decoding choice's sequence; it resumes with its prompt + generated tokens as the prompt."""
        if choice.in_flight is not None:
            self._read_in_flight()  # its last sampled token belongs to what it resumes with
            if choice.done or choice.job.finished:
                return
        self.running.remove(choice)
        choice.prompt_tail = []  # never written: the resume prefills it with the rest
        self._preempt(choice.seq)
        if choice.drafter is not None:
            choice.drafter.suspend()  # a draft model's sequence goes too; it reopens as a prefix hit on resume
        tokens = list(choice.job.request.prompt) + choice.generated
        self.preempted.append(Prefill(choice.job, tokens, choice, seq=choice.seq))
        choice.seq = None

    # ---- prefill -------------------------------------------------------------------------------------------
    def _prefill_plans(self, deadline: float | None, tasks: list[Prefill] | None = None,
                       short_only: bool = False) -> Iterator[StepPlan]:
        """Prefill forwards: up to ``prefill_chunk_size`` prompt tokens over the prefilling tasks (or ``tasks``), in
        order, each planned after the previous plan was applied; with batched prefill on, chunks of at most
        ``MAX_BATCHED_CHUNK`` tokens are planned together, last (their slots taken in turn). ``short_only``: longer
        tasks wait for the next step. ``deadline`` (``perf_counter`` time): no task starts past it, but the first
        always does."""
        budget = self.prefill_chunk_size
        together: list[PrefillChunk] = []
        ran = False
        for task in list(self.prefilling) if tasks is None else tasks:
            if task not in self.prefilling:  # preempted by an earlier task of this step
                continue
            if ran and deadline is not None and time.perf_counter() >= deadline:
                break  # the running sequences have waited long enough: the rest prefill after their decode
            if task.seq is None and not self._tier_ready(task):
                continue  # its prefix hit's disk blocks are being read: the others go on meanwhile
            ran = True
            if (task.seq is None or task.seq.preempted) and not self._open(task):
                continue  # it failed
            target = task.target
            if short_only and target - task.done > MAX_BATCHED_CHUNK:
                continue
            plan = None
            try:
                n = min(budget, target - task.done)
                if n == 1 and task.done == target - 1 and self._last_token_decodes(task):
                    self.totals["prefills_joined_decode"] += 1
                    plan = StepPlan(started=[task])  # its first decode step, with the running batch, feeds that token
                elif n == target - task.done and self._tail_joins_decode(task, n):
                    self.totals["prefills_joined_decode"] += 1
                    self.totals["prompt_tokens_joined_decode"] += n
                    plan = StepPlan(started=[task])  # its first decode step feeds the rest of its prompt
                elif n > 0:
                    n = self._room_for_chunk(task, task.seq.prefill_chunk(task.done, n))
                    if n == 0:
                        continue  # preempted: it waits for blocks
                    budget -= n
                    chunk = PrefillChunk(task, task.done, task.done + n,
                                         want_logits=task.first_from_prefill and task.done + n == target)
                    if self.batched_prefill and n <= MAX_BATCHED_CHUNK and task.seq.overflow is None:
                        task.seq.reserve(task.done, task.done + n)  # the next task's room check sees them
                        together.append(chunk)
                    elif chunk.want_logits and n > 1 and self.last_token_alone:
                        yield from self._body_then_last(chunk)
                    else:
                        plan = StepPlan(prefills=[chunk])
                elif task.done == target:
                    plan = StepPlan(started=[task])
            except Exception as exc:  # noqa: BLE001
                self._fail(task.job, exc)
            if plan is not None:
                yield plan
            if budget == 0:
                break
        together = [c for c in together if c.task in self.prefilling and c.task.seq is not None]
        if len(together) > 1:
            yield StepPlan(prefills=together, together=True)
        else:
            yield from (StepPlan(prefills=[c]) for c in together)

    def _body_then_last(self, chunk: PrefillChunk) -> Iterator[StepPlan]:
        """A chunk that ends a request's prompt, in mlx-lm's order: every token but the last fills the caches (no
        logits), then the last runs alone for the logits its first token is sampled from — so the first token and
        the cache contents are those of ``mlx_lm.generate`` on the same prompt, bit for bit."""
        task = chunk.task
        yield StepPlan(prefills=[PrefillChunk(task, chunk.start, chunk.end - 1, want_logits=False)])
        if task in self.prefilling and task.seq is not None and task.done == chunk.end - 1:
            yield StepPlan(prefills=[PrefillChunk(task, chunk.end - 1, chunk.end, want_logits=True)])

    def _room_for_chunk(self, task: Prefill, n: int) -> int:
        """How many of ``task``'s next ``n`` tokens to prefill now, making room by preemption; 0 when the task
        itself was preempted to wait for room (it ranks lowest)."""
        if self._make_room(task.seq, n):
            return n
        if len(self.pool) > 1:
            self._preempt_prefill(task)
            return 0
        while n > 1 and not self.pool.can_extend(task.seq, n):
            n //= 2  # alone: a smaller chunk (windowed groups release blocks as they go)
        if not self.pool.can_extend(task.seq, n):
            raise RuntimeError("the prompt does not fit the KV cache budget")
        return n

    def _last_token_decodes(self, task: Prefill) -> bool:
        """Whether a request cached but for its last token joins this step's decode batch (paged, batched) instead
        of a one-token prefill forward, which would cost about a whole decode step of its own."""
        return self.pool.is_paged and self.batched and task.first_from_prefill

    def _tail_joins_decode(self, task: Prefill, n: int) -> bool:
        """Whether a request whose prompt's last ``n`` (> 1) tokens are uncached feeds them in the running batch's
        next decode forward (a row of ``n`` positions) instead of prefilling them first: paged and batched, while
        sequences decode; one sample (``n=1``), no images, no speculation (its verification rows carry drafts)
        and not on a 3-D-position model; the joined forward computes at most :data:`MAX_JOINED_EXTRA` positions more
        than its own prefill would. The step the running sequences wait for then runs one forward, not two."""
        if not (self.running and self._last_token_decodes(task) and 1 < n <= MAX_JOINED_TAIL):
            return False
        request = task.job.request
        if (request.n != 1 or request.media or self.speculation is not None or task.seq.overflow is not None
                or self.runner.mrope):
            return False
        rows = [len(c.prompt_tail) + 1 for c in self.running] + [n]  # each row's positions
        return len(rows) * max(rows) - n <= MAX_JOINED_EXTRA

    def _prefilled(self, chunks: list[PrefillChunk], last: list[mx.array | None]) -> None:
        """``chunks`` were written; tasks whose prompt is complete start decoding, a request's own sampling its
        first token from its chunk's logits ``(1, vocab)`` and waking its client at once."""
        for chunk, first in zip(chunks, last):
            task = chunk.task
            try:
                task.seq.commit()
                task.done = chunk.end
                if task.done == task.target:
                    self._start_decoding(task, first)
                    if first is not None:
                        flush_wakeups()  # its first token goes out now, not after the step's other prefills
            except Exception as exc:  # noqa: BLE001
                self._fail(task.job, exc)

    def _start(self, task: Prefill) -> None:
        """``task``'s prompt is cached (but for its last token, which its first decode step feeds)."""
        try:
            self._start_decoding(task)
        except Exception as exc:  # noqa: BLE001
            self._fail(task.job, exc)

    def _start_decoding(self, task: Prefill, last_logits: mx.array | None = None) -> None:
        """``task``'s prompt is in its caches: its choices start decoding. ``last_logits`` ``(1, vocab)`` (a
        request's own prefill, whole prompt written): the choices sample their first token from it now; otherwise
        (the last prompt token not written) their first decode step feeds that token."""
        self.prefilling.remove(task)
        job, request = task.job, task.job.request
        if task.choice is not None:  # a resumed choice
            task.choice.seq, task.choice.next_input, task.choice.input_known_to_pool = task.seq, task.tokens[-1], True
            self._owners[task.seq.id] = task.choice
            self.running.append(task.choice)
            return
        tail = [] if last_logits is not None else task.tokens[task.done : task.target - 1]  # see _tail_joins_decode
        constraints = constraints_for(request, self.tokenizer, request.n)
        seqs = [task.seq]
        if request.n > 1:  # parallel samples: forks of the prefilled sequence (paged: sharing its blocks)
            seqs += self.pool.fork(task.seq.id, request.n - 1)
            job.opened.extend(seqs[1:])
        for i, seq in enumerate(seqs):
            sampler = RowSampler.for_choice(request, i)
            for processor in request.logits_processors:
                sampler.add_processor(processor)
            choice = Choice(job=job, index=i, seq=seq, sampler=sampler,
                            text=TextStream(self.tokenizer, request.params.stop, job.max_tokens),
                            next_input=request.prompt[-1], constraint=constraints[i], prompt_tail=tail)
            k = self.speculation.tokens_for(request.num_draft_tokens) if self.speculation is not None else 0
            if k > 0 and may_speculate(request, sampler, seq.overflow):
                choice.drafter = self.speculation.row(request.prompt, sampler, k, request.cache_salt)
            job.choices.append(choice)
            self._owners[seq.id] = choice
            self.running.append(choice)
        job.open_choices = len(seqs)
        if last_logits is not None:
            masks = step_masks(job.choices, last_logits.shape[-1], self._fail)
            tokens = self.runner.sample_first(last_logits, [c.sampler for c in job.choices], masks)
            now = time.perf_counter()
            for choice, token in zip(job.choices, tokens):
                choice.input_known_to_pool = False  # the whole prompt is written: the decode step feeds the new token
                if not job.finished:
                    self._emit(choice, token, now)

    # ---- decode --------------------------------------------------------------------------------------------
    def _decode(self) -> None:
        """One decode step for every running choice: planned, executed, applied."""
        plan = self.schedule_decode()
        if plan is not None:
            self.update(plan, self.runner.execute(plan))

    def schedule_decode(self) -> StepPlan | None:
        """The decode rows of this step (None: nobody decodes; the tokens in flight have been read). Paged: room
        for every row's next input, preempting as needed. When room is short, the tokens in flight are read
        first: a preemption must see every emitted token (:mod:`mlxkv.engine.decode_loop`)."""
        if any(c.drafter is not None for c in self.running):
            plan = self._schedule_verify()
            if plan is not None:
                return plan
        if self.decode_loop.in_flight and not self.pool.has_decode_headroom(len(self.running)):
            self._read_in_flight()
        choices = self._reserve() if self.pool.is_paged else [c for c in self.running if not ends_in_flight(c)]
        if not choices:
            self._read_in_flight()
            return None
        self.totals["decode_steps"] += 1
        self.totals["max_batch"] = max(self.totals["max_batch"], len(choices))
        self.totals["decode_rows"] += len(choices)
        plan = StepPlan(decode=choices, decode_inputs=decode_inputs(choices))
        if any(c.prompt_tail for c in choices):
            plan.prompt_tails = [c.prompt_tail for c in choices]
        if any(c.constraint is not None for c in choices):
            plan.masks = lambda logits: self._masks(choices, logits)
        return plan

    def _schedule_verify(self) -> StepPlan | None:
        """A verification step, when some row proposes tokens (None: none does; the plain step runs). The tokens in
        flight are read first: a proposal follows every emitted token. Each row gets room for its input and its
        proposal (a row that cannot have room for its proposal decodes one token; one with no room at all is
        preempted, as in :meth:`_reserve`)."""
        self._read_in_flight()
        drafting = [c for c in self.running if c.drafter is not None]
        budgets = [c.job.max_tokens - len(c.generated) - 1 for c in drafting]  # the target adds one token of its own
        made = propose_rows([c.drafter for c in drafting], budgets)
        proposals = {id(c): d for c, d in zip(drafting, made) if d.tokens}
        if not proposals:
            return None
        drafts: dict[int, list[int]] = {}
        draft_logprobs: dict[int, mx.array | None] = {}
        for choice in list(self.running):
            if choice not in self.running:  # preempted meanwhile
                continue
            proposal = proposals.get(id(choice))
            draft = proposal.tokens if proposal is not None else []
            if draft and choice.constraint is not None:  # cut where its grammar would refuse (it verifies the rest)
                draft = draft[: self._allowed_prefix(choice, draft)]
                if choice.job.finished:
                    continue
            if draft and not self._make_room(choice.seq, 1 + len(draft)):
                draft = []  # its drafter hears of it in verified(0, 0)
            if not draft and not self._make_room(choice.seq, 1):
                if len(self.pool) == 1:  # alone and still no room (a safety net: submit caps every request)
                    choice.job.handle.put(Event("token", index=choice.index, finish_reason="length"))
                    self._close_choice(choice, "length")
                else:
                    self._preempt_choice(choice)
                continue
            if choice.input_known_to_pool:  # the opened tokens' last: its slot only is taken
                choice.seq.reserve_last()
                if draft:
                    choice.seq.feed(draft)
            else:
                choice.seq.feed([choice.next_input, *draft])
            choice.input_known_to_pool = False
            drafts[id(choice)] = draft
            q = proposal.logprobs if draft and proposal is not None else None
            draft_logprobs[id(choice)] = q[: len(draft)] if q is not None else None
        choices = [c for c in self.running if id(c) in drafts]
        if not choices:
            return None
        self.totals["decode_steps"] += 1
        self.totals["max_batch"] = max(self.totals["max_batch"], len(choices))
        self.totals["decode_rows"] += len(choices)
        plan = StepPlan(decode=choices, drafts=[drafts[id(c)] for c in choices],
                        draft_logprobs=[draft_logprobs[id(c)] for c in choices])
        if any(c.constraint is not None for c in choices):
            plan.masks = lambda logits: verify_masks(choices, plan.drafts, logits.shape[-1], self._fail)
        return plan

    def _allowed_prefix(self, choice: Choice, draft: list[int]) -> int:
        """How many leading tokens of ``draft`` ``choice``'s grammar allows (0 when its grammar engine fails: the
        request is failed)."""
        try:
            return choice.constraint.allowed_prefix(draft)
        except Exception as exc:  # noqa: BLE001 - the grammar engine's failure is this request's alone
            self._fail(choice.job, exc)
            return 0

    def _verified(self, plan: StepPlan, out: StepOutput) -> None:
        """A verification step's rows: rejected positions trimmed from each row's caches (paged: their slots go back
        to the pool), the rest committed (only verified tokens reach block hashes), then each row's accepted
        tokens and the target's own emitted in order (a stop, EOS or length ends the row there)."""
        choices = plan.decode
        if out.error is not None:  # the shared forward failed: fail the requests in it
            for job in {id(c.job): c.job for c in choices}.values():
                self._fail(job, out.error)
            return
        self.totals["verify_steps"] += 1
        now = time.perf_counter()
        for b, c in enumerate(choices):
            if b in out.row_errors and not c.job.finished:
                self._fail(c.job, out.row_errors[b])
            if c.done or c.job.finished:
                continue
            tokens, drafted = out.committed[b], len(plan.drafts[b])
            accepted = len(tokens) - 1
            try:
                if accepted < drafted:
                    CacheRewinder(c.seq.caches, max_trim=drafted).trim(drafted - accepted)
                c.seq.commit()
            except Exception as exc:  # noqa: BLE001 - a cache that cannot rewind fails its request only
                self._fail(c.job, exc)
                continue
            self.totals["draft_tokens"] += drafted
            self.totals["accepted_draft_tokens"] += accepted
            self.totals["decode_tokens"] += len(tokens)
            c.job.draft_tokens += drafted
            c.job.accepted_draft_tokens += accepted
            if c.drafter is not None:
                c.drafter.verified(drafted, accepted)
            for token in tokens:
                self._emit(c, token, now)
                if c.done or c.job.finished:
                    break

    def _masks(self, choices: list[Choice], logits: mx.array) -> list | None:
        """The rows' grammar masks. A mask follows its row's previous token: with tokens in flight, the forward is
        queued, then they are read (emitted, so consumed by their grammars) while it runs."""
        if self.decode_loop.in_flight:
            mx.async_eval(logits)
            self.totals["overlapped_steps"] += 1
            self._read_in_flight()
        return step_masks(choices, logits.shape[-1], self._fail)

    def _reserve(self) -> list[Choice]:
        """Paged: room for every running choice's next input, preempting as needed; returns who decodes."""
        for choice in list(self.running):
            if choice not in self.running or ends_in_flight(choice):  # preempted meanwhile / nothing to feed
                continue
            if not self._make_room(choice.seq, 1 + len(choice.prompt_tail)):
                self._read_in_flight()  # (normally done already: schedule_decode reads them first when short)
                if choice.done or choice.job.finished:
                    continue
                if len(self.pool) == 1:  # alone and still no room (a safety net: submit caps every request)
                    choice.job.handle.put(Event("token", index=choice.index, finish_reason="length"))
                    self._close_choice(choice, "length")
                else:
                    self._preempt_choice(choice)
                continue
            if choice.prompt_tail:  # its prompt's uncached end and last token: known to the pool, slots taken
                end = len(choice.job.request.prompt)
                choice.seq.reserve(end - len(choice.prompt_tail) - 1, end)
            elif choice.input_known_to_pool:  # the opened tokens' last: known to the pool, its slot only is taken
                choice.seq.reserve_last()
            elif choice.in_flight is not None:  # its value is still being computed: named when it is read
                choice.placeholder_at = choice.seq.feed_placeholder()
            else:
                choice.seq.feed([choice.next_input])
            choice.input_known_to_pool = False
        return [c for c in self.running if not ends_in_flight(c)]

    def _decoded(self, plan: StepPlan, out: StepOutput) -> None:
        """The decode rows' tokens are held in flight (read next step); the previous step's are read now. A step
        that computes some request's first token (a prompt that joined the decode batch) is read at once."""
        choices = plan.decode
        if out.error is not None:  # the shared forward failed: fail the requests in it
            self._read_in_flight()
            for job in {id(c.job): c.job for c in choices}.values():
                self._fail(job, out.error)
            return
        if self.decode_loop.in_flight:
            self.totals["overlapped_steps"] += 1
        self._read_in_flight()  # the previous step's tokens (named before this step's positions are committed)
        for b, c in enumerate(choices):
            if b in out.row_errors and not c.job.finished:
                self._fail(c.job, out.row_errors[b])  # its own sampling failed: the other rows go on
            if c.prompt_tail:
                c.prompt_tail = []  # written by this step
            if c.done or c.job.finished:
                continue  # closed by its previous token: this step's token is dropped
            c.seq.commit()
            self.totals["decode_tokens"] += 1
            self.decode_loop.hold(c, out.tokens, b)
        if any(c.job.first_token_at is None for c in choices):
            self._read_in_flight()  # a request's first token: out now, not a step late

    def _read_in_flight(self) -> None:
        """Read and emit the last decode step's tokens (a preemption must see every emitted token)."""
        self.decode_loop.read(self._read_token)

    def _read_token(self, choice: Choice, token: int, now: float) -> None:
        """A token read from flight: its placeholder named in the pool, then emitted."""
        try:
            if choice.placeholder_at is not None:
                choice.seq.name_token(choice.placeholder_at, token)
                choice.placeholder_at = None
            self._emit(choice, token, now)
        except Exception as exc:  # noqa: BLE001
            self._fail(choice.job, exc)

    def _emit(self, choice: Choice, token: int, now: float) -> None:
        if choice.drafter is not None:
            choice.drafter.emitted(token)
        consume(choice, token)  # its grammar follows emitted tokens only (none is emitted twice)
        self.totals["generation_tokens"] += 1
        finish = emit_token(choice, token, now, self.observer)
        if finish is not None:
            self._close_choice(choice, finish)

    def _close_choice(self, choice: Choice, finish: str) -> None:
        job = choice.job
        choice.done, choice.constraint = True, None
        if choice.drafter is not None:
            choice.drafter.end()  # a draft model's sequence is released with the row
        self.running.remove(choice)
        if choice.seq is job.sequence:
            self._owners.pop(choice.seq.id, None)  # a continued sequence stays open for its owner
        else:
            self._release(choice.seq)
        job.open_choices -= 1
        if job.open_choices == 0:
            self._end(job, end_event(job), "finished", finish)

    # ---- endings -------------------------------------------------------------------------------------------
    def _fail(self, job: Job, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self._end(job, Event("error", finish_reason="error", message=message), "failed")

    def _end(self, job: Job, event: Event, outcome: str, finish_reason: str | None = None) -> None:
        """Remove ``job`` everywhere, release its sequences, send its terminal event (once)."""
        if job.finished:
            return
        job.finished = True
        if any(entry[2] is job for entry in self.waiting):
            self.waiting = [entry for entry in self.waiting if entry[2] is not job]
            heapq.heapify(self.waiting)
            self._on_dequeue()
        self.prefilling = [t for t in self.prefilling if t.job is not job]
        self.preempted = collections.deque(t for t in self.preempted if t.job is not job)
        self.running = [c for c in self.running if c.job is not job]
        for choice in job.choices:
            choice.constraint = None  # the grammar engine's state goes with the request
            if choice.drafter is not None:
                choice.drafter.end()
        for seq in job.opened:
            self._release(seq)
        if job.sequence is not None:
            self._owners.pop(job.sequence.id, None)
        self.totals[outcome] += 1
        try:
            job.handle.put(event)
        finally:
            job.report(self.observer, finish_reason or event.finish_reason or outcome)
