"""Grammar constraints of the batch engine's choices (``response_format``, forced tool calls): made when a
request's choices start decoding, advanced by every token a choice emits, asked for their next-token masks right
before a step samples.

A constraint consumes its choice's tokens when they are emitted (the scheduler's ``_emit``), each exactly once: a
preempted choice resumes with its prompt and generated tokens prefilled again as a prefix, but nothing is emitted
twice, so its grammar neither replays nor skips a token, and its next mask continues from its last emitted token.
A mask needs the previous token consumed, so a decode step with constrained rows queues its forward, then reads
the previous step's tokens (emitting them), then computes the masks — on the CPU while the forward runs — and
samples (:class:`~mlxkv.engine.decode_loop.DecodeLoop`); a step without constrained rows is unchanged. A choice's
constraint is dropped when the choice closes or its request ends (finished, failed or cancelled).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from mlxkv.structured.constraint import TokenConstraint, make_constraint


def constraints_for(request: Any, tokenizer: Any, n: int) -> list[TokenConstraint | None]:
    """One fresh constraint per choice of ``request`` (a :class:`~mlxkv.engine.request.GenerationRequest`), or
    ``None`` for each when its output is free.

    Raises:
        ValueError: the grammar does not compile against the tokenizer.
    """
    fmt = request.response_format
    if fmt is None or not fmt.constrained:
        return [None] * n
    return [make_constraint(fmt, tokenizer) for _ in range(n)]


def step_masks(choices: Sequence[Any], width: int, fail: Callable[[Any, BaseException], None]
               ) -> list[np.ndarray | None] | None:
    """The next-token masks of ``choices`` (uint32 words over ``width`` logits; ``None`` for a free row), or
    ``None`` when no row is constrained. A choice whose grammar engine fails has its request failed (``fail(job,
    exc)``) and samples free: its token is dropped with the request."""
    if all(c.constraint is None for c in choices):
        return None
    masks: list[np.ndarray | None] = []
    for choice in choices:
        mask = None
        if choice.constraint is not None:
            try:
                mask = choice.constraint.words(width)
            except Exception as exc:  # noqa: BLE001 - the grammar engine's failure is this request's alone
                fail(choice.job, exc)
        masks.append(mask)
    return masks


def consume(choice: Any, token: int) -> None:
    """Advance ``choice``'s constraint (if any) past its emitted ``token``.

    Raises:
        mlxkv.structured.constraint.ConstraintError: the token breaks the grammar (it was sampled without the
            mask) or the grammar engine failed.
    """
    if choice.constraint is not None:
        choice.constraint.advance(token)


def verify_masks(choices: Sequence[Any], drafts: Sequence[Sequence[int]], width: int,
                 fail: Callable[[Any, BaseException], None]) -> list[np.ndarray | None] | None:
    """A verification step's grammar masks: for a constrained row with a proposal, one mask per position
    ``(k + 1, ceil(width / 32))`` (:meth:`~mlxkv.structured.constraint.TokenConstraint.draft_words`: the masks
    after each draft token, the grammar's state left as it was); for one without, its next-token mask as in
    :func:`step_masks`; ``None`` for a free row; ``None`` altogether when no row is constrained. A choice whose
    grammar engine fails has its request failed and goes free."""
    if all(c.constraint is None for c in choices):
        return None
    masks: list[np.ndarray | None] = []
    for choice, draft in zip(choices, drafts):
        mask = None
        if choice.constraint is not None:
            try:
                mask = choice.constraint.draft_words(draft, width) if draft else choice.constraint.words(width)
            except Exception as exc:  # noqa: BLE001 - the grammar engine's failure is this request's alone
                fail(choice.job, exc)
        masks.append(mask)
    return masks
