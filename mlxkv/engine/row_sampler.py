"""Per-sequence token samplers for a batch: each row keeps its own random stream, logits processors and token
history, and records log-probabilities when its request asked for them.

``DirectEngine`` seeds MLX's global generator; a batch holds many requests with different seeds, so each
seeded sequence carries its own PRNG key instead. ``key, sub = split(key)`` per draw is exactly what the
global generator does after ``mx.random.seed(seed)``, so a seeded request samples the same tokens here as
through ``DirectEngine`` (tested). Unseeded sequences draw from the global generator.

**Logits processors** (the hook): each row applies its list of processors ``(tokens_so_far, logits (1, vocab))
-> logits`` — mlx-lm's ``LogitsProcessor`` signature, and its ``make_logits_processors`` builds the penalties and
the logit bias — to its raw logits, then normalizes and runs the filter chain. ``tokens_so_far`` is the prompt
followed by every token this row has sampled, the newest included, as mlx-lm's ``generate_step`` passes it. The
decode loop builds step n+1 while step n's tokens are still being computed, so the history's last entry is
usually a lazy array: a processor that only does array arithmetic with it (penalties, bias) keeps the overlap.
A processor that needs the concrete previous token in Python (a grammar matcher advancing its state, say) must
read it (``int(tokens[-1].item())``), which waits for the previous step to finish: a sync per step for the rows
that have one, the others unaffected. Add such a processor with :meth:`RowSampler.add_processor` before the
row's first draw (its history then starts with the prompt).

**Verification rows** (speculative decoding) score ``k + 1`` positions at once:
:meth:`RowSampler.position_logprobs` applies the processors at position ``i`` with the history extended by the
first ``i`` draft tokens — what plain decoding would have seen — and :meth:`RowSampler.accept` extends the history
by the committed tokens. Only processors that depend on the history alone (the params' penalties and bias) can be
evaluated ahead like this; a caller's processor may keep state, so its row decodes one token at a time.

Rows that are greedy, have no processor and record no log-probabilities take the batch's one ``argmax`` (no work
of their own).

**Grammar masks** are not processors: the engine advances a row's grammar with each token it emits and hands
:func:`sample_rows` the rows' next-token bitmasks, applied to all masked rows in one operation
(:mod:`mlxkv.engine.constraints`); the plain rows keep their shared ``argmax``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxkv.engine.logprobs import LogprobRecorder
from mlxkv.engine.output import TokenLogprob
from mlxkv.engine.sampling import LogitsProcessor, SamplingParams, mlx_seed
from mlxkv.structured.constraint import apply_words


class RowSampler:
    """Samples one sequence's next token from its ``(1, vocab)`` logits.

    Args:
        params: the request's sampling settings (its penalties and logit bias become processors).
        seed: PRNG seed for this sequence (``None``: MLX's global generator).
        prompt: the sequence's prompt tokens, the start of the history processors see.
        logprobs: record each draw's log-probability and this many alternatives (``None``: record nothing).
    """

    def __init__(self, params: SamplingParams, seed: int | None = None, *, prompt: Sequence[int] = (),
                 logprobs: int | None = None):
        self.params = params
        self.greedy = params.temp == 0
        self._temp = params.temp
        self._filters = params.filters()
        self._key = mx.random.key(mlx_seed(seed)) if seed is not None and not self.greedy else None
        self._prompt = list(prompt)
        self._processors: list[LogitsProcessor] = []
        self._callers = 0  # processors added by the caller (not the params'): may hold state of their own
        self._history: Any = None  # mlx-lm's TokenBuffer: prompt + sampled tokens, made with the first processor
        self._recorder = LogprobRecorder(logprobs) if logprobs is not None else None
        for processor in params.processors():
            self.add_processor(processor, history_only=True)

    @classmethod
    def for_choice(cls, request: Any, index: int) -> "RowSampler":
        """The sampler of choice ``index`` of a :class:`~mlxkv.engine.request.GenerationRequest` (seed
        ``seed + index``, so parallel samples differ and each is reproducible)."""
        seed = request.params.seed
        return cls(request.params, seed=None if seed is None else seed + index, prompt=request.prompt,
                   logprobs=request.logprobs)

    @property
    def processors(self) -> tuple[LogitsProcessor, ...]:
        """The logits processors this row applies (penalties, logit bias, the caller's own)."""
        return tuple(self._processors)

    @property
    def plain(self) -> bool:
        """Greedy with no processor and no log-probabilities: the batch's shared ``argmax`` serves it."""
        return self.greedy and not self._processors and self._recorder is None

    @property
    def history_only(self) -> bool:
        """Whether every processor is a function of the token history alone (the params' penalties and logit bias),
        so :meth:`position_logprobs` can apply them at positions not decoded yet."""
        return self._callers == 0

    def add_processor(self, processor: LogitsProcessor, *, history_only: bool = False) -> None:
        """Apply ``processor`` to this row's logits from the next draw on, after those added before it.
        ``history_only``: it keeps no state of its own (its output depends on the history and logits only)."""
        if self._history is None:
            from mlx_lm.models.cache import TokenBuffer

            self._history = TokenBuffer(self._prompt)
        self._processors.append(processor)
        self._callers += not history_only

    def position_logprobs(self, logits: mx.array, draft: Sequence[int]) -> mx.array:
        """The log-probabilities this row would draw from at each position of a verification row: ``logits``
        ``(k + 1, vocab)`` follow its last token and each of the ``k`` ``draft`` tokens; position ``i`` gets the
        processors applied with the history extended by ``draft[:i]`` — what a plain decode step would see had it
        emitted those tokens — then normalized as :meth:`__call__` does. Returns ``(k + 1, vocab)`` (lazy).

        Raises:
            ValueError: a processor keeps state of its own (:attr:`history_only` is false).
        """
        assert logits.shape[0] == len(draft) + 1, (logits.shape, len(draft))
        if not self._processors:
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (k + 1, vocab)
        if not self.history_only:
            raise ValueError("a caller's logits processor cannot be applied ahead of the tokens it has seen")
        history = mx.concatenate([self._history.tokens, mx.array(list(draft), dtype=mx.int32)])  # (T + k,)
        start = history.shape[0] - len(draft)
        rows = []
        for i in range(len(draft) + 1):
            row = logits[i : i + 1]  # (1, vocab)
            seen = history[: start + i]
            for process in self._processors:
                row = process(seen, row)
            rows.append(row - mx.logsumexp(row, axis=-1, keepdims=True))
        return mx.concatenate(rows)  # (k + 1, vocab)

    def accept(self, tokens: Sequence[int]) -> None:
        """``tokens`` were committed after a verification row scored by :meth:`position_logprobs`: the history
        the processors see goes on with them."""
        if self._processors and tokens:
            self._history.update_and_fetch(mx.array(list(tokens), dtype=mx.int32))

    def __call__(self, logits: mx.array, logprobs: mx.array | None = None, *, masked: bool = False) -> mx.array:
        """The sampled token ``(1,)`` (lazy) from this row's ``logits`` ``(1, vocab)``; ``logprobs`` is their
        ``log_softmax`` when the caller has it already. ``masked``: ``logits`` carry a grammar's ``-inf`` where
        tokens are forbidden and ``logprobs`` are the model's own (recorded as they are; the draw is from the
        masked logits)."""
        if logprobs is None:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (1, vocab)
        scores = logprobs
        if self._processors:
            history = self._history.tokens  # (T,) int32, possibly lazy
            for process in self._processors:
                logits = process(history, logits)
        if self._processors or masked:
            scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (1, vocab)
        token = self._draw(scores)  # (1,)
        if self._processors:
            self._history.update_and_fetch(token)
        if self._recorder is not None:
            self._recorder.record(logprobs, token)
        return token

    def _draw(self, logprobs: mx.array) -> mx.array:
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)  # (1,)
        for apply in self._filters:
            logprobs = apply(logprobs)
        if self._key is None:
            return mx.random.categorical(logprobs * (1 / self._temp))  # (1,)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / self._temp), key=sub)  # (1,)

    def lazy_outputs(self) -> tuple[mx.array, ...]:
        """Arrays of the last draw besides the token that should be evaluated with it (its log-probabilities)."""
        return self._recorder.last_arrays() if self._recorder is not None else ()

    def pop_logprob(self, token: int) -> TokenLogprob | None:
        """The log-probability record of the oldest draw not emitted yet (``token`` is its value); ``None`` when
        this row records none."""
        return self._recorder.pop(token) if self._recorder is not None else None


def sample_rows(logits: mx.array, samplers: list[RowSampler],
                masks: Sequence[np.ndarray | None] | None = None,
                failed: dict[int, BaseException] | None = None) -> mx.array:
    """Next token of every row of ``logits`` (B, vocab) with its own sampler; returns (B,) uint32 (lazy).

    ``masks[i]`` (``None``: row ``i`` is free) is the allowed-next-token bitmask of row ``i``'s grammar, as uint32
    words (:meth:`~mlxkv.structured.constraint.TokenConstraint.words`): the masked rows' logits get ``-inf`` on
    forbidden tokens in one operation before their samplers draw. Plain rows (greedy, nothing of their own) share
    one ``argmax`` of the batch whatever the other rows do.

    If a sampler raises, MLX's global generator is reseeded before the error propagates: mlx-lm's filters are
    compiled with the generator's state as input and output, and an exception while one is traced leaves that state
    a placeholder, so every later random draw in the process would fail ("eval an array without a primitive").
    With ``failed`` given, a row whose sampler raises is recorded there (row -> exception, its token a placeholder
    0) and the other rows are drawn as usual: one request's bad settings end that request only."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, vocab)
    masked = [i for i, m in enumerate(masks or ()) if m is not None]
    if not masked and all(s.plain for s in samplers):
        return mx.argmax(logprobs, axis=-1).astype(mx.uint32)  # (B,)
    rows_of: dict[int, mx.array] = {}
    if masked:
        words = mx.array(np.stack([masks[i] for i in masked]))  # (M, ceil(vocab / 32)) uint32
        allowed = apply_words(logits[mx.array(masked)], words)  # (M, vocab)
        rows_of = {i: allowed[j : j + 1] for j, i in enumerate(masked)}
    own = [i for i, s in enumerate(samplers) if i in rows_of or not s.plain]
    drawn = []  # len(own) x (1,)
    for i in own:
        try:
            drawn.append(samplers[i](rows_of.get(i, logits[i : i + 1]), logprobs[i : i + 1], masked=i in rows_of)
                         .astype(mx.uint32))
        except Exception as exc:
            mx.random.seed(int.from_bytes(os.urandom(8), "little"))
            if failed is None:
                raise
            failed[i] = exc
            drawn.append(mx.zeros((1,), dtype=mx.uint32))
    if len(own) == len(samplers):
        return mx.concatenate(drawn)  # (B,)
    tokens = mx.argmax(logprobs, axis=-1).astype(mx.uint32)  # (B,): the plain rows' shared argmax
    tokens[mx.array(own)] = mx.concatenate(drawn)  # the other rows' own draws
    return tokens


def lazy_outputs(samplers: Sequence[RowSampler]) -> list[mx.array]:
    """Every array besides the tokens that the samplers' last draws made (evaluate them together)."""
    return [a for s in samplers for a in s.lazy_outputs()]
