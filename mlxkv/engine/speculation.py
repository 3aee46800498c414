"""Speculative decoding inside the engine step: which decode rows propose tokens, and what they proposed.

With a drafter configured (``mlxkv serve --prompt-lookup`` or ``--draft-model M``), every decoding choice that may
speculate keeps a row drafter: a :class:`RowDrafter` (prompt lookup over its prompt and emitted tokens) or a
:class:`~mlxkv.engine.draft_rows.ModelRowDrafter` (its sequence in the draft model's own paged pool). Before a
decode step the scheduler asks every such row for up to ``K`` tokens at once (:func:`propose_rows`: draft-model
rows share batched draft forwards); rows that proposed some turn the step into a verification step: each row feeds
``[input, d_1..d_k]`` (rows with no proposal feed their input alone), the target runs all rows in one forward, and
each row keeps its own accepted prefix and the target's next token (:mod:`mlxkv.engine.verify_rows`); rejected
positions are trimmed from its caches (and its draft's) before anything is committed, so block hashes and the prefix
caches only ever see verified tokens.

A row drafter is a small interface, whatever drafts behind it:

* ``propose(budget) -> list[int]``: up to ``budget`` tokens after the emitted ones (one row alone);
* ``emitted(token)``: a token was committed;
* ``verified(proposed, accepted)``: the last proposal's outcome (``proposed`` 0: it never reached verification);
* ``suspend()``: the row was preempted: free what it holds (it resumes from its committed tokens);
* ``end()``: the row is done: free what it holds;
* optionally ``source``: an object whose ``propose(rows, budgets) -> list[Draft]`` proposes for several rows at
  once (a draft model batching its forwards); proposals then carry the draft's log-probabilities.

A row speculates where acceptance is exact and cheap to decide: greedy rows and unseeded sampled rows (rejection
sampling keeps the target's distribution; a seeded row keeps its own reproducible stream, so it decodes one token at
a time) that record no log-probabilities. Penalties and ``logit_bias`` speculate too: the verification applies them
at every position with the history extended by the draft tokens before it, exactly what plain decoding would have
seen (:meth:`~mlxkv.engine.row_sampler.RowSampler.position_logprobs`). So do grammar-constrained rows (structured
output, forced tool calls): a proposal is cut before the first token the grammar refuses
(:meth:`~mlxkv.structured.constraint.TokenConstraint.allowed_prefix`), each verification position is masked with
the grammar's mask after the draft tokens before it (computed on the matcher and rolled back,
:func:`~mlxkv.engine.constraints.verify_masks`), and the grammar advances by the committed tokens only. Seeded and
logprob rows, and rows with a caller's own logits processor, decode normally in the same forward, and their tokens
are those of a server without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxkv.engine.drafters import Draft, PromptLookupDrafter


@dataclass(frozen=True, slots=True)
class Speculation:
    """The server's drafting settings.

    Attributes:
        num_draft_tokens: tokens a row proposes per step at most (a request may ask for fewer, or none).
        ngram_size: longest n-gram prompt lookup matches.
        draft: the draft model's rows (:class:`~mlxkv.engine.draft_rows.DraftModelRows`); None: prompt lookup.
    """

    num_draft_tokens: int = 3
    ngram_size: int = 3
    draft: Any = None

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.ngram_size < 1:
            raise ValueError(f"ngram_size must be >= 1, got {self.ngram_size}")

    def tokens_for(self, asked: int | None) -> int:
        """Draft tokens per step for a request that asked for ``asked`` (``None``: the server's; 0: off)."""
        return self.num_draft_tokens if asked is None else asked

    @property
    def drafter_name(self) -> str:
        """``"draft_model"`` or ``"prompt_lookup"``."""
        return "prompt_lookup" if self.draft is None else "draft_model"

    def row(self, prompt: list[int], sampler: Any, k: int, salt: Any = None) -> Any:
        """A row drafter (see the module's docstring) for one choice of ``prompt``, proposing up to ``k`` tokens;
        ``salt``: the request's cache salt (a draft model's prefix cache is shared within a salt only)."""
        if self.draft is not None:
            return self.draft.row(prompt, sampler, k, salt)
        return RowDrafter(prompt, k, self.ngram_size)


def propose_rows(drafters: list[Any], budgets: list[int]) -> list[Draft]:
    """Every row's proposal, rows with a shared ``source`` (a draft model) proposed together in batched forwards.

    Args:
        drafters: the rows' drafters.
        budgets: each row's most tokens (its remaining ``max_tokens`` less the target's own token).
    """
    out: list[Draft] = [Draft([]) for _ in drafters]
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, drafter in enumerate(drafters):
        source = getattr(drafter, "source", None)
        if source is None:
            out[i] = Draft(drafter.propose(budgets[i]))
        else:
            groups.setdefault(id(source), (source, []))[1].append(i)
    for source, rows in groups.values():
        for i, draft in zip(rows, source.propose([drafters[i] for i in rows], [budgets[i] for i in rows])):
            out[i] = draft
    return out


class RowDrafter:
    """One decoding choice's drafter: its prompt-lookup index over the prompt and every token it emitted, and how
    many tokens to propose next.

    The draft length adapts to how the row's text goes: it doubles (up to ``k``) after a step that accepted every
    proposed token — the answer is copying a stretch of its prompt, and a longer verification row costs little
    more than a short one — and falls back to one more than the accepted count after a rejection, so text that
    does not repeat its prompt pays for short rows only. Which tokens are proposed never changes the output.

    Args:
        prompt: the request's prompt tokens.
        k: most tokens proposed per step.
        ngram_size: longest n-gram matched.
    """

    def __init__(self, prompt: list[int], k: int, ngram_size: int):
        self.k = k
        self.length = min(k, 2)  # the next proposal's length
        self.lookup = PromptLookupDrafter(ngram_size=ngram_size)
        self.lookup.begin(list(prompt), None, vocab_size=0, max_draft=k)  # type: ignore[arg-type]

    def emitted(self, token: int) -> None:
        """``token`` was emitted (committed): later lookups may match it."""
        self.lookup.commit(Draft([]), 0, token)

    def propose(self, budget: int) -> list[int]:
        """Up to ``min(length, budget)`` tokens that may follow the emitted ones (none when ``budget`` < 1)."""
        k = min(self.length, budget)
        return self.lookup.propose(k).tokens if k > 0 else []

    def verified(self, proposed: int, accepted: int) -> None:
        """The last proposal's outcome: ``accepted`` of its ``proposed`` tokens were kept."""
        if proposed == 0:
            return
        self.length = min(self.k, 2 * self.length) if accepted == proposed else max(1, accepted + 1)

    def suspend(self) -> None:
        """Preempted: nothing to free (the lookup index is host memory and stays valid)."""

    def end(self) -> None:
        """Done: nothing to free."""


def may_speculate(request: Any, sampler: Any, overflow: Any) -> bool:
    """Whether a choice of ``request`` (its ``sampler``) may propose tokens: its logits processors, if any, depend on
    the token history alone (penalties, logit bias: the verification scores every position with them), it records
    no log-probabilities, a sampled row is unseeded, and its sequence has no overflow policy (pages it evicts could
    not be rewound). A grammar does not stop it: its proposals are cut where the grammar would refuse and every
    position verified under its mask."""
    return (sampler.history_only and request.logprobs is None and overflow is None
            and (sampler.greedy or request.params.seed is None))


def check_pool(pool: Any, whose: str = "the model's, or --max-kv-size") -> None:
    """Refuse a KV store speculation cannot rewind exactly, in one line: sliding-window or chunked layers (a trim
    may stop short of a released block), recurrent layers (their state cannot be cut mid-forward) and a
    server-wide overflow policy (evicted pages cannot come back). ``whose``: where the layers come from, for the
    message.

    Raises:
        ValueError: naming what the store has.
    """
    from mlxkv.engine.rewind import flatten_caches, is_recurrent

    if getattr(pool, "overflow", None) is not None:
        raise ValueError("speculative decoding cannot run with --kv-overflow: pages an overflow policy evicts cannot "
                         "be rewound")
    seq = pool.open(prompt_length=1, prompt=[0])
    try:
        for cache in flatten_caches(seq.caches):
            if is_recurrent(cache):
                kind = "recurrent (state-space / linear-attention)"
            else:  # paged layers say their window / chunk; dense ones their layout
                name = type(cache).__name__
                windowed = getattr(cache, "window", None) is not None or getattr(cache, "chunk_size", None) is not None
                kind = "sliding-window or chunked" if windowed or "Rotating" in name or "Chunked" in name else None
            if kind is not None:
                raise ValueError(f"speculative decoding needs full-attention KV caches; these have {kind} "
                                 f"layers ({whose}): run without --prompt-lookup / --draft-model")
    finally:
        pool.release(seq.id)
