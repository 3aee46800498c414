"""A verification step's outcome, row by row: the tokens each decode row commits.

Row ``b`` fed ``[input, d_1..d_k]`` (``k = len(drafts[b])``, possibly 0) and its logits ``(B, Lmax, vocab)`` hold, at
position ``i``, the target's prediction after ``d_i``. A row with a proposal keeps its longest accepted prefix and
then the target's own token (:mod:`mlxkv.engine.verify`: exact match for greedy rows, rejection sampling for sampled
ones, so every committed token is distributed as the target's); a row without one draws its token from position 0
with its own sampler, under its grammar mask if any, exactly as a plain decode step does.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxkv.engine.row_sampler import RowSampler, lazy_outputs, sample_rows
from mlxkv.engine.verify import logprobs, sampling_logprobs, verify_sampled


def verify_rows(logits: mx.array, drafts: Sequence[list[int]], samplers: Sequence[RowSampler],
                masks: Sequence[np.ndarray | None] | None = None,
                failed: dict[int, BaseException] | None = None,
                draft_logprobs: Sequence[mx.array | None] | None = None) -> list[list[int]]:
    """The tokens each row commits: its accepted drafts, then one token of the target's.

    Args:
        logits: ``(B, Lmax, vocab)``: row b's first ``1 + len(drafts[b])`` positions are real.
        drafts: each row's proposed tokens (empty: the row decodes one token).
        samplers: each row's sampler (a row with a proposal is greedy or sampled without processors).
        masks: grammar masks of the rows without a proposal (see :func:`~mlxkv.engine.row_sampler.sample_rows`).
        failed: rows whose own sampling raised go there (their result is a placeholder ``[0]``).
        draft_logprobs: per row, the ``(k, vocab)`` log-probabilities a sampled row's draft was drawn from (a draft
            model's); None or absent: the draft is deterministic (a point mass on each token).
    """
    first = sample_rows(logits[:, 0, :], list(samplers), masks, failed)  # (B,) every row's position-0 draw
    greedy = mx.argmax(logprobs(logits), axis=-1)  # (B, Lmax)
    mx.eval(first, greedy, *lazy_outputs(samplers))
    firsts, argmaxes = first.tolist(), greedy.tolist()
    out: list[list[int]] = []
    for b, (draft, sampler) in enumerate(zip(drafts, samplers)):
        if not draft:
            out.append([firsts[b]])
        elif sampler.greedy:
            target = argmaxes[b]
            n = 0
            while n < len(draft) and target[n] == draft[n]:
                n += 1
            out.append([*draft[:n], target[n]])
        else:
            k = len(draft)
            q = draft_logprobs[b] if draft_logprobs else None  # (k, vocab) or None
            verdict = verify_sampled(sampling_logprobs(logits[b, : k + 1], sampler.params), draft, q)
            out.append([*draft[: verdict.accepted], verdict.token])
    return out
