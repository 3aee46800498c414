"""Sampling parameters for one request, validated; the one chain of filters every sampler applies, and the logits
processors (penalties, logit bias) the batch engine's row samplers apply before it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import math

import mlx.core as mx

#: ``(tokens_so_far (T,), logits (1, vocab)) -> logits (1, vocab)``: mlx-lm's ``LogitsProcessor`` signature.
#: ``tokens_so_far`` is the prompt then every token sampled so far, possibly still lazy (see
#: :mod:`mlxkv.engine.row_sampler`).
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
#: OpenAI's ranges: presence and frequency penalties in [-2, 2], logit bias values in [-100, 100].
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0
#: Tokens of history mlx-lm's penalties look at by default (mlx_lm.server's ``*_context_size`` default).
DEFAULT_PENALTY_CONTEXT = 20
#: The widest penalty window: MLX slices the token history with 32-bit indices.
MAX_PENALTY_CONTEXT = 2**31 - 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temp: temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens below ``min_p`` x the top token's probability, in [0, 1); 0 disables it.
        seed: seeds MLX's random generator for reproducible sampling (``None``: not seeded); any integer
            (taken modulo 2**64, see :func:`mlx_seed`).
        stop: strings that end generation; the stop string itself is not emitted.
        presence_penalty: subtracted from the logit of every token present in the last
            ``presence_context_size`` tokens (prompt included, as mlx-lm counts), in [-2, 2]; 0 disables it.
        frequency_penalty: subtracted once per occurrence in the last ``frequency_context_size`` tokens, in
            [-2, 2]; 0 disables it.
        repetition_penalty: sign-aware multiplicative penalty (> 0; CTRL's) over the last
            ``repetition_context_size`` tokens; ``None`` or 1 disables it.
        presence_context_size, frequency_context_size, repetition_context_size: the penalties' windows (>= 1, at
            most ``MAX_PENALTY_CONTEXT``).
        logit_bias: token id -> value in [-100, 100] added to its logit before sampling.
    """

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    presence_context_size: int = DEFAULT_PENALTY_CONTEXT
    frequency_context_size: int = DEFAULT_PENALTY_CONTEXT
    repetition_context_size: int = DEFAULT_PENALTY_CONTEXT
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        self.stop = tuple(s for s in self.stop if s)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_context_size", "frequency_context_size", "repetition_context_size"):
            if not 1 <= getattr(self, name) <= MAX_PENALTY_CONTEXT:
                raise ValueError(f"{name} must be in [1, {MAX_PENALTY_CONTEXT}], got {getattr(self, name)}")
        for token, value in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")

    @property
    def has_processors(self) -> bool:
        """Whether :meth:`processors` is not empty (a penalty or a logit bias is on)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty not in (None, 1.0))

    def processors(self) -> list[LogitsProcessor]:
        """The logits processors these settings turn on, built by mlx-lm's ``make_logits_processors`` (logit bias,
        then repetition, presence and frequency penalties: mlx_lm.server's order and windows). Empty when none is
        on; a repetition penalty of 1 changes nothing and is left out."""
        if not self.has_processors:
            return []
        from mlx_lm.sample_utils import make_logits_processors

        repetition = None if self.repetition_penalty == 1.0 else self.repetition_penalty
        return make_logits_processors(
            logit_bias=self.logit_bias or None,
            repetition_penalty=repetition, repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty or None, presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty or None, frequency_context_size=self.frequency_context_size)

    def filters(self) -> list[Callable[[mx.array], mx.array]]:
        """The log-probability filters these settings turn on, in the order mlx-lm's ``make_sampler`` applies
        them (top-p, min-p, top-k): the one chain every sampling path uses (direct, batch rows, speculative
        verification). Each maps ``(.., vocab)`` log-probabilities to the same shape, ``-inf`` where filtered."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_p

        chain: list[Callable[[mx.array], mx.array]] = []
        if 0 < self.top_p < 1.0:
            chain.append(lambda lp: apply_top_p(lp, self.top_p))
        if self.min_p != 0.0:
            chain.append(lambda lp: apply_min_p(lp, self.min_p, 1))
        if self.top_k > 0:
            chain.append(lambda lp: top_k_filter(lp, self.top_k))
        return chain

    def make_sampler(self) -> Callable[[mx.array], mx.array]:
        """A sampler ``(.., vocab) log-probabilities -> (..,) tokens`` drawing from MLX's global generator:
        argmax when ``temp == 0``, else :meth:`filters` then a categorical draw at temperature ``temp`` (what
        mlx-lm's ``make_sampler`` builds).

        Raises:
            ValueError: a penalty or logit bias is set: those need the token history that only the batch engine's
                :class:`~mlxkv.engine.row_sampler.RowSampler` keeps.
        """
        if self.has_processors:
            raise ValueError("penalties and logit_bias are applied by the batch engine (mlxkv serve) only")
        if self.temp == 0:
            return lambda lp: mx.argmax(lp, axis=-1)
        chain, inverse_temp = self.filters(), 1 / self.temp

        def sample(lp: mx.array) -> mx.array:
            for apply in chain:
                lp = apply(lp)
            return mx.random.categorical(lp * inverse_temp)

        return sample


def mlx_seed(seed: int) -> int:
    """Any integer seed as MLX's generator takes it (an unsigned 64-bit value: ``-1`` is ``2**64 - 1``); MLX's
    ``random.seed`` and ``random.key`` reject negative and larger values with a ``TypeError``."""
    return seed % (1 << 64)


def top_k_filter(logprobs: mx.array, top_k: int) -> mx.array:
    """mlx-lm's ``apply_top_k`` on ``(.., vocab)`` log-probabilities; unchanged when ``top_k`` keeps every token.

    mlx-lm's ``apply_top_k`` raises for k >= the vocabulary, inside a function compiled with MLX's random state
    as input and output, and that error leaves the state unusable: every later random draw in the process fails.
    """
    from mlx_lm.sample_utils import apply_top_k

    return apply_top_k(logprobs, top_k) if top_k < logprobs.shape[-1] else logprobs
