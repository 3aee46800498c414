"""DirectEngine: one sequence at a time — open, prefill, step, close — over a CachePool."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from typing import Sequence as Seq

import mlx.core as mx

from mlxkv.engine.jobs import Job
from mlxkv.engine.output import Event, TextStream, TokenLogprob
from mlxkv.engine.prefill import INTERRUPTIBLE_CHUNK_SECONDS, INTERRUPTIBLE_FIRST_CHUNK, PrefillStopped
from mlxkv.engine.request import GenerationRequest, RequestHandle
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculation import Speculation, check_pool
from mlxkv.kv import CachePool, Sequence
from mlxkv.structured.response_format import ResponseFormat


#: mlx-lm's logits-processor protocol: ``(tokens so far, logits (1, vocab)) -> logits (1, vocab)``.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class GenerationChunk:
    """One streamed piece of output: new text (may be empty while held back), the token, and why it ended."""

    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length" (max_tokens) | None (running)
    logprob: TokenLogprob | None = None  # when the generation was asked for log-probabilities


@dataclass
class GenerationStats:
    """Figures of the last generation, for ``--verbose``."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_tokens: int = 0
    generation_seconds: float = 0.0
    peak_memory_bytes: int = 0
    kv_bytes: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache (paged backend)
    speculative: bool = False  # the generation speculated: the figures below are its
    drafted_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, verified and kept
    decoded_tokens: int = 0  # tokens the decode forwards committed (every generated token but the first)
    target_forwards: int = 0  # decode forwards of the model (verification forwards included)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens committed per decode forward (1.0 is plain decoding; prefill not counted)."""
        return self.decoded_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_seconds if self.generation_seconds else 0.0


