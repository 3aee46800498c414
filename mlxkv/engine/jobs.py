"""What a request is inside the engine: a :class:`Job` (one request), its :class:`Choice` s (the sequences it
decodes, ``n`` of them) and :class:`Prefill` tasks (a sequence being prefilled), and the timings observer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlxkv.engine.request import GenerationRequest, RequestHandle, Usage
from mlxkv.engine.row_sampler import RowSampler
from mlxkv.engine.text_stream import TextStream
from mlxkv.kv.store import Sequence


class EngineObserver:
    """Receives per-request timings from the engine thread (the server's metrics implement it)."""

    def on_first_token(self, seconds: float) -> None:
        """Time from submission to the first generated token of a request."""

    def on_request_finished(self, finish_reason: str, usage: Usage, time_per_output_token: float | None) -> None:
        """A request ended; ``time_per_output_token`` is ``None`` with fewer than two tokens per choice."""


@dataclass(eq=False)
class Job:
    """A request inside the scheduler."""

    request: GenerationRequest
    handle: RequestHandle
    max_tokens: int  # per choice, already capped by the context length (and the paged KV budget)
    submitted_at: float = field(default_factory=time.perf_counter)
    opened: list[Sequence] = field(default_factory=list)  # every sequence opened for it: released at the end
    choices: list[Choice] = field(default_factory=list)
    open_choices: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its first open (paged)
    queried: bool = False  # cached_tokens is set
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False


@dataclass(eq=False)
class Choice:
    """One sequence being decoded: choice ``index`` of its job."""

    job: Job
    index: int
    seq: Sequence | None
    sampler: RowSampler
    text: TextStream
    next_input: int  # the last token emitted (or the prompt's last): what the next decode step feeds
    generated: list[int] = field(default_factory=list)  # tokens emitted so far (a resume recomputes them)
    fresh: bool = True  # next_input is the last token of what was opened: the manager knows it (no feed)
    done: bool = False
    # Overlapped decode: the token the last step sampled for this choice, not read yet — ``(tokens, row)``; the
    # next step feeds it lazily. ``placeholder_at``: the position the manager holds it at under PLACEHOLDER.
    in_flight: tuple[mx.array, int] | None = None
    placeholder_at: int | None = None


@dataclass(eq=False)
class Prefill:
    """A sequence being prefilled: ``tokens[:-1]`` go into its cache, ``tokens[-1]`` is the first decode input.

    ``choice`` is None for a job's first sequence (its choices are made when it finishes); else the choice
    this sequence serves (a parallel sample's own sequence, or a preempted choice resuming).
    ``seats``: sequences it stands for in ``max_sequences`` (``n`` for a job's first sequence).
    """

    job: Job
    tokens: list[int]
    choice: Choice | None = None
    seats: int = 1
    seq: Sequence | None = None  # None while waiting to be (re)opened
    done: int = 0  # tokens in the cache


#: The manager's id for a fed token whose value an overlapped step is still computing (named before commit).
PLACEHOLDER = -1
