"""What a request is inside the engine: a :class:`Job` (one request), its :class:`Choice` s (the sequences it
decodes, ``n`` of them) and :class:`Prefill` tasks (a sequence being prefilled), and the timings observer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxkv.engine.output import TextStream
from mlxkv.engine.request import GenerationRequest, RequestHandle, RetentionSpec, Usage
from mlxkv.engine.row_sampler import RowSampler
from mlxkv.kv import CacheRequest, RetentionConfig, Sequence
from mlxkv.structured.constraint import TokenConstraint
from mlxkv.vision.spans import hash_spans


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
    # An open sequence the request continues (dense): its caches hold the prompt's first ``offset`` tokens, only the
    # rest is prefilled, and it stays open when the request ends (a chat's conversation, kept from turn to turn).
    sequence: Sequence | None = None
    choices: list[Choice] = field(default_factory=list)
    open_choices: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its first open (paged)
    queried: bool = False  # cached_tokens is set
    draft_tokens: int = 0  # tokens its choices proposed (speculative decoding)
    accepted_draft_tokens: int = 0  # of those, verified and committed
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False

    def report(self, observer: EngineObserver, finish_reason: str) -> None:
        """Tell ``observer`` the request ended, with its usage and time per output token."""
        usage = Usage(len(self.request.prompt), self.completion_tokens, self.cached_tokens)
        tpot = None
        if self.first_token_at is not None and self.completion_tokens > len(self.choices) >= 1:
            per_choice = self.completion_tokens / len(self.choices)
            tpot = (self.last_token_at - self.first_token_at) / max(per_choice - 1, 1)
        observer.on_request_finished(finish_reason, usage, tpot)


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
    input_known_to_pool: bool = True  # next_input is the last token the sequence was opened with (no feed)
    # A prompt whose uncached end joined the decode batch: those tokens (all but the prompt's last, which is
    # next_input), fed before next_input by its first decode step (empty: none).
    prompt_tail: list[int] = field(default_factory=list)
    done: bool = False
    # Overlapped decode: the token the last step sampled for this choice, not read yet — ``(tokens, row)``; the
    # next step feeds it lazily. ``placeholder_at``: its position in the pool, named once it is read.
    in_flight: tuple[mx.array, int] | None = None
    placeholder_at: int | None = None
    # The grammar its output follows (``response_format``, forced tool calls), advanced by each emitted token
    # (:mod:`mlxkv.engine.constraints`); ``None`` when free, and once the choice is closed.
    constraint: TokenConstraint | None = None
    # Speculative decoding: its row drafter (:mod:`mlxkv.engine.speculation`; None: it does not propose).
    drafter: Any = None


@dataclass(eq=False)
class Prefill:
    """A sequence being prefilled.

    ``choice`` is None for a job's own sequence: it prefills every token and its choices (``n``) are made when it
    finishes; else the preempted choice this sequence resumes: ``tokens[:-1]`` go into its cache and
    ``tokens[-1]`` is its first decode input. ``sequences``: how many it stands for in ``max_sequences``.
    """

    job: Job
    tokens: list[int]
    choice: Choice | None = None
    sequences: int = 1
    seq: Sequence | None = None  # None until opened; a preempted sequence until it resumes
    done: int = 0  # tokens in the cache

    @property
    def first_from_prefill(self) -> bool:
        """A request's own sequence samples its first token from the last prompt position's logits; a resumed
        choice leaves its last token to its first decode step (it already has what that token predicts)."""
        return self.choice is None

    @property
    def target(self) -> int:
        """Tokens written before decoding starts."""
        return len(self.tokens) - (0 if self.first_from_prefill else 1)


def retention_config(spec: RetentionSpec | None) -> RetentionConfig | None:
    """The pool's retention rules for a request's ``retention`` (None: the default)."""
    if spec is None:
        return None
    return RetentionConfig(ranges=tuple((r.start, r.end, r.priority, r.duration) for r in spec.ranges),
                           decode_priority=spec.decode_priority, decode_duration_s=spec.decode_duration)


def cache_request(request: GenerationRequest) -> CacheRequest:
    """What ``request`` asks of the KV cache, whole: its salt and per-range salts, its images' keys, snapshot marks,
    retention, the preemption rank its ``priority`` gives (lower values are admitted first and preempted last) and its
    overflow policy."""
    return CacheRequest(salt=request.cache_salt,
                        spans=tuple((s, e, ("salt", k)) for s, e, k in request.cache_salt_ranges)
                        + hash_spans(request.media),
                        snapshot_at=request.snapshot_at, retention=retention_config(request.retention),
                        preemption_rank=-request.priority, overflow=request.kv_overflow)
