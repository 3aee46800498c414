"""The decode step: one forward for every running choice, overlapped with reading the previous step's tokens.

The step is built from the previous step's sampled tokens while they are still being computed (fed lazily; paged
slots taken under a placeholder) and handed to MLX with ``async_eval``; only then are the previous tokens read,
named in the pool, and emitted — so building a step's graph overlaps the evaluation of the one before (on MLX's
CPU backend only partly: ``async_eval`` returns once all but the last few dozen operations have run). A step with
grammar-constrained rows reads the previous tokens between its forward and its sampling instead
(:mod:`mlxkv.engine.constraints`).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mlxkv.engine.constraints import step_masks
from mlxkv.engine.jobs import Choice
from mlxkv.engine.output import Event


class DecodeLoop:
    """The scheduler's decode steps and the tokens in flight between them.

    Args:
        scheduler: the :class:`~mlxkv.engine.scheduler.Scheduler` whose running choices decode (its
            room-making, preemption and emission are used as they are).
    """

    def __init__(self, scheduler: Any):
        self.s = scheduler
        self.in_flight: list[tuple[Choice, mx.array, int]] = []  # the last step's tokens, not read yet

    def _reserve(self) -> list[Choice]:
        """Paged: room for every running choice's next input, preempting as needed; returns who decodes."""
        for choice in list(self.s.running):
            if choice not in self.s.running or _ends_in_flight(choice):  # preempted meanwhile / nothing to feed
                continue
            if not self.s._make_room(choice.seq, 1):
                self.read_in_flight()  # (normally done already: _decode reads in-flight tokens first when blocks are short)
                if choice.done or choice.job.finished:
                    continue
                if len(self.s.pool) == 1:  # alone and still no room (a safety net: submit caps every request)
                    choice.job.handle.put(Event("token", index=choice.index, finish_reason="length"))
                    self.s._close_choice(choice, "length")
                else:
                    self.s._preempt_choice(choice)
                continue
            if choice.input_known_to_pool:  # the opened tokens' last: known to the pool, its slot only is taken
                choice.seq.reserve_last()
            elif choice.in_flight is not None:  # its value is still being computed: named when it is read
                choice.placeholder_at = choice.seq.feed_placeholder()
            else:
                choice.seq.feed([choice.next_input])
            choice.input_known_to_pool = False
        return [c for c in self.s.running if not _ends_in_flight(c)]

    def step(self) -> None:
        """One decode step for every running choice, overlapped with reading the previous step's tokens (module
        doc). When room is short, the previous tokens are read first: a preemption must see every emitted token.
        A step that computes some request's first token (a prompt that joined the decode batch) is read at once.
        """
        if self.in_flight and not self.s.pool.has_decode_headroom(len(self.s.running)):
            self.read_in_flight()
        choices = self._reserve() if self.s.pool.is_paged else [c for c in self.s.running if not _ends_in_flight(c)]
        if not choices:
            self.read_in_flight()
            return
        self.s.totals["decode_steps"] += 1
        self.s.totals["max_batch"] = max(self.s.totals["max_batch"], len(choices))
        try:
            logits = self.s.runner.forward([c.seq for c in choices], _decode_inputs(choices))  # (B, vocab)
            if self.in_flight and any(c.constraint is not None for c in choices):
                # A grammar's mask follows its row's previous token: the forward is queued, then the previous
                # tokens are read (emitted, so consumed by their grammars) and the masks computed while it runs.
                mx.async_eval(logits)
                self.s.totals["overlapped_steps"] += 1
                self.read_in_flight()
            masks = step_masks(choices, logits.shape[-1], self.s._fail)
            tokens = self.s.runner.sample(logits, [c.sampler for c in choices], masks)  # (B,)
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: fail the requests in it
            self.read_in_flight()
            for job in {id(c.job): c.job for c in choices}.values():
                self.s._fail(job, exc)
            return
        if self.in_flight:
            self.s.totals["overlapped_steps"] += 1
        self.read_in_flight()  # the previous step's tokens (named before this step's positions are committed)
        for b, c in enumerate(choices):
            if c.done or c.job.finished:
                continue  # closed by its previous token: this step's token is dropped
            c.seq.commit()
            c.in_flight = (tokens, b)
            self.in_flight.append((c, tokens, b))
        if any(c.job.first_token_at is None for c in choices):
            self.read_in_flight()  # a request's first token (its last prompt token joined this step): out now, not a step late

    def read_in_flight(self) -> None:
        """Read the last decode step's tokens; name the placeholders the step after it fed them under; emit."""
        if not self.in_flight:
            return
        flights, self.in_flight = self.in_flight, []
        values = {id(t): t.tolist() for _, t, _ in flights}  # one read per step's token array
        now = time.perf_counter()
        for choice, tokens, row in flights:
            token = values[id(tokens)][row]
            choice.in_flight = None
            if choice.done or choice.job.finished:
                continue
            try:
                if choice.placeholder_at is not None:
                    choice.seq.name_token(choice.placeholder_at, token)
                    choice.placeholder_at = None
                self.s._emit(choice, token, now)
            except Exception as exc:  # noqa: BLE001
                self.s._fail(choice.job, exc)


def _ends_in_flight(choice: Choice) -> bool:
    """Whether the choice's in-flight token is its last by length (no step is spent on what would follow it)."""
    return choice.in_flight is not None and len(choice.generated) + 1 >= choice.job.max_tokens


def _decode_inputs(choices: list[Choice]) -> mx.array:
    """The step's input tokens ``(B, 1)`` uint32: in-flight tokens lazily (without reading them), others as given."""
    flights = [c.in_flight for c in choices]
    first = flights[0]
    if first is not None and first[0].shape[0] == len(choices) and all(
            f is not None and f[0] is first[0] and f[1] == b for b, f in enumerate(flights)):
        return first[0][:, None]  # the whole previous batch, in order
    parts = [f[0][f[1]:f[1] + 1] if f is not None else mx.array([c.next_input], dtype=mx.uint32)
             for c, f in zip(choices, flights)]
    return mx.concatenate(parts)[:, None]
