"""Drafters: cheap proposals of the next tokens, for the target model to verify in one forward.

A drafter follows one sequence at a time through ``begin`` -> (``propose`` -> ``commit``)* -> ``end``:

* :class:`DraftModelDrafter` runs a second, smaller model with the same vocabulary over its own caches,
  kept in step with the committed tokens (rewound with ``trim`` after a partial acceptance).
* :class:`PromptLookupDrafter` finds the latest earlier occurrence of the text's last n-gram in the prompt and
  the generated tokens and proposes what followed it (no second model).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxkv.engine.prefill import prefill
from mlxkv.engine.rewind import CacheRewinder
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.verify import logprobs, sampling_logprobs
from mlxkv.kv import CachePool


@dataclass
class Draft:
    """Proposed next tokens."""

    tokens: list[int]
    # (k, V) log-probabilities each token was drawn from; None: deterministic proposals (point masses)
    logprobs: mx.array | None = None


class Drafter(ABC):
    """Proposes tokens for one sequence at a time; the engine tells it which ones were committed."""

    @abstractmethod
    def begin(self, prompt: list[int], params: SamplingParams, vocab_size: int, max_draft: int) -> None:
        """Start following a sequence whose prompt is ``prompt``; the target's vocabulary has ``vocab_size``
        entries and ``propose`` will be asked for at most ``max_draft`` tokens."""

    @abstractmethod
    def propose(self, k: int) -> Draft:
        """Up to ``k`` (>= 1) tokens likely to follow the committed ones (may be fewer, even none)."""

    @abstractmethod
    def commit(self, draft: Draft, accepted: int, token: int) -> None:
        """The first ``accepted`` tokens of ``draft`` (the last proposal; empty if none was asked) and then
        ``token`` are committed."""

    def end(self) -> None:
        """Stop following the sequence and free what it held (safe to call more than once)."""


class PromptLookupDrafter(Drafter):
    """Prompt-lookup drafting: continue the latest earlier occurrence of the last n-gram.

    The longest suffix of the committed tokens of length ``ngram_size`` down to ``min_ngram_size`` that
    occurred before is looked up (latest occurrence wins) and the tokens that followed it are proposed. A match
    that runs into the present repeats itself, so periodic text drafts the full ``k``. The index is
    incremental: O(``ngram_size``) dictionary updates per committed token.

    Args:
        ngram_size: longest n-gram to match (>= 1).
        min_ngram_size: shortest n-gram to match (1 <= min_ngram_size <= ngram_size).

    Raises:
        ValueError: on sizes out of range.
    """

    def __init__(self, ngram_size: int = 3, min_ngram_size: int = 1):
        if ngram_size < 1:
            raise ValueError(f"ngram_size must be >= 1, got {ngram_size}")
        if not 1 <= min_ngram_size <= ngram_size:
            raise ValueError(f"min_ngram_size must be in [1, ngram_size={ngram_size}], got {min_ngram_size}")
        self.ngram_size = ngram_size
        self.min_ngram_size = min_ngram_size
        self.history: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence

    def begin(self, prompt: list[int], params: SamplingParams, vocab_size: int, max_draft: int) -> None:
        self.history = []
        self._next = {}
        for token in prompt:
            self._append(token)

    def _append(self, token: int) -> None:
        h = self.history
        end = len(h)  # the n-grams ending just before `token` now have a continuation at index `end`
        for n in range(self.min_ngram_size, min(self.ngram_size, end) + 1):
            self._next[tuple(h[end - n:end])] = end
        h.append(token)

    def propose(self, k: int) -> Draft:
        h = self.history
        for n in range(min(self.ngram_size, len(h)), self.min_ngram_size - 1, -1):
            start = self._next.get(tuple(h[-n:]))
            if start is None:
                continue
            tokens: list[int] = []
            for j in range(k):
                pos = start + j
                tokens.append(h[pos] if pos < len(h) else tokens[pos - len(h)])
            return Draft(tokens)
        return Draft([])

    def commit(self, draft: Draft, accepted: int, token: int) -> None:
        for t in draft.tokens[:accepted]:
            self._append(t)
        self._append(token)


class DraftModelDrafter(Drafter):
    """Drafting with a second model that shares the target's tokenizer and vocabulary.

    The draft model keeps its own caches (one sequence of ``pool``) in step with the committed tokens: after a
    partial acceptance its caches are rewound with ``trim`` (recurrent layers restored from per-step
    snapshots, so no replay is needed). With ``temp > 0`` it samples its drafts from its own distribution under
    the same sampling settings, which the target's rejection sampling needs.

    Args:
        model: the draft model (mlx-lm module).
        pool: CachePool for the draft model's caches (default: one sequence over mlxkv's layouts); dense
            (the target's pool may be paged; the draft's caches live one sequence long).
        prefill_step_size: prompt tokens per draft prefill forward.

    Raises:
        ValueError: a paged ``pool``.
    """

    def __init__(self, model: Any, *, pool: CachePool | None = None, prefill_step_size: int = 2048):
        self.model = model
        self.pool = pool if pool is not None else CachePool(model, max_sequences=1)
        if self.pool.is_paged:
            raise ValueError("the draft model's CachePool must be dense (backend='dense'); the target's may be paged")
        self.prefill_step_size = prefill_step_size
        self._seq = None
        self._rewinder: CacheRewinder | None = None
        self._params = SamplingParams()
        self._pending: list[int] = []  # committed tokens not yet fed to the draft model
        self._snapshots: list = []  # recurrent state after each forward of the last proposal

    def begin(self, prompt: list[int], params: SamplingParams, vocab_size: int, max_draft: int) -> None:
        self.end()
        self._params = params
        self._seq = self.pool.open(prompt_length=len(prompt))
        self._rewinder = CacheRewinder(self._seq.caches, max_trim=max_draft)
        logits = prefill(self.model, self._seq.caches, mx.array(prompt, dtype=mx.uint32),
                         step_size=self.prefill_step_size)  # (V_draft,)
        if logits.shape[-1] != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {logits.shape[-1]} entries, the target's {vocab_size}: "
                "a draft model must share the target's tokenizer and vocabulary"
            )
        self._pending = []

    def propose(self, k: int) -> Draft:
        assert self._seq is not None and self._pending, "propose() needs begin() and a committed token"
        caches = self._seq.caches
        x = mx.array(self._pending, dtype=mx.uint32)  # (P,)
        self._pending = []
        self._snapshots = []
        ys, lps = [], []
        for _ in range(k):
            logits = self.model(x[None], cache=caches)[0, -1:, :]  # (1, V)
            self._snapshots.append(self._rewinder.snapshot())
            if self._params.temp == 0:
                y = mx.argmax(logprobs(logits), axis=-1)  # (1,)
            else:
                lp = sampling_logprobs(logits, self._params)  # (1, V)
                y = mx.random.categorical(lp, axis=-1)  # (1,)
                lps.append(lp)
            mx.async_eval(y)  # the next draft step is queued while this one computes
            ys.append(y)
            x = y.astype(mx.uint32)
        tokens = mx.concatenate(ys).tolist() if ys else []
        return Draft(tokens, mx.concatenate(lps, axis=0) if lps else None)

    def commit(self, draft: Draft, accepted: int, token: int) -> None:
        k = len(draft.tokens)
        if k == 0:
            self._pending.append(token)
        elif accepted == k:
            self._pending = [draft.tokens[-1], token]  # the last draft token was never fed to the draft model
        else:
            # The draft model fed pending + d_1..d_{k-1}; keep pending + d_1..d_accepted.
            self._rewinder.trim(k - 1 - accepted)
            if self._rewinder.needs_replay:
                self._rewinder.restore(self._snapshots[accepted])
            self._pending = [token]
        self._snapshots = []

    def end(self) -> None:
        if self._seq is not None:
            self.pool.release(self._seq.id)
            self._seq = None
            self._rewinder = None
        self._snapshots = []
