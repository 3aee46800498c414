"""Per-sequence token samplers for a batch: each row keeps its own random stream.

``DirectEngine`` seeds MLX's global generator; a batch holds many requests with different seeds, so each
seeded sequence carries its own PRNG key instead. ``key, sub = split(key)`` per draw is exactly what the
global generator does after ``mx.random.seed(seed)``, so a seeded request samples the same tokens here as
through ``DirectEngine`` (tested). Unseeded sequences draw from the global generator.
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlxkv.engine.sampling import SamplingParams, mlx_seed


class RowSampler:
    """Samples one sequence's next token from its ``(1, vocab)`` log-probabilities.

    Args:
        params: the request's sampling settings.
        seed: PRNG seed for this sequence (``None``: MLX's global generator).
    """

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.greedy = params.temp == 0
        self._temp = params.temp
        self._filters = params.filters()
        self._key = mx.random.key(mlx_seed(seed)) if seed is not None and not self.greedy else None

    def __call__(self, logprobs: mx.array) -> mx.array:
        """The sampled token, shape ``(1,)`` (lazy)."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)  # (1,)
        for apply in self._filters:
            logprobs = apply(logprobs)
        if self._key is None:
            return mx.random.categorical(logprobs * (1 / self._temp))  # (1,)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / self._temp), key=sub)  # (1,)


def sample_rows(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
    """Next token of every row of ``logits`` (B, vocab) with its own sampler; returns (B,) uint32 (lazy).

    If a sampler raises, MLX's global generator is reseeded before the error propagates: mlx-lm's filters are
    compiled with the generator's state as input and output, and an exception while one is traced leaves that state
    a placeholder, so every later random draw in the process would fail ("eval an array without a primitive")."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, vocab)
    if all(s.greedy for s in samplers):
        return mx.argmax(logprobs, axis=-1).astype(mx.uint32)  # (B,)
    try:
        rows = [s(logprobs[i : i + 1]).astype(mx.uint32) for i, s in enumerate(samplers)]  # B x (1,)
    except Exception:
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        raise
    return mx.concatenate(rows)  # (B,)
