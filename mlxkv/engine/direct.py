"""DirectEngine: one sequence at a time — open, prefill, step, close — over a CachePool."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from typing import Sequence as Seq

import mlx.core as mx

from mlxkv.engine.output import TextStream
from mlxkv.engine.prefill import prefill
from mlxkv.engine.sampling import SamplingParams, mlx_seed
from mlxkv.kv import CachePool, CacheRequest


#: mlx-lm's logits-processor protocol: ``(tokens so far, logits (1, vocab)) -> logits (1, vocab)``.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class GenerationChunk:
    """One streamed piece of output: new text (may be empty while held back), the token, and why it ended."""

    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length" (max_tokens) | None (running)


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

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_seconds if self.generation_seconds else 0.0


class DirectEngine:
    """Generates for one sequence at a time over a :class:`CachePool`.

    Args:
        model: the mlx-lm model.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (EOS ids and the streaming detokenizer come from it).
        pool: the CachePool to draw sequences from (default: a one-sequence pool over mlxkv's layouts).
        prefill_step_size: prompt tokens per prefill forward.
    """

    def __init__(self, model: Any, tokenizer: Any, *, pool: CachePool | None = None,
                 prefill_step_size: int = 2048):
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool if pool is not None else CachePool(model, max_sequences=1)
        self.prefill_step_size = prefill_step_size
        self.last_stats = GenerationStats()

    def generate_tokens(self, prompt: Seq[int], params: SamplingParams, *, salt: str | bytes | None = None,
                        logits_processors: Seq[LogitsProcessor] = (),
                        should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Yield generated token ids (EOS included when produced), up to ``params.max_tokens``.

        The sequence is opened in the pool on the first ``next`` and released when the generator finishes
        or is closed, whatever happens in between. With a paged pool, a cached prefix of the prompt is not
        recomputed (``salt`` isolates caches: different salts never share blocks).

        ``logits_processors`` (mlx-lm's protocol, e.g. a structured-output constraint) map ``(tokens, logits)``
        to logits before sampling, ``tokens`` being the prompt and the tokens generated so far. With any, each
        step reads its token back before the next step's logits are processed (the forward still runs while
        they are), so the processors see every token. ``should_stop`` (e.g. Ctrl-C) is checked between prefill
        chunks (:func:`mlxkv.engine.prefill.prefill` raises ``PrefillStopped``).
        """
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if params.seed is not None:
            mx.random.seed(mlx_seed(params.seed))
        sampler = params.make_sampler()
        processors = _Processors(prompt, logits_processors) if logits_processors else None
        stats = GenerationStats(prompt_tokens=len(prompt))
        self.last_stats = stats
        mx.reset_peak_memory()
        seq = self.pool.open(prompt_length=len(prompt), prompt=list(prompt), cache_request=CacheRequest(salt=salt))
        # Paged: one pool array per layer holds every sequence's K/V, so step n must finish before step n+1's
        # write is scheduled (else MLX copies the whole pool); decode tokens are fed to the block manager.
        paged = self.pool.is_paged
        try:
            caches = seq.caches

            def pick(logits: mx.array) -> mx.array:  # (1, vocab) -> (1,)
                return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

            def step(token: mx.array) -> mx.array:
                return pick(self.model(token.reshape(1, 1), cache=caches)[:, -1, :])  # (1,)

            start = time.perf_counter()
            cached = stats.cached_prompt_tokens = seq.num_cached  # < len(prompt): the last token is recomputed
            logits = prefill(self.model, caches, mx.array(prompt[cached:], dtype=mx.uint32),
                             step_size=self.prefill_step_size, seq=seq, start=cached,
                             should_stop=should_stop)[None]  # (1, vocab)
            if processors:
                logits = processors.process(logits)
            y = pick(logits)  # (1,)
            mx.eval(y)
            seq.commit()
            stats.prompt_seconds = time.perf_counter() - start
            start = time.perf_counter()
            for n in range(params.max_tokens):
                more = n + 1 < params.max_tokens
                if processors:
                    token, next_y = y.item(), None
                    if more:
                        if paged:
                            seq.feed([token])
                        logits = self.model(y.reshape(1, 1), cache=caches)[:, -1, :]  # (1, vocab)
                        mx.async_eval(logits)  # the forward runs while the processors work on the CPU
                        if paged:
                            seq.commit()
                        next_y = pick(processors.process(logits, token))
                elif paged:
                    token, next_y = y.item(), None
                    if more:
                        seq.feed([token])  # slots for the token the next step appends
                        next_y = step(y)
                        mx.async_eval(next_y)
                        seq.commit()
                else:
                    # Build the next step's graph while this token computes, but schedule it only after
                    # reading the token: MLX decides at scheduling time whether the K/V write can reuse the
                    # buffer, and the running step's attention still holds it (see mlxkv.kv.layouts docs).
                    next_y = step(y) if more else None
                    token = y.item()
                    if next_y is not None:
                        mx.async_eval(next_y)
                stats.generation_tokens += 1
                stats.generation_seconds = time.perf_counter() - start
                yield token
                y = next_y
        finally:
            stats.kv_bytes = self.pool.memory_usage_bytes()
            stats.peak_memory_bytes = mx.get_peak_memory()
            self.pool.release(seq.id)

    def generate(self, prompt: Seq[int], params: SamplingParams, *, logits_processors: Seq[LogitsProcessor] = (),
                 should_stop: Callable[[], bool] | None = None) -> Iterator[GenerationChunk]:
        """Stream text for ``prompt``; stops on EOS, on a stop string, after ``max_tokens``, or when
        ``should_stop`` turns true (checked between prefill chunks and before each token is shown).

        The final chunk carries ``finish_reason``; stop strings are never emitted, even in part.
        ``logits_processors``: as in :meth:`generate_tokens`.
        """
        stream = TextStream(self.tokenizer, params.stop, params.max_tokens)
        tokens = self.generate_tokens(prompt, params, logits_processors=logits_processors, should_stop=should_stop)
        try:
            for token in tokens:
                if should_stop is not None and should_stop():
                    return
                text, finish = stream.feed(token)
                yield GenerationChunk(text, token, finish)
                if finish is not None:
                    return
        finally:
            tokens.close()  # releases the sequence even when the consumer stops early


class _Processors:
    """Logits processors of one generation and the token history they are shown (prompt, then each token)."""

    def __init__(self, prompt: Seq[int], processors: Seq[LogitsProcessor]):
        self.history = list(prompt)
        self.processors = tuple(processors)

    def process(self, logits: mx.array, token: int | None = None) -> mx.array:
        """``logits`` (1, vocab) after every processor; ``token`` is the one sampled since the last call."""
        if token is not None:
            self.history.append(token)
        tokens = mx.array(self.history, dtype=mx.uint32)  # (L,)
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits
