"""The continuous-batching scheduler: admission, chunked prefill and one batched decode forward per step.

Runs on the engine thread only (it owns the model and the CachePool). Each :meth:`Scheduler.step`:

1. drops cancelled requests (their sequences are released);
2. admits preempted sequences first, then waiting requests, lowest ``priority`` first, while their ``n``
   sequences fit in ``max_sequences`` (and, paged, their blocks fit in the free or evictable blocks);
3. prefills up to ``prefill_chunk_size`` prompt tokens over the admitted sequences, in admission order;
   a sequence is opened (paged: its prefix hit taken) only when its turn comes, i.e. once every sequence
   ahead of it has prefilled: requests admitted together that share an uncached prefix compute it once (the
   first commits its blocks, the next ones open after it and hit them: in-flight prefix sharing). With batched
   prefill on (:mod:`mlxkv.engine.prefill_batch`), the step's chunks of at most ``MAX_BATCHED_CHUNK`` tokens
   run in one forward after the others (sharing in flight then covers what was committed before the step). A
   request's own prompt is prefilled whole and its first token sampled from the last position's logits (one the
   prefix cache holds but for its last token skips that forward: it joins this step's decode batch, and that
   step is read at once); a
   resumed or sample sequence's except its last token, as mlx-lm's ``generate_step`` does; from
   ``seq.num_cached`` on (the paged prefix hit). Then ``n > 1`` makes the other samples' sequences (dense:
   copied caches; paged: sequences opened on the same prompt, which take its cached blocks) and the choices
   join the running set;
4. runs one decode forward for every running sequence, whatever their lengths (batch views, see
   :mod:`mlxkv.kv.batching.dense_views`), feeding each its pending token (the last prompt token first), samples,
   streams text and releases finished sequences. Paged: each sequence's slot is reserved before the forward
   and every sequence commits after it.

Paged preemption: when a sequence needs a block and none is free or evictable, the manager's lowest-ranked
sequence (lowest priority, then newest) is released for recompute: its verified blocks stay cached, and it is
re-queued with its prompt + generated tokens as the prompt, resuming with a prefix hit. A sequence that ranks
lowest itself waits that way. Every request fits the pool alone (``BatchEngine.submit`` caps it), so every
request completes.

Failures are contained: an exception while prefilling or streaming a request fails that request only; an
exception in the shared decode forward fails the requests in it; the engine goes on either way. Every
sequence a request opened is released when it ends, however it ends.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from typing import Any, Callable

import mlx.core as mx

from mlxkv.kv.batching import BatchUnsupported, check_attended, make_batch_views
from mlxkv.engine.delivery import flush_wakeups
from mlxkv.engine.forking import fork_caches
from mlxkv.engine.jobs import PLACEHOLDER, Choice, EngineObserver, Job, Prefill
from mlxkv.kv.admission import apply_request_policy, blocks_needed
from mlxkv.engine.prefill_batch import cache_arrays, prefill_together
from mlxkv.engine.request import Event, Usage
from mlxkv.engine.row_sampler import RowSampler, sample_rows
from mlxkv.engine.text_stream import TextStream
from mlxkv.kv.store import CachePool, Sequence

__all__ = ["MAX_BATCHED_CHUNK", "PLACEHOLDER", "Choice", "EngineObserver", "Job", "Prefill", "Scheduler"]


#: How long past a step's start prefills may still start before that step's decode (seconds): new arrivals when the
#: engine was idle, any prompt when sequences are decoding (they wait at most this long plus one prefill).
PREFILL_FIRST_S = 0.1
#: Prefill chunks of at most this many tokens may share one batched forward (a longer one would pad every row of
#: the batch to its length); see :mod:`mlxkv.engine.prefill_batch`.
MAX_BATCHED_CHUNK = 128


class Scheduler:
    """Continuous batching over one model and its CachePool (engine thread only).

    Args:
        model: the mlx-lm model (attention hook installed for batched decode).
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``None``: tokens only).
        pool: owns every sequence's layer caches (dense or paged).
        max_sequences: most sequences prefilling or decoding at once (default: the pool's ``max_sequences``).
        prefill_chunk_size: most prompt tokens prefilled per step (over all admitted requests).
        observer: receives timings.
        on_dequeue: called once per request leaving the waiting queue (admitted or dropped).
        batched: ``False`` decodes sequences one by one; ``True`` uses batch views.
        batched_prefill: prefill chunks of up to ``MAX_BATCHED_CHUNK`` tokens of different sequences in one
            forward (:mod:`mlxkv.engine.prefill_batch`); switched off by the first step that cannot.
        intake: called mid-step to :meth:`add` requests that arrived meanwhile, True if it added any: those
            are admitted and prefilled before the step's decode, up to ``PREFILL_FIRST_S`` after the step began.
    """

    def __init__(self, model: Any, tokenizer: Any, pool: CachePool, *, max_sequences: int | None = None,
                 prefill_chunk_size: int = 512,
                 observer: EngineObserver | None = None, on_dequeue: Callable[[], None] = lambda: None,
                 batched: bool = True, batched_prefill: bool = False, intake: Callable[[], bool] | None = None):
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.manager = pool.paged.manager if pool.paged is not None else None
        self.max_sequences = pool.max_sequences if max_sequences is None else min(max_sequences, pool.max_sequences)
        self.prefill_chunk_size = prefill_chunk_size
        self.observer = observer or EngineObserver()
        self.batched = batched
        self.batched_prefill = batched_prefill
        self.intake = intake
        self._on_dequeue = on_dequeue
        self._order = itertools.count()
        self.waiting: list[tuple[int, int, Job]] = []  # heap of (priority, arrival, job)
        self.preempted: collections.deque[Prefill] = collections.deque()  # resumed before any new admission
        self.prefilling: list[Prefill] = []
        self.running: list[Choice] = []
        self._in_flight: list[tuple[Choice, mx.array, int]] = []  # the last decode step's tokens, not read yet
        self.totals = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0, generation_tokens=0,
                           steps=0, decode_steps=0, batched_steps=0, unbatched_steps=0, max_batch=0,
                           preemptions=0, prefix_queries=0, prefix_hits=0, overlapped_steps=0,
                           batched_prefills=0, prefills_joined_decode=0)

    # ---- queue ---------------------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        """Queue a job for admission."""
        self.totals["requests"] += 1
        heapq.heappush(self.waiting, (job.request.priority, next(self._order), job))

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.prefilling or self.running or self._in_flight)

    def jobs(self) -> list[Job]:
        """Every job not finished yet (waiting, preempted, prefilling or running)."""
        seen = {id(j): j for _, _, j in self.waiting}
        seen.update({id(t.job): t.job for t in (*self.preempted, *self.prefilling)})
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
        limit = time.perf_counter() + PREFILL_FIRST_S
        # Sequences already decoding wait for this step's prefills: none starts past the limit (a burst of
        # prompts into a busy engine spreads over steps instead of stalling every running stream for all of them).
        deadline = limit if self.running else None
        self._admit()
        self._prefill(deadline=deadline)
        flush_wakeups()  # anything this step's prefills emitted goes out before its decode runs
        # Requests that arrived meanwhile prefill before this step's decode (new prompts first, short ones: a long
        # uncached prompt waits for the next step), while the running sequences' token has waited < PREFILL_FIRST_S.
        while self.intake is not None and time.perf_counter() < limit and self.intake():
            self._admit()
            new = [t for t in self.prefilling if t.seq is None]
            if not new:
                break
            self._prefill(new, short_only=True, deadline=deadline)
            flush_wakeups()
        self._decode()

    def _seats(self) -> int:
        return len(self.running) + sum(t.seats for t in self.prefilling)

    def _admit(self) -> None:
        """Preempted sequences first (in preemption order), then waiting jobs by priority; each while its
        seats fit in ``max_sequences`` and (paged) its blocks fit in the free (or evictable) blocks."""
        free = self.manager.pool.num_free_blocks if self.manager is not None else 0
        while self.preempted:
            task = self.preempted[0]
            need = self._blocks_for(len(task.tokens) + 1)
            if self._seats() + task.seats > self.max_sequences or need > free:
                return  # nothing new is admitted before the preempted sequences are back
            self.preempted.popleft()
            free -= need
            self.prefilling.append(task)  # opened when its turn to prefill comes (see _prefill)
        while self.waiting:
            job = self.waiting[0][2]
            if job.request.n > self.max_sequences:
                self._fail(job, ValueError(f"n={job.request.n} exceeds max_sequences={self.max_sequences}"))
                continue
            need = self._blocks_for(len(job.request.prompt) + 1)
            if self._seats() + job.request.n > self.max_sequences or (need > free and self._seats() > 0):
                return
            heapq.heappop(self.waiting)
            self._on_dequeue()
            free -= need
            self.totals["prompt_tokens"] += len(job.request.prompt)
            self.prefilling.append(Prefill(job, list(job.request.prompt), seats=job.request.n))

    def _blocks_for(self, num_tokens: int) -> int:
        if self.manager is None:
            return 0
        return blocks_needed(self.manager.specs, self.manager.block_size, num_tokens)

    def _open(self, task: Prefill) -> bool:
        """Open ``task``'s sequence (paged: with its tokens, salt, retention and priority; prefix hit taken).

        False if that failed (the request has failed)."""
        job, request = task.job, task.job.request
        try:
            if self.manager is None:
                task.seq = self.pool.open(prompt_length=len(request.prompt))
            else:
                task.seq = self.pool.open(prompt_length=len(request.prompt), prompt=task.tokens,
                                          salt=request.cache_salt)
                apply_request_policy(self.manager, task.seq.paged.seq_id, request)
            job.opened.append(task.seq)
            task.done = task.seq.num_cached
            if not job.queried:  # the request's own prefix lookup (not a sample's or a resume's)
                job.queried, job.cached_tokens = True, task.done
                self.totals["prefix_queries"] += len(request.prompt)
                self.totals["prefix_hits"] += task.done
        except Exception as exc:  # noqa: BLE001 - fail this request, not the engine
            self._fail(job, exc)
            return False
        return True

    # ---- paged growth and preemption -----------------------------------------------------------------------
    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Whether ``n`` more tokens of ``seq`` fit, preempting lower-ranked sequences (lower priority, then
        newer) if needed; False when they do not fit and no sequence ranks below ``seq``."""
        sid = seq.paged.seq_id
        while not self.manager.can_allocate(sid, n):
            victim = self.manager.choose_victim(requester=sid)
            if victim is None:
                return False
            self._preempt_id(victim)
        return True

    def _preempt_id(self, manager_seq_id: int) -> None:
        for task in self.prefilling:
            if task.seq is not None and task.seq.paged.seq_id == manager_seq_id:
                return self._preempt_prefill(task)
        for choice in self.running:
            if choice.seq.paged.seq_id == manager_seq_id:
                return self._preempt_choice(choice)
        raise AssertionError(f"the manager's sequence {manager_seq_id} belongs to no request")

    def _release(self, seq: Sequence) -> None:
        if seq.id in self.pool:
            self.pool.release(seq.id)  # verified blocks stay cached: the resume takes them as a prefix hit

    def _preempt_prefill(self, task: Prefill) -> None:
        self.prefilling.remove(task)
        self._release(task.seq)
        task.seq, task.done = None, 0
        self.preempted.append(task)
        self.totals["preemptions"] += 1

    def _preempt_choice(self, choice: Choice) -> None:
        """Release a decoding choice's sequence; it resumes with its prompt + generated tokens as the prompt."""
        if choice.in_flight is not None:
            self._land()  # its last sampled token belongs to what it resumes with
            if choice.done or choice.job.finished:
                return
        self.running.remove(choice)
        self._release(choice.seq)
        choice.seq = None
        self.preempted.append(Prefill(choice.job, list(choice.job.request.prompt) + choice.generated, choice))
        self.totals["preemptions"] += 1

    # ---- prefill -------------------------------------------------------------------------------------------
    def _prefill(self, tasks: list[Prefill] | None = None, short_only: bool = False,
                 deadline: float | None = None) -> None:
        """Up to ``prefill_chunk_size`` prompt tokens over the prefilling tasks (or ``tasks``), in order. With batched
        prefill on, chunks of at most ``MAX_BATCHED_CHUNK`` tokens run together in one forward after the loop (their
        slots reserved in turn, so the pool's accounting is the sequential one's); other chunks run one by one.
        ``short_only``: a task with more than ``MAX_BATCHED_CHUNK`` tokens left waits for the next step (opened).
        ``deadline`` (``perf_counter`` time): no task starts past it, but the first always does."""
        budget = self.prefill_chunk_size
        together: list[tuple[Prefill, int]] = []
        ran = False
        for task in list(self.prefilling) if tasks is None else tasks:
            if task not in self.prefilling:  # preempted by an earlier task of this step
                continue
            if ran and deadline is not None and time.perf_counter() >= deadline:
                break  # the running sequences have waited long enough: the rest prefill after their decode
            ran = True
            if task.seq is None and not self._open(task):
                continue  # it failed
            target = _prefill_target(task)
            if short_only and target - task.done > MAX_BATCHED_CHUNK:
                continue
            try:
                n = min(budget, target - task.done)
                if n == 1 and task.done == target - 1 and self._last_token_decodes(task):
                    self.totals["prefills_joined_decode"] += 1
                    self._start_decoding(task)  # its first decode step, with the running batch, feeds that token
                elif n > 0:
                    if self.manager is not None and not self._make_room(task.seq, n):
                        if len(self.pool) > 1:
                            self._preempt_prefill(task)  # it ranks lowest: wait for blocks
                            continue
                        while n > 1 and not self.manager.can_allocate(task.seq.paged.seq_id, n):
                            n //= 2  # alone: a smaller chunk (windowed groups release blocks as they go)
                        if not self.manager.can_allocate(task.seq.paged.seq_id, n):
                            raise RuntimeError("the prompt does not fit the KV cache budget")
                    budget -= n
                    if self.batched_prefill and n <= MAX_BATCHED_CHUNK:
                        if self.manager is not None:  # take the slots now: the next task's room check sees them
                            task.seq.paged.slots(0, task.done, task.done + n)
                        together.append((task, n))
                    else:
                        self._prefilled([task], [n], self._forward_chunk(task, n))
                elif task.done == target:
                    self._start_decoding(task)
            except Exception as exc:  # noqa: BLE001
                self._fail(task.job, exc)
            if budget == 0:
                break
        self._prefill_together([(t, n) for t, n in together if t in self.prefilling and t.seq is not None])

    def _last_token_decodes(self, task: Prefill) -> bool:
        """Whether a request whose prompt the prefix cache holds but for its last token skips a one-token prefill
        forward: it joins this step's decode batch (paged, batched decode), whose forward feeds that token and
        samples its first token — as mixed prefill/decode batches do; a separate forward would cost about a
        whole decode step of its own."""
        return self.manager is not None and self.batched and _first_from_prefill(task)

    def _forward_chunk(self, task: Prefill, n: int) -> mx.array | None:
        """Task's next ``n`` prompt tokens through the model, evaluated; the last position's logits ``(1, vocab)``
        when the chunk ends a request's own prompt (its first token is sampled from them), else None."""
        chunk = mx.array(task.tokens[task.done : task.done + n], dtype=mx.uint32)
        logits = self.model(chunk[None], cache=task.seq.caches)  # (1, n, vocab)
        last = logits[:, -1, :] if _first_from_prefill(task) and task.done + n == _prefill_target(task) else None
        mx.eval(cache_arrays(task.seq.caches), *([last] if last is not None else []))
        return last

    def _prefill_together(self, together: list[tuple[Prefill, int]]) -> None:
        """The chunks ``together`` in one batched forward (one by one when fewer than two, or when the model's
        layers cannot be batched: then batched prefill is switched off for good)."""
        if len(together) > 1:
            tasks, lengths = [t for t, _ in together], [n for _, n in together]
            try:
                last = prefill_together(self.model, [t.seq.caches for t in tasks],
                                        [t.tokens[t.done : t.done + n] for t, n in together])  # (B, vocab)
            except Exception as exc:  # noqa: BLE001 - rewind, then one by one: only a request that fails alone fails
                if isinstance(exc, BatchUnsupported):
                    self.batched_prefill = False
                if not all(_rewind(t) for t in tasks):
                    return self._fail_all(tasks, exc)
            else:
                self.totals["batched_prefills"] += 1
                return self._prefilled(tasks, lengths, last)
        for task, n in together:
            try:
                self._prefilled([task], [n], self._forward_chunk(task, n))
            except Exception as exc:  # noqa: BLE001
                self._fail(task.job, exc)

    def _prefilled(self, tasks: list[Prefill], lengths: list[int], last: mx.array | None) -> None:
        """``tasks`` wrote their next ``lengths`` tokens; those whose prompt is complete start decoding, a request's
        own sampling its first token from its row of ``last`` ``(B, vocab)`` and waking its client at once."""
        for b, (task, n) in enumerate(zip(tasks, lengths)):
            try:
                task.seq.commit()
                task.done += n
                if task.done == _prefill_target(task):
                    first = last[b : b + 1] if last is not None and _first_from_prefill(task) else None
                    self._start_decoding(task, first)
                    if first is not None:
                        flush_wakeups()  # its first token goes out now, not after the step's other prefills
            except Exception as exc:  # noqa: BLE001
                self._fail(task.job, exc)

    def _fail_all(self, tasks: list[Prefill], exc: BaseException) -> None:
        for job in {id(t.job): t.job for t in tasks}.values():
            self._fail(job, exc)

    def _start_decoding(self, task: Prefill, last_logits: mx.array | None = None) -> None:
        """``task``'s prompt is in its caches: its choices start decoding. ``last_logits`` ``(1, vocab)`` (a
        request's own prefill, whole prompt written): the choices holding the prompt sample their first token from
        it now; otherwise (the last prompt token not written) their first decode step feeds that token."""
        self.prefilling.remove(task)
        job, request = task.job, task.job.request
        if task.choice is not None:  # a parallel sample's own sequence, or a resumed choice
            task.choice.seq, task.choice.next_input, task.choice.fresh = task.seq, task.tokens[-1], True
            self.running.append(task.choice)
            return
        seqs: list[Sequence | None] = [task.seq]
        for _ in range(request.n - 1):
            if self.manager is None:  # dense: copy the prefilled caches
                seq = self.pool.open(prompt_length=len(request.prompt))
                job.opened.append(seq)
                seq.caches[:] = fork_caches(task.seq.caches)
                seqs.append(seq)
            else:  # paged: each sample opens its own sequence, sharing the prompt's cached blocks
                seqs.append(None)
        seed = request.params.seed
        for i, seq in enumerate(seqs):
            job.choices.append(Choice(
                job=job, index=i, seq=seq,
                sampler=RowSampler(request.params, seed=None if seed is None else seed + i),
                text=TextStream(self.tokenizer, request.params.stop, job.max_tokens),
                next_input=request.prompt[-1]))
        job.open_choices = len(seqs)
        for choice in job.choices:
            if choice.seq is not None:
                self.running.append(choice)
            else:
                self.prefilling.append(Prefill(job, list(request.prompt), choice))
        if last_logits is not None:
            self._first_tokens([c for c in job.choices if c.seq is not None], last_logits)

    def _first_tokens(self, choices: list[Choice], last_logits: mx.array) -> None:
        """Each of ``choices`` (prompt written, running) samples its first token from ``last_logits`` with its
        own sampler and emits it; the next decode step feeds that token."""
        logits = mx.broadcast_to(last_logits, (len(choices), last_logits.shape[-1]))  # (n, vocab)
        tokens = sample_rows(logits, [c.sampler for c in choices]).tolist()  # (n,)
        now = time.perf_counter()
        for choice, token in zip(choices, tokens):
            choice.fresh = False  # the manager holds the whole prompt: the decode step feeds the new token
            if not choice.job.finished:
                self._emit(choice, token, now)

    # ---- decode --------------------------------------------------------------------------------------------
    def _reserve(self) -> list[Choice]:
        """Paged: slots for every running choice's next input, preempting as needed; returns who decodes."""
        for choice in list(self.running):
            if choice not in self.running or _ends_in_flight(choice):  # preempted meanwhile / nothing to feed
                continue
            if not self._make_room(choice.seq, 1):
                self._land()  # (normally done already: _decode reads in-flight tokens first when blocks are short)
                if choice.done or choice.job.finished:
                    continue
                if len(self.pool) == 1:  # alone and still no room (a safety net: submit caps every request)
                    choice.job.handle.put(Event("token", index=choice.index, finish_reason="length"))
                    self._close_choice(choice, "length")
                else:
                    self._preempt_choice(choice)
                continue
            seq = choice.seq
            if choice.fresh:  # the manager holds this token as the opened tokens' last: allocate its slot
                n = seq.paged.num_tokens
                seq.paged.slots(0, n, n + 1)
            elif choice.in_flight is not None:  # its value is still being computed: named when it is read
                seq.feed([PLACEHOLDER])
                choice.placeholder_at = seq.paged.num_tokens - 1
            else:
                seq.feed([choice.next_input])
            choice.fresh = False
        return [c for c in self.running if not _ends_in_flight(c)]

    def _decode(self) -> None:
        """One decode step for every running choice, overlapped with reading the previous step's tokens.

        The step is built from the previous step's sampled tokens while they are still being computed (fed
        lazily; paged slots taken under a placeholder id) and handed to MLX with ``async_eval``; only then are
        the previous tokens read, named in the manager, and emitted — so building a step's graph overlaps the
        evaluation of the one before (mlx-lm's generation loop does the same; on MLX's CPU backend only partly:
        ``async_eval`` returns once all but the last few dozen operations have run). When blocks are short, the
        previous tokens are read first: a preemption must see every emitted token. A step that computes some
        request's first token (a prompt that joined the decode batch) is read at once: that token goes out now, and
        the next step's graph is built after it.
        """
        if self._in_flight and self.manager is not None and not self._surely_fits():
            self._land()
        choices = self._reserve() if self.manager is not None else [c for c in self.running if not _ends_in_flight(c)]
        if not choices:
            self._land()
            return
        self.totals["decode_steps"] += 1
        self.totals["max_batch"] = max(self.totals["max_batch"], len(choices))
        try:
            logits = self._forward(choices)  # (B, vocab)
            tokens = sample_rows(logits, [c.sampler for c in choices])  # (B,)
            mx.async_eval(tokens)
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: fail the requests in it
            self._land()
            for job in {id(c.job): c.job for c in choices}.values():
                self._fail(job, exc)
            return
        if self._in_flight:
            self.totals["overlapped_steps"] += 1
        self._land()  # the previous step's tokens (named before this step's positions are committed)
        for b, c in enumerate(choices):
            if c.done or c.job.finished:
                continue  # closed by its previous token: this step's token is dropped
            c.seq.commit()
            c.in_flight = (tokens, b)
            self._in_flight.append((c, tokens, b))
        if any(c.job.first_token_at is None for c in choices):
            self._land()  # a request's first token (its last prompt token joined this step): out now, not a step late

    def _surely_fits(self) -> bool:
        """Whether every running choice's next slot fits without preempting (at most one new block per group and
        one copy-on-write block each)."""
        need = len(self.running) * 2 * len(self.manager.specs)
        return self.manager.pool.num_free_blocks >= need

    def _land(self) -> None:
        """Read the last decode step's tokens; name the placeholders the step after it fed them under; emit."""
        if not self._in_flight:
            return
        flights, self._in_flight = self._in_flight, []
        values = {id(t): t.tolist() for _, t, _ in flights}  # one read per step's token array
        now = time.perf_counter()
        for choice, tokens, row in flights:
            token = values[id(tokens)][row]
            choice.in_flight = None
            if choice.done or choice.job.finished:
                continue
            try:
                if choice.placeholder_at is not None:
                    self.manager.set_token(choice.seq.paged.seq_id, choice.placeholder_at, token)
                    choice.placeholder_at = None
                self._emit(choice, token, now)
            except Exception as exc:  # noqa: BLE001
                self._fail(choice.job, exc)

    def _forward(self, choices: list[Choice]) -> mx.array:
        inputs = _decode_inputs(choices)  # (B, 1)
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
        choice.generated.append(token)
        if finish is None:
            choice.next_input = token
            return
        self._close_choice(choice, finish)

    def _close_choice(self, choice: Choice, finish: str) -> None:
        job = choice.job
        choice.done = True
        self.running.remove(choice)
        self._release(choice.seq)
        job.open_choices -= 1
        if job.open_choices == 0:
            usage = Usage(len(job.request.prompt), job.completion_tokens, job.cached_tokens)
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
        self.prefilling = [t for t in self.prefilling if t.job is not job]
        self.preempted = collections.deque(t for t in self.preempted if t.job is not job)
        self.running = [c for c in self.running if c.job is not job]
        for seq in job.opened:
            if seq.id in self.pool:
                self.pool.release(seq.id)
        self.totals[outcome] += 1
        try:
            job.handle.put(event)
        finally:
            usage = Usage(len(job.request.prompt), job.completion_tokens, job.cached_tokens)
            tpot = None
            if job.first_token_at is not None and job.completion_tokens > len(job.choices) >= 1:
                per_choice = job.completion_tokens / len(job.choices)
                tpot = (job.last_token_at - job.first_token_at) / max(per_choice - 1, 1)
            self.observer.on_request_finished(finish_reason or event.finish_reason or outcome, usage, tpot)


def _first_from_prefill(task: Prefill) -> bool:
    """A request's own sequence prefills its whole prompt and samples its first token from the last position's
    logits; a resumed choice or a parallel sample's sequence leaves the last token to its first decode step (it
    already has, or shares, what that token predicts)."""
    return task.choice is None


def _prefill_target(task: Prefill) -> int:
    """Prompt tokens ``task`` writes before decoding (see :func:`_first_from_prefill`)."""
    return len(task.tokens) - (0 if _first_from_prefill(task) else 1)


def _rewind(task: Prefill) -> bool:
    """Bring the task's layer caches back to ``task.done`` after a failed forward (paged: the write position
    only, the slots stay for the retry; dense: an exact trim); False if some layer could not be brought back."""
    try:
        for cache in task.seq.caches:
            if cache.offset > task.done:
                if hasattr(cache, "rewind_to"):
                    cache.rewind_to(task.done)
                else:
                    cache.trim(cache.offset - task.done)
        return all(cache.offset == task.done for cache in task.seq.caches)
    except Exception:  # noqa: BLE001 - a layer without exact trim: the sequence is spoiled
        return False


def _ends_in_flight(choice: Choice) -> bool:
    """Whether the choice's in-flight token is its last by length (no step is spent on what would follow it)."""
    return choice.in_flight is not None and len(choice.generated) + 1 >= choice.job.max_tokens


def _decode_inputs(choices: list[Choice]) -> mx.array:
    """The step's input tokens ``(B, 1)`` uint32: in-flight tokens lazily (without reading them), others as given."""
    flights = [c.in_flight for c in choices]
    first = flights[0]
    if first is not None and first[0].shape[0] == len(choices) and all(
            f is not None and f[0] is first[0] and f[1] == b for b, f in enumerate(flights)):
        return first[0][:, None]  # the whole previous batch, in order
    parts = [f[0][f[1]:f[1] + 1] if f is not None else mx.array([c.next_input], dtype=mx.uint32)
             for c, f in zip(choices, flights)]
    return mx.concatenate(parts)[:, None]
