"""SpeculativeEngine: draft k tokens cheaply, verify them with one target forward, rewind what was rejected.

``mlxkv generate`` runs it for ``--prompt-lookup`` and ``--draft-model`` where the engine step cannot speculate:
over layers it cannot rewind inside a verification forward (recurrent state: snapshotted and replayed here), and
for a seeded sampled answer (every round draws from the one seeded stream); otherwise both speculate on the engine
step itself (:mod:`mlxkv.engine.speculation`).

One round, with ``y`` the last committed token (committed but not yet fed to the target):

1. the drafter proposes ``d_1..d_k`` (a draft model, or prompt lookup);
2. the target runs once over ``[y, d_1..d_k]`` -> k + 1 rows of logits;
3. verification (:mod:`mlxkv.engine.verify`) keeps ``d_1..d_n`` and picks the next token ``t``;
4. every cache is rewound to ``prompt + committed`` tokens: ``trim(k - n)`` on the target's caches (the
   drafter rewinds its own). Models with recurrent layers (``ArraysCache``) cannot trim: their state is
   snapshotted before the verify forward, and on a partial acceptance the attention caches are trimmed by
   k + 1, the snapshot restored, and ``[y, d_1..d_n]`` replayed through the target (one extra forward, only in
   rounds that reject something).

Greedy output is token-for-token plain greedy decoding; sampled output has the target's distribution
(rejection sampling). Streaming, EOS and stop strings come from :class:`DirectEngine`, which this subclasses.
Unverified tokens never stay in a cache past their round: ``on_round`` reports, per round, how many tokens the
sequence's caches hold, all verified (a paged prefix cache may register blocks up to there).

Over a paged pool (``CachePool(backend="paged")``) the sequence opens with the prompt (and salt), prefill
starts at its prefix hit, ``[y, d_1..d_k]`` are fed to the block manager before each verify forward, and after
the rewind (which hands emptied tail blocks back to the pool) only the verified ``y, d_1..d_n`` are committed:
unverified tokens never become cached blocks. The drafter keeps its own (dense) caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxkv.engine.direct import DirectEngine, GenerationStats, LogitsProcessor
from mlxkv.engine.drafters import Draft, Drafter
from mlxkv.engine.prefill import prefill
from mlxkv.engine.rewind import CacheRewinder
from mlxkv.engine.sampling import SamplingParams, mlx_seed
from mlxkv.engine.verify import sampling_logprobs, verify_greedy, verify_sampled
from mlxkv.kv import CachePool, CacheRequest, Sequence


@dataclass
class SpeculativeRound:
    """What one speculation round did (passed to ``on_round``)."""

    drafted: int  # tokens proposed by the drafter (0 when it had nothing or the budget was 1 token)
    accepted: int  # leading drafted tokens the target kept
    tokens: list[int]  # tokens committed this round: the accepted drafts, then the target's own token
    verified_length: int  # tokens held by the target's caches after the rewind; every one of them verified


@dataclass
class SpeculativeStats(GenerationStats):
    """:class:`GenerationStats` plus the rounds' own figures (for ``--verbose``)."""

    speculative: bool = True
    rounds: int = 0
    replay_forwards: int = 0  # replays after partial acceptance on models with recurrent layers (in target_forwards)