class DirectEngine:
    """Generates for one sequence at a time over a :class:`CachePool`, on the engine step ``mlxkv serve`` runs.

    Each generation is one request to a :class:`~mlxkv.engine.scheduler.Scheduler` of one sequence, stepped in the
    caller's thread: the same plan, execute and update as the batch engine (prefill chunks, the decode loop with
    its tokens in flight, row samplers, grammar masks, text and stop strings), so a prompt gives the same tokens
    through ``mlxkv generate`` and ``mlxkv serve``.

    Args:
        model: the mlx-lm model.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (EOS ids and the streaming detokenizer come from it; ``None``:
            tokens only, no EOS).
        pool: the CachePool to draw sequences from (default: a one-sequence pool over mlxkv's layouts).
        prefill_step_size: prompt tokens per prefill forward.
        speculation: speculative decoding on the step (prompt lookup, or a draft model's rows), as ``mlxkv serve``
            runs it (:mod:`mlxkv.engine.speculation`; None: off). Every generation then speculates: one that could not
            (see :func:`refusal_of_speculation`) is refused.

    Raises:
        ValueError: ``speculation`` over a KV store it cannot rewind exactly (sliding-window, chunked or recurrent
            layers, an overflow policy).
    """

    def __init__(self, model: Any, tokenizer: Any, *, pool: CachePool | None = None,
                 prefill_step_size: int = 2048, speculation: Speculation | None = None):
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool if pool is not None else CachePool(model, max_sequences=1)
        self.prefill_step_size = prefill_step_size
        if speculation is not None:
            check_pool(self.pool)
        self.speculation = speculation
        self.last_stats = GenerationStats()
        self.last_logprobs: list[TokenLogprob] = []  # of the last generation asked for them
        self.last_generated: list[int] = []  # every token the last generation produced, read by its consumer or not
        self._scheduler: Any = None  # made at the first generation (the speculative subclass never needs one)

    @property
    def scheduler(self) -> Any:
        """The one-sequence scheduler generations run on (made on first use)."""
        if self._scheduler is None:
            from mlxkv.engine.scheduler import Scheduler

            self._scheduler = Scheduler(self.model, self.tokenizer, self.pool, max_sequences=1,
                                        prefill_chunk_size=self.prefill_step_size, batched=False,
                                        speculation=self.speculation, last_token_alone=True)
        return self._scheduler

    def generate_tokens(self, prompt: Seq[int], params: SamplingParams, *, salt: str | bytes | None = None,
                        logits_processors: Seq[LogitsProcessor] = (),
                        response_format: ResponseFormat | None = None,
                        should_stop: Callable[[], bool] | None = None, logprobs: int | None = None,
                        sequence: Sequence | None = None, media: Seq[Any] = ()) -> Iterator[int]:
        """Yield generated token ids (EOS included when produced), up to ``params.max_tokens``; stop strings are
        left to the caller (:meth:`generate` applies them). With ``logprobs`` (0-20), each token's log-probability
        and that many alternatives are appended to :attr:`last_logprobs` as it is yielded.

        The sequence is opened in the pool when the generator starts and released when it finishes or is
        closed, whatever happens in between. With a paged pool, a cached prefix of the prompt is not recomputed
        (``salt`` isolates caches: different salts never share blocks).

        ``logits_processors`` (mlx-lm's protocol) map ``(tokens, logits)`` to logits before sampling, ``tokens``
        being the prompt and the tokens generated so far, after the penalties and logit bias ``params`` turn on.
        ``response_format`` constrains the output to its grammar (the engine's grammar masks, as in serve).
        ``should_stop`` (e.g. Ctrl-C) is checked between engine steps; the prompt is then prefilled in chunks sized
        to take about :data:`~mlxkv.engine.prefill.INTERRUPTIBLE_CHUNK_SECONDS` each, so a stop is seen quickly.

        ``sequence``: an open sequence of this engine's dense pool whose caches hold the prompt's first
        ``sequence.offset`` tokens (fewer than the whole prompt): the generation continues it, prefilling only the
        rest, and leaves it open. Its caches then hold ``(prompt + last_generated)[:sequence.offset]`` — the
        prompt (as far as it was prefilled) and the generated tokens fed back, which may stop short of the last.

        With :attr:`speculation`, every decode step proposes tokens (by prompt lookup over the prompt and the tokens
        generated, or from the draft model) and verifies them in one forward: the same greedy tokens, the same
        distribution when sampling; :attr:`last_stats` then holds the acceptance figures.

        Raises:
            PrefillStopped: ``should_stop`` turned true before the first token.
            ValueError: an empty prompt; a ``sequence`` not open in this dense pool, or caching the whole prompt;
                with :attr:`speculation`, a generation that could not speculate (:func:`refusal_of_speculation`).
        """
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.speculation is not None:
            refusal = refusal_of_speculation(params, logits_processors, response_format, logprobs,
                                             speculation_flag(self.speculation))
            if refusal is not None:
                raise ValueError(refusal)
        if sequence is not None:
            _check_continued(self.pool, sequence, len(prompt))
        salt = salt.hex() if isinstance(salt, bytes) else salt
        request = GenerationRequest(prompt=list(prompt), params=dataclasses.replace(params, stop=()),
                                    cache_salt=salt or None, response_format=response_format,
                                    logits_processors=tuple(logits_processors), logprobs=logprobs,
                                    media=tuple(media))
        self.last_logprobs = []
        for event in self._run(request, should_stop, sequence):
            if event.kind == "token":
                if event.logprob is not None:
                    self.last_logprobs.append(event.logprob)
                yield event.token

    def _run(self, request: GenerationRequest, should_stop: Callable[[], bool] | None = None,
             sequence: Sequence | None = None) -> Iterator[Event]:
        """Step the scheduler for ``request`` until it ends (or ``should_stop`` turns true), yielding its events as
        they come; its sequence is released however the consumer stops (a continued ``sequence`` stays open)."""
        sched = self.scheduler
        chunks = _InterruptibleChunks(sched, self.prefill_step_size) if should_stop is not None else None
        stats = GenerationStats(prompt_tokens=len(request.prompt), speculative=self.speculation is not None)
        self.last_stats = stats
        decode_steps = sched.totals["decode_steps"]
        mx.reset_peak_memory()
        handle = RequestHandle(request)
        job = Job(request=request, handle=handle, max_tokens=request.params.max_tokens, sequence=sequence)
        self.last_generated = []
        sched.add(job)
        start = time.perf_counter()
        try:
            while True:
                if job.finished and not sched.has_work() and handle.empty():
                    break
                if not handle.empty():
                    event = handle.get()
                    if event.kind == "token":
                        self._count(stats, start)
                    elif event.kind == "error":
                        raise _error_of(event)
                    yield event
                    continue
                if should_stop is not None and should_stop():
                    if stats.generation_tokens == 0:
                        raise PrefillStopped(chunks.done(job))
                    return
                if sched.has_work():
                    if chunks is None:
                        sched.step()
                    else:
                        chunks.step(job)
                    stats.kv_bytes = max(stats.kv_bytes, self.pool.memory_usage_bytes())
        finally:
            if chunks is not None:
                sched.prefill_chunk_size = self.prefill_step_size
            if not job.finished:  # the consumer stopped early (a stop string, Ctrl-C): end it, release its sequence
                sched.end_all(Event("error", finish_reason="cancelled", message="the request was cancelled"),
                              "cancelled")
                sched.decode_loop.in_flight.clear()
            stats.cached_prompt_tokens = job.cached_tokens
            self.last_generated = list(job.choices[0].generated) if job.choices else []
            stats.drafted_tokens, stats.accepted_tokens = job.draft_tokens, job.accepted_draft_tokens
            stats.decoded_tokens = max(0, len(self.last_generated) - 1)
            stats.target_forwards = sched.totals["decode_steps"] - decode_steps
            stats.peak_memory_bytes = mx.get_peak_memory()

    @staticmethod
    def _count(stats: GenerationStats, start: float) -> None:
        """A token reached the consumer: the prompt phase ends at the first, the generation phase runs from it."""
        now = time.perf_counter()
        if stats.generation_tokens == 0:
            stats.prompt_seconds = now - start
        stats.generation_tokens += 1
        stats.generation_seconds = now - start - stats.prompt_seconds

    def generate(self, prompt: Seq[int], params: SamplingParams, *,
                 logits_processors: Seq[LogitsProcessor] = (),
                 response_format: ResponseFormat | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 logprobs: int | None = None, primer: Seq[int] = (), media: Seq[Any] = ()
                 ) -> Iterator[GenerationChunk]:
        """Stream text for ``prompt``; stops on EOS, on a stop string, after ``max_tokens``, or when
        ``should_stop`` turns true (checked between engine steps and before each token is shown).

        The final chunk carries ``finish_reason``; stop strings are never emitted, even in part.
        ``logits_processors``, ``response_format``, ``logprobs``: as in :meth:`generate_tokens` (each chunk then
        carries its token's log-probability). ``primer``: the prompt's last tokens, a response the caller
        prefilled and has shown already: the text continues theirs. ``media``: the prompt's images
        (:class:`mlxkv.vision.spans.ImageSpan`).
        """
        stream = TextStream(self.tokenizer, params.stop, params.max_tokens)
        stream.prime(primer)
        extra: dict[str, Any] = {"response_format": response_format} if response_format is not None else {}
        if logprobs is not None:
            extra["logprobs"] = logprobs
        if media:
            extra["media"] = media
        tokens = self.generate_tokens(prompt, params, logits_processors=logits_processors, should_stop=should_stop,
                                      **extra)
        try:
            for token in tokens:
                if should_stop is not None and should_stop():
                    return
                text, finish = stream.feed(token)
                yield GenerationChunk(text, token, finish, self.last_logprobs[-1] if logprobs is not None else None)
                if finish is not None:
                    return
        finally:
            tokens.close()  # releases the sequence even when the consumer stops early


