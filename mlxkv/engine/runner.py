"""ModelRunner: executes what the scheduler decided — prefill chunks (one sequence, or several in one forward),
decode steps (one batched forward through batch views, else sequence by sequence) and sampling.

It owns no sequence and makes no decision about who runs: the scheduler hands it sequences (KV handles) and
token ids and gets logits or sampled tokens back. Where a batched path cannot run for a model, it switches that
path off for good and says so (``batched`` / ``batched_prefill``), and the step runs unbatched.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxkv.engine.plan import StepOutput, StepPlan
from mlxkv.engine.prefill_batch import forward_inputs, forward_together, last_rows, prefill_together
from mlxkv.engine.row_sampler import RowSampler, lazy_outputs, sample_rows
from mlxkv.engine.verify_rows import verify_rows
from mlxkv.kv import BatchUnsupported, cache_arrays, check_attended, make_batch_views
from mlxkv.vision.mrope import bound_rows
from mlxkv.vision.spans import ImageSpan, chunk_embeddings, overlapping


def _has_images(chunk: Any) -> bool:
    """Whether a prefill chunk holds image placeholders (it runs alone: its input is embeddings)."""
    return bool(overlapping(chunk.task.job.request.media, chunk.start, chunk.end))


class ModelRunner:
    """Runs one model's forwards over KV handles.

    Args:
        model: the mlx-lm model (attention hook installed for batch views).
        batched: decode several sequences in one forward through batch views.
        batched_prefill: prefill several short chunks in one forward (:mod:`mlxkv.engine.prefill_batch`).
        totals: the scheduler's counters; the runner adds ``batched_steps``, ``unbatched_steps``,
            ``batched_prefills`` and (verification steps) ``batched_verify_steps``, ``unbatched_verify_steps``.
    """

    def __init__(self, model: Any, *, batched: bool, batched_prefill: bool, totals: dict[str, int]):
        self.model = model
        self.batched = batched
        self.batched_prefill = batched_prefill
        self.totals = totals

    @property
    def mrope(self) -> bool:
        """The model places tokens by 3-D positions (M-RoPE): each step binds its rows' image spans."""
        return getattr(self.model, "mrope_positions", None) is not None

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan``'s forwards and sampling: its prefill chunks (one forward each, or all in one when
        ``plan.together``), else its decode rows (one forward, then each row's token under its grammar mask, the
        masks computed once the forward is queued), or a verification step's rows (one forward over every row's
        input and proposal, then each row's accepted tokens, :mod:`mlxkv.engine.verify_rows`). A failed forward is
        returned as ``error``, not raised. A model with 3-D positions (M-RoPE) sees each row's image spans, bound to
        its sequence for the step (:mod:`mlxkv.vision.mrope`)."""
        out = StepOutput()
        if not self.mrope:
            return self._execute(plan, out)
        rows = [(c.task.seq.caches, c.task.job.request.media) for c in plan.prefills] + \
            [(c.seq.caches, c.job.request.media) for c in plan.decode]
        with bound_rows(self.model, rows):
            return self._execute(plan, out)

    def _execute(self, plan: StepPlan, out: StepOutput) -> StepOutput:
        try:
            if plan.together and not any(_has_images(c) for c in plan.prefills):
                last = self.prefill_together([c.task.seq for c in plan.prefills], [c.tokens for c in plan.prefills])
                out.prefill_logits = [last[b : b + 1] if c.want_logits else None for b, c in enumerate(plan.prefills)]
            elif plan.prefills:
                out.prefill_logits = [self.prefill(c.task.seq, c.tokens, c.want_logits, c.task.job.request.media,
                                                   c.start) for c in plan.prefills]
            elif plan.drafts:
                rows = [[c.next_input, *d] for c, d in zip(plan.decode, plan.drafts)]
                logits = self.forward_rows([c.seq for c in plan.decode], rows)  # (B, Lmax, vocab)
                masks = plan.masks(logits[:, 0, :]) if plan.masks is not None else None
                out.committed = verify_rows(logits, plan.drafts, [c.sampler for c in plan.decode], masks,
                                            out.row_errors, plan.draft_logprobs)
            elif plan.decode:
                logits = self.forward([c.seq for c in plan.decode], plan.decode_inputs, plan.prompt_tails)  # (B, vocab)
                masks = plan.masks(logits) if plan.masks is not None else None
                out.tokens = self.sample(logits, [c.sampler for c in plan.decode], masks, out.row_errors)  # (B,)
        except Exception as exc:  # noqa: BLE001 - the scheduler fails the requests the forward touched
            out.error = exc
        return out

    def prefill(self, seq: Any, tokens: Sequence[int], want_logits: bool, media: Sequence[ImageSpan] = (),
                start: int = 0) -> mx.array | None:
        """``tokens`` through the model into ``seq``'s caches, evaluated; the last position's logits
        ``(1, vocab)`` when ``want_logits`` (a request's first token is sampled from them), else None. ``media``:
        the prompt's images, ``start``: the prompt position of ``tokens[0]``; image placeholders in the chunk go in
        as their image's features (input embeddings)."""
        at = seq.offset
        seq.reserve(at, at + len(tokens))  # paged: the step's slots and metadata, built and checked before the forward
        chunk = mx.array(list(tokens), dtype=mx.uint32)
        embeddings = chunk_embeddings(self.model, chunk, start, media) if media else None  # (1, n, hidden)
        if embeddings is None:
            logits = self.model(chunk[None], cache=seq.caches)  # (1, n, vocab)
        else:
            logits = self.model(chunk[None], cache=seq.caches, input_embeddings=embeddings)
        last = logits[:, -1, :] if want_logits else None
        # a pipeline-parallel rank's caches do not need the hidden state it sends on: its outputs do
        outputs = [logits] if getattr(self.model, "eval_outputs", False) else [last] if last is not None else []
        mx.eval(cache_arrays(seq.caches), *outputs)
        return last

    def prefill_together(self, seqs: Sequence[Any], chunks: Sequence[Sequence[int]]) -> mx.array:
        """Each chunk into its sequence's caches in one forward; the logits at each chunk's last token
        ``(B, vocab)``, evaluated with the caches.

        Raises:
            BatchUnsupported: the model's layers cannot be batched (batched prefill is then off for good; the
                caches may have been written: rewind them before running the chunks one by one).
        """
        try:
            last = prefill_together(self.model, [s.caches for s in seqs], chunks)
        except BatchUnsupported:
            self.batched_prefill = False
            raise
        self.totals["batched_prefills"] += 1
        return last

    def decode(self, seqs: Sequence[Any], inputs: mx.array, samplers: Sequence[RowSampler],
               masks: Sequence[np.ndarray | None] | None = None) -> mx.array:
        """One decode step: :meth:`forward` then :meth:`sample`; returns the tokens ``(B,)`` uint32."""
        return self.sample(self.forward(seqs, inputs), samplers, masks)

    def forward(self, seqs: Sequence[Any], inputs: mx.array, prompt_tails: Sequence[list[int]] = ()) -> mx.array:
        """Token ``inputs[b]`` ``(B, 1)`` appended to ``seqs[b]``; the next-token logits ``(B, vocab)`` (lazy).
        ``prompt_tails[b]`` (if given): prompt tokens row b feeds before its input, in the same forward."""
        if any(prompt_tails):
            return self._forward_tails(seqs, inputs, prompt_tails)
        return self._forward(seqs, inputs)

    def _forward_tails(self, seqs: Sequence[Any], inputs: mx.array, tails: Sequence[list[int]]) -> mx.array:
        """A decode step some of whose rows end a prompt: row b is ``tails[b]`` then ``inputs[b]``, right-padded with
        that input (lazy: an in-flight token stays unread), in one forward through batched prefill views; each row's
        logits at its input ``(B, vocab)``. Row by row where the layers cannot be batched."""
        lengths = [len(t) + 1 for t in tails]
        width = max(lengths)
        batch = mx.stack([mx.concatenate([mx.array(tail, dtype=mx.uint32), inputs[b], mx.repeat(inputs[b], width - n)])
                          for b, (tail, n) in enumerate(zip(tails, lengths))])  # (B, Lmax)
        if self.batched and len(seqs) > 1:
            try:
                logits = forward_inputs(self.model, [s.caches for s in seqs], batch, lengths)  # (B, Lmax, vocab)
            except BatchUnsupported:
                pass  # raised before any cache was written
            else:
                self.totals["batched_steps"] += 1
                return last_rows(logits, lengths)
        self.totals["unbatched_steps"] += 1
        return mx.concatenate([self.model(batch[b : b + 1, : lengths[b]], cache=s.caches)[:, -1, :]
                               for b, s in enumerate(seqs)], axis=0)  # (B, vocab)

    def forward_rows(self, seqs: Sequence[Any], rows: Sequence[Sequence[int]]) -> mx.array:
        """Row ``rows[b]`` (its decode input and proposed tokens, ragged) appended to ``seqs[b]``; every position's
        logits ``(B, Lmax, vocab)`` (lazy; row b's first ``len(rows[b])`` are real). One forward through batched
        prefill views where every layer allows it (full attention, unquantized pages), else one forward per row."""
        width = max(len(r) for r in rows)
        if self.batched and len(seqs) > 1:
            try:
                logits = forward_together(self.model, [s.caches for s in seqs], rows)  # (B, Lmax, vocab)
            except BatchUnsupported:
                pass  # raised before any cache was written
            else:
                self.totals["batched_verify_steps"] += 1
                return logits
        self.totals["unbatched_verify_steps"] += 1
        outs = []
        for s, r in zip(seqs, rows):
            logits = self.model(mx.array(list(r), dtype=mx.uint32)[None], cache=s.caches)  # (1, len(r), vocab)
            if len(r) < width:
                logits = mx.concatenate([logits, mx.repeat(logits[:, -1:], width - len(r), axis=1)], axis=1)
            outs.append(logits)
        return mx.concatenate(outs, axis=0)  # (B, Lmax, vocab)

    def sample(self, logits: mx.array, samplers: Sequence[RowSampler],
               masks: Sequence[np.ndarray | None] | None = None,
               failed: dict[int, BaseException] | None = None) -> mx.array:
        """Each row's next token from ``logits`` ``(B, vocab)`` by its own sampler, under its grammar mask if it has
        one (:func:`~mlxkv.engine.row_sampler.sample_rows`); returns the tokens ``(B,)`` uint32, handed to MLX with
        ``async_eval`` together with what the samplers recorded (read them later: building the next step may
        overlap their evaluation). ``failed``: rows whose sampler raised go there (see
        :func:`~mlxkv.engine.row_sampler.sample_rows`) instead of failing every row."""
        tokens = sample_rows(logits, list(samplers), masks, failed)  # (B,)
        mx.async_eval(tokens, *lazy_outputs(samplers))
        return tokens

    def _forward(self, seqs: Sequence[Any], inputs: mx.array) -> mx.array:
        if self.batched and len(seqs) > 1:
            views: list = []
            try:
                views = make_batch_views([s.caches for s in seqs])
                logits = self.model(inputs, cache=views)[:, -1, :]  # (B, vocab)
            except BatchUnsupported:
                if any(getattr(v, "_fetched", None) is not None for v in views):
                    raise  # caches were written: this step cannot be redone
                self.totals["unbatched_steps"] += 1
            else:
                check_attended(views)
                self.totals["batched_steps"] += 1
                return logits
        rows = [self.model(inputs[b : b + 1], cache=s.caches)[:, -1, :] for b, s in enumerate(seqs)]
        return mx.concatenate(rows, axis=0)  # (B, vocab)

    @staticmethod
    def sample_first(last_logits: mx.array, samplers: Sequence[RowSampler],
                     masks: Sequence[np.ndarray | None] | None = None) -> list[int]:
        """The first token of each of ``samplers``' sequences from one prompt's last logits ``(1, vocab)`` (under
        each one's grammar mask, if any)."""
        logits = mx.broadcast_to(last_logits, (len(samplers), last_logits.shape[-1]))  # (n, vocab)
        tokens = sample_rows(logits, list(samplers), masks)  # (n,)
        mx.eval(tokens, *lazy_outputs(samplers))
        return tokens.tolist()