class SpeculativeEngine(DirectEngine):
    """A :class:`DirectEngine` that decodes by speculation: same ``generate_tokens`` / ``generate`` /
    ``last_stats`` interface, same output for greedy decoding, same distribution when sampling.

    Args:
        model: the target mlx-lm model.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (may be ``None`` when only ``generate_tokens`` is used).
        drafter: a :class:`~mlxkv.engine.drafters.DraftModelDrafter` or
            :class:`~mlxkv.engine.drafters.PromptLookupDrafter`.
        num_draft_tokens: tokens drafted per round (>= 1).
        pool: the target's CachePool (default: one sequence over mlxkv's layouts).
        prefill_step_size: prompt tokens per prefill forward.
        on_round: called after each round's rewind with the sequence and the :class:`SpeculativeRound`.

    Raises:
        ValueError: ``num_draft_tokens < 1``; when generating, a cache layout that cannot rewind exactly
            (mlx-lm's rotating or chunked caches) or a draft model with another vocabulary size.
    """

    def __init__(self, model: Any, tokenizer: Any, drafter: Drafter, *, num_draft_tokens: int = 3,
                 pool: CachePool | None = None, prefill_step_size: int = 2048,
                 on_round: Callable[[Sequence, SpeculativeRound], None] | None = None):
        super().__init__(model, tokenizer, pool=pool, prefill_step_size=prefill_step_size)
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.on_round = on_round
        self.last_stats = SpeculativeStats()

    def generate_tokens(self, prompt: Seq[int], params: SamplingParams, *, salt: str | bytes | None = None,
                        logits_processors: Seq[LogitsProcessor] = (),
                        response_format: Any = None,
                        should_stop: Callable[[], bool] | None = None, logprobs: int | None = None) -> Iterator[int]:
        """Yield generated token ids (EOS included when produced), up to ``params.max_tokens``.

        The target's sequence and the drafter's state are released when the generator finishes or is closed.
        With a paged pool a cached prefix of the prompt is not recomputed (``salt`` isolates caches).
        ``should_stop``: checked between prefill chunks, as in :meth:`DirectEngine.generate_tokens`.

        Raises:
            ValueError: ``logits_processors``, a constrained ``response_format``, or penalties or a logit bias in
                ``params`` given (each would have to act on every drafted position).
        """
        if logits_processors or (response_format is not None and response_format.constrained):
            raise ValueError("speculative decoding does not apply logits processors such as structured output: "
                             "generate without a draft model or prompt lookup")
        if logprobs is not None:
            raise ValueError("speculative decoding does not report log-probabilities: generate without a draft "
                             "model or prompt lookup")
        if params.has_processors:
            raise ValueError("speculative decoding does not apply penalties or a logit bias: generate without a "
                             "draft model or prompt lookup")
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        prompt = list(prompt)
        if params.seed is not None:
            mx.random.seed(mlx_seed(params.seed))
        stats = SpeculativeStats(prompt_tokens=len(prompt))
        self.last_stats = stats
        mx.reset_peak_memory()
        seq = self.pool.open(prompt_length=len(prompt), prompt=prompt, cache_request=CacheRequest(salt=salt))
        try:
            rewinder = CacheRewinder(seq.caches, max_trim=self.num_draft_tokens + 1)
            start = time.perf_counter()
            cached = stats.cached_prompt_tokens = seq.num_cached  # paged prefix hit (< len(prompt)); dense: 0
            logits = prefill(self.model, seq.caches, mx.array(prompt[cached:], dtype=mx.uint32),
                             step_size=self.prefill_step_size, seq=seq, start=cached,
                             should_stop=should_stop)  # (V,)
            y = params.make_sampler()((logits - mx.logsumexp(logits, keepdims=True))[None]).item()
            seq.commit()  # paged: the prompt is verified; its full blocks become cached
            self.drafter.begin(prompt, params, vocab_size=logits.shape[-1], max_draft=self.num_draft_tokens)
            self.drafter.commit(Draft([]), 0, y)
            stats.prompt_seconds = time.perf_counter() - start
            start = time.perf_counter()
            stats.generation_tokens = 1
            yield y
            produced = 1
            while produced < params.max_tokens:
                # Draft at most one token fewer than the budget: the round always adds the target's own token.
                k = min(self.num_draft_tokens, params.max_tokens - produced - 1)
                draft = self.drafter.propose(k) if k > 0 else Draft([])
                committed = self._round(seq, rewinder, y, draft, params, stats)
                for token in committed:
                    produced += 1
                    stats.generation_tokens += 1
                    stats.generation_seconds = time.perf_counter() - start
                    yield token
                y = committed[-1]
        finally:
            stats.kv_bytes = self.pool.memory_usage_bytes()
            stats.peak_memory_bytes = mx.get_peak_memory()
            self.drafter.end()
            self.pool.release(seq.id)

    def _round(self, seq: Sequence, rewinder: CacheRewinder, y: int, draft: Draft, params: SamplingParams,
               stats: SpeculativeStats) -> list[int]:
        """Verify ``draft`` after ``y``, rewind every cache to the verified tokens; return the committed ones."""
        k = len(draft.tokens)
        before = rewinder.snapshot() if k > 0 and rewinder.needs_replay else None
        fed = [y, *draft.tokens]
        seq.feed(fed)  # paged: slots for y and the drafts (dense: no-op)
        logits = self.model(mx.array(fed, dtype=mx.uint32)[None], cache=seq.caches)[0]  # (k + 1, V)
        if params.temp == 0:
            verdict = verify_greedy(logits, draft.tokens)
        else:
            verdict = verify_sampled(sampling_logprobs(logits, params), draft.tokens, draft.logprobs)
        n = verdict.accepted
        stats.target_forwards += 1
        if n < k:
            if rewinder.needs_replay:
                # Recurrent state cannot be cut mid-forward: go back before it and feed the kept tokens again.
                rewinder.trim(k + 1)
                rewinder.restore(before)
                seq.feed(fed[: n + 1])
                self.model(mx.array(fed[: n + 1], dtype=mx.uint32)[None], cache=seq.caches)
                stats.target_forwards += 1
                stats.replay_forwards += 1
            else:
                rewinder.trim(k - n)  # paged: the drafts' emptied tail blocks go back to the pool
        seq.commit()  # only y, d_1..d_n are left: verified (paged: full blocks become cached)
        committed = [*draft.tokens[:n], verdict.token]
        self.drafter.commit(draft, n, verdict.token)
        stats.rounds += 1
        stats.drafted_tokens += k
        stats.accepted_tokens += n
        stats.decoded_tokens += n + 1
        verified = seq.prompt_length + stats.decoded_tokens  # prompt + committed tokens, minus the newest
        assert seq.offset in (0, verified), f"cache offset {seq.offset} != verified length {verified}"
        if self.pool.is_paged:
            assert seq.num_committed == verified, "paged: unverified tokens left"
        if self.on_round is not None:
            self.on_round(seq, SpeculativeRound(k, n, committed, verified))
        return committed
