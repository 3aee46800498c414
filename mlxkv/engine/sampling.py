"""Sampling parameters for one request, validated, and the one chain of filters every sampler applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx


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
    """

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

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
        mlx-lm's ``make_sampler`` builds)."""
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
