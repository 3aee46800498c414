"""The continuous-batching scheduler: admission, chunked prefill and one batched decode forward per step.

Runs on the engine thread only (it owns the model and the CachePool). Each :meth:`Scheduler.step`:

1. drops cancelled requests (their sequences are released);
2. admits waiting requests, lowest ``priority`` first, while their ``n`` sequences fit in ``max_sequences``;
3. prefills up to ``prefill_chunk_size`` prompt tokens over the newly admitted requests, in admission order;
   a request's prompt is prefilled except its last token, as mlx-lm's ``generate_step`` does; then its
   caches are forked for ``n > 1`` and its choices join the running set;
4. runs one decode forward for every running sequence, whatever their lengths (batch views, see
   :mod:`mlxkv.engine.batch_view`), feeding each its pending token (the last prompt token first), samples,
   streams text and releases finished sequences.

Failures are contained: an exception while prefilling or streaming a request fails that request only; an
exception in the shared decode forward fails the requests in it; the engine goes on either way. Every
sequence a request opened is released when it ends, however it ends.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxkv.engine.batch_view import BatchUnsupported, check_attended, make_batch_views
from mlxkv.engine.forking import fork_caches
from mlxkv.engine.request import Event, GenerationRequest, RequestHandle, Usage
from mlxkv.engine.row_sampler import RowSampler, sample_rows
from mlxkv.engine.text_stream import TextStream
from mlxkv.pool import CachePool, Sequence


class EngineObserver:
    """Receives per-request timings from the engine thread (the server's metrics implement it)."""

    def on_first_token(self, seconds: float) -> None:
        """Time from submission to the first generated token of a request."""

    def on_request_finished(self, finish_reason: str, usage: Usage, time_per_output_token: float | None) -> None:
        """A request ended; ``time_per_output_token`` is ``None`` with fewer than two tokens per choice."""


@dataclass(eq=False)
class Job:
    """A request inside the scheduler."""

    request: GenerationRequest
    handle: RequestHandle
    max_tokens: int  # per choice, already capped by the context length
    submitted_at: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None  # the prefill sequence (choice 0's once decoding)
    opened: list[Sequence] = field(default_factory=list)  # every sequence opened for it: released at the end
    prefilled: int = 0  # prompt tokens in the cache; prefill stops at len(prompt) - 1
    choices: list["Choice"] = field(default_factory=list)
    open_choices: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False


@dataclass(eq=False)
class Choice:
    """One sequence being decoded: choice ``index`` of its job."""

    job: Job
    index: int
    seq: Sequence
    sampler: RowSampler
    text: TextStream
    next_input: int  # the token the next decode step feeds
    done: bool = False


class Scheduler:
    """Continuous batching over one model and its CachePool (engine thread only).

    Args:
        model: the mlx-lm model (attention hook installed for batched decode).
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``None``: tokens only).
        pool: owns every sequence's layer caches.
        max_sequences: most sequences prefilling or decoding at once (default: the pool's ``max_sequences``).
        prefill_chunk_size: most prompt tokens prefilled per step (over all admitted requests).
        observer: receives timings.
        on_dequeue: called once per request leaving the waiting queue (admitted or dropped).
        batched: ``False`` decodes sequences one by one; ``True`` uses batch views.
    """

    def __init__(self, model: Any, tokenizer: Any, pool: CachePool, *, max_sequences: int | None = None,
                 prefill_chunk_size: int = 512,
                 observer: EngineObserver | None = None, on_dequeue: Callable[[], None] = lambda: None,
                 batched: bool = True):
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.max_sequences = pool.max_sequences if max_sequences is None else min(max_sequences, pool.max_sequences)
        self.prefill_chunk_size = prefill_chunk_size
        self.observer = observer or EngineObserver()
        self.batched = batched
        self._on_dequeue = on_dequeue
        self._order = itertools.count()
        self.waiting: list[tuple[int, int, Job]] = []  # heap of (priority, arrival, job)
        self.prefilling: list[Job] = []
        self.running: list[Choice] = []
        self.totals = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0, generation_tokens=0,
                           steps=0, decode_steps=0, batched_steps=0, unbatched_steps=0, max_batch=0)

    # ---- queue ---------------------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        """Queue a job for admission."""
        self.totals["requests"] += 1
        heapq.heappush(self.waiting, (job.request.priority, next(self._order), job))

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def jobs(self) -> list[Job]:
        """Every job not finished yet (waiting, prefilling or running)."""
        seen = {id(j): j for _, _, j in self.waiting}
        seen.update({id(j): j for j in self.prefilling})
        seen.update({id(c.job): c.job for c in self.running})
        return list(seen.values())

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Cancel, admit, prefill a chunk, decode one token for every running sequence."""
        self.totals["steps"] += 1
        for job in self.jobs():
            if job.handle.cancelled:
                self._end(job, Event("error", finish_reason="cancelled", message="the request was cancelled"),
                          "cancelled")
        self._admit()
        self._prefill()
        self._decode()

    def _admit(self) -> None:
        while self.waiting:
            job = self.waiting[0][2]
            if job.request.n > self.max_sequences:
                self._fail(job, ValueError(f"n={job.request.n} exceeds max_sequences={self.max_sequences}"))
                continue
            in_use = sum(j.request.n for j in self.prefilling) + len(self.running)
            if in_use + job.request.n > self.max_sequences:
                return
            heapq.heappop(self.waiting)
            self._on_dequeue()
            try:
                job.seq = self.pool.open(prompt_length=len(job.request.prompt))
                job.opened.append(job.seq)
                self.totals["prompt_tokens"] += len(job.request.prompt)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the engine
                self._fail(job, exc)
                continue
            self.prefilling.append(job)

    def _prefill(self) -> None:
        budget = self.prefill_chunk_size
        for job in list(self.prefilling):
            target = len(job.request.prompt) - 1  # the last prompt token is fed by the first decode step
            try:
                n = min(budget, target - job.prefilled)
                if n > 0:
                    chunk = mx.array(job.request.prompt[job.prefilled : job.prefilled + n], dtype=mx.uint32)
                    self.model(chunk[None], cache=job.seq.caches)  # (1, n) -> logits unused
                    mx.eval(_cache_arrays(job.seq.caches))
                    job.prefilled += n
                    budget -= n
                if job.prefilled == target:
                    self._start_decoding(job)
            except Exception as exc:  # noqa: BLE001
                self._fail(job, exc)
            if budget == 0:
                return

    def _start_decoding(self, job: Job) -> None:
        self.prefilling.remove(job)
        request = job.request
        seqs = [job.seq]
        for _ in range(request.n - 1):  # parallel samples: copy the prefilled caches (paged fork later)
            seq = self.pool.open(prompt_length=len(request.prompt))
            job.opened.append(seq)
            seq.caches[:] = fork_caches(job.seq.caches)
            seqs.append(seq)
        seed = request.params.seed
        for i, seq in enumerate(seqs):
            job.choices.append(Choice(
                job=job, index=i, seq=seq,
                sampler=RowSampler(request.params, seed=None if seed is None else seed + i),
                text=TextStream(self.tokenizer, request.params.stop, job.max_tokens),
                next_input=request.prompt[-1]))
        job.open_choices = len(seqs)
        self.running.extend(job.choices)

    def _decode(self) -> None:
        choices = list(self.running)
        if not choices:
            return
        self.totals["decode_steps"] += 1
        self.totals["max_batch"] = max(self.totals["max_batch"], len(choices))
        try:
            logits = self._forward(choices)  # (B, vocab)
            tokens = sample_rows(logits, [c.sampler for c in choices])  # (B,)
            mx.eval(tokens)
            tokens = tokens.tolist()
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: fail the requests in it
            for job in {id(c.job): c.job for c in choices}.values():
                self._fail(job, exc)
            return
        now = time.perf_counter()
        for choice, token in zip(choices, tokens):
            if choice.job.finished:
                continue
            try:
                self._emit(choice, token, now)
            except Exception as exc:  # noqa: BLE001
                self._fail(choice.job, exc)

    def _forward(self, choices: list[Choice]) -> mx.array:
        inputs = mx.array([[c.next_input] for c in choices], dtype=mx.uint32)  # (B, 1)
        if self.batched and len(choices) > 1:
            views: list = []
            try:
                views = make_batch_views([c.seq.caches for c in choices])
                logits = self.model(inputs, cache=views)[:, -1, :]  # (B, vocab)
            except BatchUnsupported:
                if any(getattr(v, "_fetched", None) is not None for v in views):
                    raise  # caches were written: this step cannot be redone
                self.totals["unbatched_steps"] += 1
            else:
                check_attended(views)
                self.totals["batched_steps"] += 1
                return logits
        rows = [self.model(inputs[b : b + 1], cache=c.seq.caches)[:, -1, :] for b, c in enumerate(choices)]
        return mx.concatenate(rows, axis=0)  # (B, vocab)

    def _emit(self, choice: Choice, token: int, now: float) -> None:
        job = choice.job
        if job.first_token_at is None:
            job.first_token_at = now
            self.observer.on_first_token(now - job.submitted_at)
        job.last_token_at = now
        job.completion_tokens += 1
        self.totals["generation_tokens"] += 1
        text, finish = choice.text.feed(token)
        job.handle.put(Event("token", index=choice.index, text=text, token=token, finish_reason=finish))
        if finish is None:
            choice.next_input = token
            return
        choice.done = True
        self.running.remove(choice)
        self.pool.release(choice.seq.id)
        job.open_choices -= 1
        if job.open_choices == 0:
            usage = Usage(len(job.request.prompt), job.completion_tokens)
            self._end(job, Event("done", usage=usage), "finished", finish)

    # ---- endings -------------------------------------------------------------------------------------------
    def _fail(self, job: Job, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self._end(job, Event("error", finish_reason="error", message=message), "failed")

    def _end(self, job: Job, event: Event, outcome: str, finish_reason: str | None = None) -> None:
        """Remove ``job`` everywhere, release its open sequences, send its terminal event (once)."""
        if job.finished:
            return
        job.finished = True
        if any(entry[2] is job for entry in self.waiting):
            self.waiting = [entry for entry in self.waiting if entry[2] is not job]
            heapq.heapify(self.waiting)
            self._on_dequeue()
        if job in self.prefilling:
            self.prefilling.remove(job)
        self.running = [c for c in self.running if c.job is not job]
        for seq in job.opened:
            if seq.id in self.pool:
                self.pool.release(seq.id)
        self.totals[outcome] += 1
        try:
            job.handle.put(event)
        finally:
            usage = Usage(len(job.request.prompt), job.completion_tokens)
            tpot = None
            if job.first_token_at is not None and job.completion_tokens > len(job.choices) >= 1:
                per_choice = job.completion_tokens / len(job.choices)
                tpot = (job.last_token_at - job.first_token_at) / max(per_choice - 1, 1)
            self.observer.on_request_finished(finish_reason or event.finish_reason or outcome, usage, tpot)


def _cache_arrays(caches: list) -> list[mx.array]:
    """The arrays holding the caches' state, to evaluate between prefill chunks."""
    out = []
    for c in caches:
        tree = c.arrays() if hasattr(c, "arrays") else c.state
        out.extend(x for _, x in tree_flatten(tree) if isinstance(x, mx.array))
    return out
