"""Log-probabilities of sampled tokens, recorded lazily per draw and read when the token is emitted.

A row sampler that reports log-probabilities adds one record per draw: the sampled token's log-probability and
the ``top`` most likely tokens with theirs, all lazy arrays built in the same graph as the token (the decode loop
hands them to ``async_eval`` with the step's tokens, so reading them costs no evaluation of its own). Records
come out in draw order, one per emitted token (:func:`mlxkv.engine.output.emit_token`).

Convention: the log-probabilities are the model's own distribution — ``log_softmax`` of its logits, before
penalties, logit bias, temperature and top-p/top-k/min-p filtering — as OpenAI reports them (and vLLM by
default). So a greedy completion's log-probabilities add up to the model's log-likelihood of its text.
"""

from __future__ import annotations

import collections

import mlx.core as mx

from mlxkv.engine.output import TokenLogprob
from mlxkv.engine.request import MAX_TOP_LOGPROBS


class LogprobRecorder:
    """The lazy log-probability records of one sampler's draws, oldest first.

    Args:
        top: alternatives to record per token (0: the sampled token's log-probability only).
    """

    def __init__(self, top: int):
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        self.top = top
        self._records: collections.deque[tuple[mx.array, ...]] = collections.deque()

    def record(self, logprobs: mx.array, token: mx.array) -> None:
        """Add the record of one draw: ``logprobs`` ``(1, vocab)`` (normalized), ``token`` ``(1,)`` (lazy)."""
        chosen = mx.take_along_axis(logprobs, token.reshape(1, 1).astype(mx.int32), axis=-1)  # (1, 1)
        if self.top == 0:
            self._records.append((chosen,))
            return
        top = min(self.top, logprobs.shape[-1])  # a vocabulary smaller than the ask: all of it
        ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]  # (1, top), unordered
        self._records.append((chosen, ids, mx.take_along_axis(logprobs, ids, axis=-1)))  # + (1, top)

    def last_arrays(self) -> tuple[mx.array, ...]:
        """The newest record's arrays (to evaluate with the token they describe); empty when there is none."""
        return self._records[-1] if self._records else ()

    def pop(self, token: int) -> TokenLogprob:
        """The oldest record, read (``token`` is the value of the token it was drawn with); alternatives most
        likely first, ties by token id."""
        assert self._records, "a token was emitted that its sampler never recorded"
        record = self._records.popleft()
        logprob = float(record[0].item())
        if len(record) == 1:
            return TokenLogprob(token, logprob, ())
        pairs = zip(record[1][0].tolist(), record[2][0].tolist())
        return TokenLogprob(token, logprob, tuple(sorted(pairs, key=lambda p: (-p[1], p[0]))))
