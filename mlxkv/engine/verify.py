"""Verifying drafted tokens against the target model's logits.

Greedy: drafted tokens are accepted while they equal the target's argmax; the first mismatch (or the bonus
position after a fully accepted draft) yields the target's own argmax. This is exactly plain greedy decoding.

Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Drafted token
``x_i`` drawn from ``q_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; the first rejected
position draws from ``norm(max(0, p_i - q_i))``; after a fully accepted draft the bonus token draws from
``p_k``. Each committed token is then distributed exactly as ``p``, the distribution the target's sampler
draws from (temperature, top-p, min-p and top-k applied in mlx-lm's order). Prompt lookup drafts from a point
mass: ``q_i(x_i) = 1``, so ``x_i`` is accepted with probability ``p_i(x_i)`` and a rejection draws from ``p_i``
with ``x_i`` removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxkv.engine.sampling import SamplingParams


@dataclass
class Verdict:
    """The outcome of verifying one draft."""

    accepted: int  # leading drafted tokens kept (0..k)
    token: int  # the target's token after them: a correction, or the bonus token after a full accept


def logprobs(logits: mx.array) -> mx.array:
    """Log-softmax over the last axis, computed as the direct engine does (so greedy argmaxes agree)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sampling_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities of the distribution ``params.make_sampler()`` draws from, row by row.

    Args:
        logits: (R, V) raw logits.
        params: sampling settings with ``temp > 0``.

    Returns:
        (R, V) normalized log-probabilities (``-inf`` for filtered-out tokens).
    """
    assert params.temp > 0, "greedy decoding has no sampling distribution"
    lp = logprobs(logits)  # (R, V)
    for apply in params.filters():
        lp = apply(lp)
    scaled = lp * (1.0 / params.temp)  # what categorical_sampling feeds mx.random.categorical
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def verify_greedy(target_logits: mx.array, draft: list[int]) -> Verdict:
    """Accept the longest prefix of ``draft`` that greedy decoding would have produced.

    Args:
        target_logits: (k + 1, V) target logits at the last committed token and each drafted token.
        draft: the k drafted token ids.
    """
    k = len(draft)
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    target = mx.argmax(logprobs(target_logits), axis=-1).tolist()  # (k + 1,)
    n = 0
    while n < k and target[n] == draft[n]:
        n += 1
    return Verdict(n, target[n])


def verify_sampled(target_lp: mx.array, draft: list[int], draft_lp: mx.array | None) -> Verdict:
    """Speculative rejection sampling over one draft.

    Args:
        target_lp: (k + 1, V) target sampling log-probabilities (see :func:`sampling_logprobs`).
        draft: the k drafted token ids.
        draft_lp: (k, V) the draft's sampling log-probabilities the tokens were drawn from, or ``None`` when
            the drafts are deterministic proposals (prompt lookup: a point mass on each token).

    Returns:
        The number of accepted drafted tokens and the next token, each committed token distributed as the
        target's ``p``.
    """
    k = len(draft)
    assert target_lp.shape[0] == k + 1, (target_lp.shape, k)
    p = mx.exp(target_lp)  # (k + 1, V)
    if k == 0:
        return Verdict(0, mx.random.categorical(target_lp).item())
    idx = mx.array(draft, dtype=mx.int32)[:, None]  # (k, 1)
    p_x = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]  # (k,)
    if draft_lp is None:
        q = mx.put_along_axis(mx.zeros_like(p[:k]), idx, mx.array(1.0, p.dtype), axis=-1)  # (k, V) one-hot
    else:
        assert draft_lp.shape == p[:k].shape, (draft_lp.shape, p.shape)
        q = mx.exp(draft_lp)  # (k, V)
    q_x = mx.take_along_axis(q, idx, axis=-1)[:, 0]  # (k,)
    accept = mx.random.uniform(shape=(k,)) * q_x < p_x  # (k,)  u < p/q without dividing by q
    residual = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]], axis=0)  # (k + 1, V)
    # One draw per row (the caller needs only the first rejected row, or the bonus row): one sync per round.
    # A row's residual has mass wherever a rejection can happen there (p_x < q_x implies p != q).
    samples = mx.random.categorical(mx.log(residual), axis=-1)  # (k + 1,)
    mx.eval(accept, samples)
    accepted = accept.tolist()
    n = accepted.index(False) if False in accepted else k
    return Verdict(n, samples.tolist()[n])
