"""A verification step's outcome, row by row: the tokens each decode row commits.

Row ``b`` fed ``[input, d_1..d_k]`` (``k = len(drafts[b])``, possibly 0) and its logits ``(B, Lmax, vocab)`` hold, at
position ``i``, the target's prediction after ``d_i``. A row with a proposal scores every position with its own
sampler (:meth:`~mlxkv.engine.row_sampler.RowSampler.position_logprobs`: its penalties and logit bias applied with
the history extended by the draft tokens before that position, as plain decoding would have applied them; a
constrained row's logits masked first by its grammar's mask after those draft tokens), keeps its longest accepted
prefix and then the target's own token (:mod:`mlxkv.engine.verify`: exact match with the argmax for greedy rows,
rejection sampling for sampled ones, so every committed token is distributed as the target's); a row without one
draws its token from position 0 with its own sampler, under its grammar mask if any, exactly as a plain decode step
does.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from mlxkv.engine.row_sampler import RowSampler, lazy_outputs, sample_rows
from mlxkv.engine.verify import logprobs, sampling_logprobs, verify_sampled
from mlxkv.structured.constraint import apply_words


def verify_rows(logits: mx.array, drafts: Sequence[list[int]], samplers: Sequence[RowSampler],
                masks: Sequence[np.ndarray | None] | None = None,
                failed: dict[int, BaseException] | None = None,
                draft_logprobs: Sequence[mx.array | None] | None = None) -> list[list[int]]:
    """The tokens each row commits: its accepted drafts, then one token of the target's.

    Args:
        logits: ``(B, Lmax, vocab)``: row b's first ``1 + len(drafts[b])`` positions are real.
        drafts: each row's proposed tokens (empty: the row decodes one token).
        samplers: each row's sampler (a row with a proposal is greedy or unseeded and records no log-probabilities;
            its processors, if any, depend on the token history only).
        masks: grammar masks (None: a free row): a row without a proposal has its next-token mask (see
            :func:`~mlxkv.engine.row_sampler.sample_rows`), a row with one a mask per position ``(k + 1, words)``
            (:func:`~mlxkv.engine.constraints.verify_masks`; its draft holds only tokens the grammar allows).
        failed: rows whose own sampling raised go there (their result is a placeholder ``[0]``).
        draft_logprobs: per row, the ``(k, vocab)`` log-probabilities a sampled row's draft was drawn from (a draft
            model's); None or absent: the draft is deterministic (a point mass on each token).
    """
    out: list[list[int]] = [[0] for _ in drafts]
    single = [b for b, d in enumerate(drafts) if not d]
    drafting = [b for b, d in enumerate(drafts) if d]
    pending: list[mx.array] = []
    first = None
    if single:
        own_failed: dict[int, BaseException] = {}
        first = sample_rows(logits[mx.array(single), 0, :], [samplers[b] for b in single],
                            [masks[b] for b in single] if masks else None,
                            own_failed if failed is not None else None)  # (S,)
        for j, exc in own_failed.items():
            failed[single[j]] = exc  # type: ignore[index]
        pending += [first, *lazy_outputs([samplers[b] for b in single])]
    scores: dict[int, mx.array] = {}  # row -> (k + 1, vocab) its sampler's log-probabilities
    greedy: dict[int, mx.array] = {}  # greedy row -> (k + 1,) argmax
    shared = None  # (B, Lmax): the argmax of rows with nothing of their own, computed once for the batch
    for b in drafting:
        sampler, k = samplers[b], len(drafts[b])
        if sampler.greedy and not sampler.processors and not (masks and masks[b] is not None):
            shared = mx.argmax(logprobs(logits), axis=-1) if shared is None else shared
            greedy[b] = shared[b, : k + 1]
            continue
        row = logits[b, : k + 1]  # (k + 1, vocab)
        mask = masks[b] if masks else None  # (k + 1, ceil(vocab / 32)) uint32 words: each position's grammar
        if mask is not None:
            row = apply_words(row, mx.array(mask))
        try:
            scores[b] = sampler.position_logprobs(row, drafts[b])
        except Exception as exc:
            if failed is None:
                raise
            failed[b] = exc
            continue
        if sampler.greedy:
            greedy[b] = mx.argmax(scores[b], axis=-1)
    mx.eval(*pending, *greedy.values())
    if first is not None:
        for b, token in zip(single, first.tolist()):
            out[b] = [token]
    for b in drafting:
        if failed is not None and b in failed:
            continue
        draft, sampler = drafts[b], samplers[b]
        if b in greedy:
            target = greedy[b].tolist()
            n = 0
            while n < len(draft) and target[n] == draft[n]:
                n += 1
            out[b] = [*draft[:n], target[n]]
        else:
            q = draft_logprobs[b] if draft_logprobs else None  # (k, vocab) or None
            verdict = verify_sampled(sampling_logprobs(scores[b], sampler.params), draft, q)
            out[b] = [*draft[: verdict.accepted], verdict.token]
        sampler.accept(out[b])
    return out
