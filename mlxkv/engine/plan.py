"""What one forward of an engine step runs, and what it produced: :class:`StepPlan` and :class:`StepOutput`.

The scheduler decides a plan (:meth:`~mlxkv.engine.scheduler.Scheduler.schedule` for prefill chunks,
:meth:`~mlxkv.engine.scheduler.Scheduler.schedule_decode` for the decode rows) without running the model; the
runner executes it (:meth:`~mlxkv.engine.runner.ModelRunner.execute`) and the scheduler applies the output
(:meth:`~mlxkv.engine.scheduler.Scheduler.update`). Plain data: what is named here is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from mlxkv.engine.jobs import Choice, Job, Prefill


@dataclass(slots=True, eq=False)
class PrefillChunk:
    """Prompt tokens ``task.tokens[start:end]`` into ``task.seq``; ``want_logits``: the chunk ends a request's own
    prompt, so the last position's logits are kept (its first token is sampled from them)."""

    task: Prefill
    start: int
    end: int
    want_logits: bool

    @property
    def tokens(self) -> list[int]:
        return self.task.tokens[self.start : self.end]

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(slots=True, eq=False)
class StepPlan:
    """One forward of a step and the decisions taken to reach it.

    Attributes:
        cancelled: jobs ended because their client cancelled (before anything ran).
        admitted: tasks moved from the waiting queue (or back from preemption) to prefilling.
        prefills: prompt chunks; one by one, or in one forward when ``together``.
        together: the chunks share one batched forward.
        started: tasks whose choices start decoding without a forward of their own: the prompt is cached, or but
            for its last token or a short end, which the decode batch's forward feeds (``prompt_tails``).
        decode: the choices decoding one token each (``decode_inputs`` ``(B, 1)``, lazily built).
        prompt_tails: a decode step some of whose rows end a prompt (aligned with ``decode``; empty: none does): row b
            feeds ``prompt_tails[b]`` then its input, and samples from its last position.
        masks: ``masks(logits)`` gives the decode rows' grammar masks, called once the forward is queued (None: no
            constrained row).
        drafts: a verification step (speculative decoding): each decode row's proposed tokens, aligned with
            ``decode`` (empty: the row decodes one token); row b feeds ``[c.next_input, *drafts[b]]`` and
            ``decode_inputs`` is unused. Empty list: a plain decode step.
        draft_logprobs: a verification step's draft log-probabilities per row, aligned with ``drafts``: ``(k, vocab)``
            where a sampled row's tokens were drawn from a draft model's distribution, else None (greedy rows, prompt
            lookup's point masses). Empty: all None.
    """

    cancelled: list[Job] = field(default_factory=list)
    admitted: list[Prefill] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    together: bool = False
    started: list[Prefill] = field(default_factory=list)
    decode: list[Choice] = field(default_factory=list)
    decode_inputs: mx.array | None = None
    prompt_tails: list[list[int]] = field(default_factory=list)
    masks: Callable[[mx.array], list | None] | None = None
    drafts: list[list[int]] = field(default_factory=list)
    draft_logprobs: list[mx.array | None] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class StepOutput:
    """What :meth:`~mlxkv.engine.runner.ModelRunner.execute` produced for a plan.

    Attributes:
        prefill_logits: per chunk of ``plan.prefills``, its last position's logits ``(1, vocab)`` (None where not
            wanted).
        tokens: the decode rows' sampled tokens ``(B,)`` uint32, evaluated asynchronously (read them later).
        committed: a verification step's tokens per decode row (its accepted drafts, then the target's token),
            read already.
        error: the exception the forward raised (the scheduler fails the requests it touches).
        row_errors: decode rows whose own sampling raised (row -> exception; their tokens are placeholders): the
            scheduler fails those rows' requests only.
    """

    prefill_logits: list[mx.array | None] = field(default_factory=list)
    tokens: mx.array | None = None
    committed: list[list[int]] = field(default_factory=list)
    error: BaseException | None = None
    row_errors: dict[int, BaseException] = field(default_factory=dict)
