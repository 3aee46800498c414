"""Decode-step helpers: the tokens in flight between two decode steps, and a step's input tokens.

A decode step is built from the previous step's sampled tokens while they are still being computed (fed lazily;
paged slots taken under a placeholder) and handed to MLX with ``async_eval``; only then are the previous tokens read,
named in the pool, and emitted — so building a step's graph overlaps the evaluation of the one before (on MLX's
CPU backend only partly: ``async_eval`` returns once all but the last few dozen operations have run). A step with
grammar-constrained rows reads the previous tokens between its forward and its sampling instead
(:mod:`mlxkv.engine.constraints`). The scheduler plans the step (:meth:`~mlxkv.engine.scheduler.Scheduler.
schedule_decode`) and applies its output (:meth:`~mlxkv.engine.scheduler.Scheduler.update`); this module holds the
tokens between them.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from mlxkv.engine.jobs import Choice


class DecodeLoop:
    """The last decode step's sampled tokens, not read yet."""

    def __init__(self) -> None:
        self.in_flight: list[tuple[Choice, mx.array, int]] = []

    def hold(self, choice: Choice, tokens: mx.array, row: int) -> None:
        """``choice``'s token is row ``row`` of ``tokens`` ``(B,)``, still being computed."""
        choice.in_flight = (tokens, row)
        self.in_flight.append((choice, tokens, row))

    def read(self, on_token: Callable[[Choice, int, float], None]) -> None:
        """Read the held tokens (one read per step's token array) and hand each open choice's to ``on_token``."""
        if not self.in_flight:
            return
        flights, self.in_flight = self.in_flight, []
        values = {id(t): t.tolist() for _, t, _ in flights}
        now = time.perf_counter()
        for choice, tokens, row in flights:
            choice.in_flight = None
            if choice.done or choice.job.finished:
                continue
            on_token(choice, values[id(tokens)][row], now)


def ends_in_flight(choice: Choice) -> bool:
    """Whether the choice's in-flight token is its last by length (no step is spent on what would follow it)."""
    return choice.in_flight is not None and len(choice.generated) + 1 >= choice.job.max_tokens


def decode_inputs(choices: list[Choice]) -> mx.array:
    """The step's input tokens ``(B, 1)`` uint32: in-flight tokens lazily (without reading them), others as given."""
    flights = [c.in_flight for c in choices]
    first = flights[0]
    if first is not None and first[0].shape[0] == len(choices) and all(
            f is not None and f[0] is first[0] and f[1] == b for b, f in enumerate(flights)):
        return first[0][:, None]  # the whole previous batch, in order
    parts = [f[0][f[1]:f[1] + 1] if f is not None else mx.array([c.next_input], dtype=mx.uint32)
             for c, f in zip(choices, flights)]
    return mx.concatenate(parts)[:, None]
