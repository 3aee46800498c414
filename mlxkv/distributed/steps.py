"""What rank 0 sends before each forward: :class:`StepMessage`, the pool changes since the last message and the
description of the forward every rank runs next (plain data, pickled by :mod:`mlxkv.distributed.channel`).

A forward is described from the engine's :class:`~mlxkv.engine.plan.StepPlan` (:func:`describe`): its prefill
chunks (sequence, tokens, whether the last position's logits are wanted; one by one or together) or its decode
rows (sequences, input shape, batched or not; the input tokens themselves travel inside the forward's graph,
:meth:`~mlxkv.distributed.channel.PlanChannel.share`). A follower runs exactly that
(:meth:`~mlxkv.distributed.follower.Replayer.run_step`), without a scheduler of its own. The other steps are the
start-up batch probes (each rank probes its own pool), a KV tier agreement, an idle heartbeat and the stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxkv.vision.spans import overlapping


@dataclass(frozen=True, slots=True)
class ChunkRun:
    """Prompt ``tokens`` into sequence ``seq``; ``want_logits``: the last position's logits are computed."""

    seq: int
    tokens: list[int]
    want_logits: bool


@dataclass(frozen=True, slots=True)
class PrefillRun:
    """Prefill chunks: in one batched forward when ``together``, else one forward each, in order (the first that
    fails ends the step)."""

    chunks: list[ChunkRun]
    together: bool


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """One decode forward: one input token per sequence of ``seqs`` (token ids of ``shape`` ``(B, 1)``, shared in
    the graph), batched through batch views when ``batched``; ``prompt_tails``: per row, the prompt tokens it feeds
    before its input (a prompt's uncached end joining the batch; empty: none does)."""

    seqs: list[int]
    shape: tuple[int, ...]
    batched: bool
    prompt_tails: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """The engine's start-up probe of batched ``"decode"`` or ``"prefill"``, each rank on its own pool."""

    what: str


@dataclass(frozen=True, slots=True)
class TierHave:
    """Every rank answers, for each ``(group, hash)`` key, whether its KV tier holds its shard
    (:meth:`~mlxkv.distributed.tier.RankTier.agree`)."""

    keys: list


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing runs: a heartbeat (and the changes made while idle)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The followers flush their KV tier (if any) within ``flush_timeout`` seconds and stop."""

    flush_timeout: float = 0.0


Step = PrefillRun | DecodeRun | ProbeRun | TierHave | Idle | Stop


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One message of rank 0: apply ``changes`` (in order), check the pool then holds ``free`` free blocks and its
    sequences are ``sequences`` (:func:`~mlxkv.distributed.changes.sequence_state`), set the block pools' clock to
    ``now``, gather every rank's memory figures when ``gather``, then run ``step``."""

    changes: list = field(default_factory=list)
    free: int = 0
    sequences: tuple = ()
    now: float = 0.0
    gather: bool = False
    step: Any = Idle()


def describe(plan: Any, *, batched: bool, always_logits: bool = False) -> PrefillRun | DecodeRun | None:
    """The forward :meth:`~mlxkv.engine.runner.ModelRunner.execute` runs for ``plan`` (None: it runs none).
    ``batched``: the runner's batched-decode switch; ``always_logits``: every prefill chunk computes its logits
    (pipeline ranks evaluate every forward's output).

    Raises:
        ValueError: what the followers cannot run (image placeholders: their features would have to travel too;
            verification rows of speculative decoding).
    """
    chunks = plan.prefills
    if chunks:
        if any(overlapping(c.task.job.request.media, c.start, c.end) for c in chunks):
            raise ValueError("images are not served under --distributed")
        return PrefillRun([ChunkRun(c.task.seq.id.value, list(c.tokens), c.want_logits or always_logits)
                           for c in chunks], together=plan.together)
    if plan.drafts:
        raise ValueError("speculative decoding does not run under --distributed")
    if plan.decode:
        return DecodeRun([c.seq.id.value for c in plan.decode], tuple(plan.decode_inputs.shape), batched,
                         [list(t) for t in plan.prompt_tails])
    return None