class _InterruptibleChunks:
    """Steps a scheduler with its prefill chunks sized to take about ``INTERRUPTIBLE_CHUNK_SECONDS`` each (the
    first ``INTERRUPTIBLE_FIRST_CHUNK`` tokens, then from the rate measured), at most ``step_size``."""

    def __init__(self, scheduler: Any, step_size: int):
        self.scheduler = scheduler
        self.step_size = step_size
        scheduler.prefill_chunk_size = min(step_size, INTERRUPTIBLE_FIRST_CHUNK)

    def done(self, job: Job) -> int:
        """Prompt tokens of ``job`` in its cache (0 before its sequence opened)."""
        task = next((t for t in self.scheduler.prefilling if t.job is job), None)
        return task.done if task is not None else 0

    def step(self, job: Job) -> None:
        before, began = self.done(job), time.perf_counter()
        self.scheduler.step()
        ran = self.done(job) - before
        if ran > 0:
            rate = ran / max(time.perf_counter() - began, 1e-6)
            self.scheduler.prefill_chunk_size = max(1, min(self.step_size, int(rate * INTERRUPTIBLE_CHUNK_SECONDS)))


def speculation_flag(speculation: Speculation) -> str:
    """The option that turned ``speculation`` on: ``--draft-model`` or ``--prompt-lookup`` (for messages)."""
    return "--prompt-lookup" if speculation.draft is None else "--draft-model"


def refusal_of_speculation(params: SamplingParams, logits_processors: Seq[LogitsProcessor] = (),
                           response_format: ResponseFormat | None = None, logprobs: int | None = None,
                           flag: str = "--prompt-lookup") -> str | None:
    """Why a generation with these settings could not speculate on the engine step (None: it can). The step
    decodes such rows one token at a time (:func:`~mlxkv.engine.speculation.may_speculate`): a one-sequence
    engine refuses them rather than drop the speculation it was asked for. ``flag``: the option that asked for
    speculation (:func:`speculation_flag`), named in the message."""
    if logits_processors:  # a caller's own processors may keep state a proposed position would corrupt
        return f"logits processors of the caller's own do not work with speculative decoding ({flag})"
    if logprobs is not None:
        return f"--logprobs does not work with speculative decoding ({flag})"
    if params.temp > 0 and params.seed is not None:
        return ("a seeded sampled answer (--seed at --temp above 0) draws from its own random stream one token at a "
                f"time: it does not work with speculative decoding ({flag})")
    return None


def _check_continued(pool: CachePool, seq: Sequence, prompt_length: int) -> None:
    """Refuse a sequence a generation cannot continue: not open in ``pool``, paged (its blocks are registered
    over its own prompt), or caching the whole prompt (the last prompt token must run for the first logits)."""
    if pool.is_paged:
        raise ValueError("continuing an open sequence needs a dense pool (a paged one reuses prompts by prefix "
                         "caching)")
    if seq.id not in pool or seq.preempted:
        raise ValueError(f"{seq.id} is not open in this engine's pool")
    if seq.offset >= prompt_length:
        raise ValueError(f"{seq.id} caches {seq.offset} tokens: the prompt must extend them ({prompt_length} tokens)")


def _error_of(event: Event) -> Exception:
    """The exception a failed generation raises in the consumer: the engine's message, as ``ValueError`` when the
    request was refused (a bad input), else ``RuntimeError``."""
    kind, _, message = event.message.partition(": ")
    if kind == "ValueError":
        return ValueError(message)
    return RuntimeError(event.message)
