"""What a client hands the batch engine, and what it gets back: requests, events and the handle between them.

Pure Python (no MLX): the server builds :class:`GenerationRequest` objects on its own threads and reads
:class:`Event` objects from a :class:`RequestHandle`, while only the engine thread runs the model.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

from mlxkv.engine.output import Event, Usage, delivery_for
from mlxkv.engine.sampling import SamplingParams
from mlxkv.structured.response_format import ResponseFormat

__all__ = ["DEFAULT_RETENTION_PRIORITY", "MAX_TOP_LOGPROBS", "EngineStoppedError", "Event", "GenerationRequest",
           "PromptTooLongError", "QueueFullError", "RequestHandle", "RetentionRange", "RetentionSpec", "Usage"]

#: Most alternatives per token a request may ask for (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: Retention priorities run 0-100; TensorRT-LLM's default for blocks without a rule is 35.
DEFAULT_RETENTION_PRIORITY = 35
_request_ids = itertools.count(1)


class QueueFullError(RuntimeError):
    """The engine's admission queue holds ``max_queue_depth`` requests already."""


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context (``max_position_embeddings``)."""


class EngineStoppedError(RuntimeError):
    """The engine is not running (not started yet, or stopped)."""


@dataclass(frozen=True, slots=True)
class RetentionRange:
    """Keep the KV of prompt tokens ``[start, end)`` at ``priority`` for ``duration`` seconds.

    ``end=None`` runs to the end of the prompt; ``duration=None`` keeps the priority for as long as the blocks
    live. Acts on the paged backend's blocks (the block manager's eviction order); unused with dense storage.
    """

    start: int
    end: int | None
    priority: int
    duration: float | None = None

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"retention range start must be >= 0, got {self.start}")
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"retention range end must be > start ({self.start}), got {self.end}")
        if not 0 <= self.priority <= 100:
            raise ValueError(f"retention priority must be in 0-100, got {self.priority}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"retention duration must be > 0 seconds, got {self.duration}")


@dataclass(frozen=True, slots=True)
class RetentionSpec:
    """Retention rules of one request: prompt token ranges, then the priority of generated (decode) tokens."""

    ranges: tuple[RetentionRange, ...] = ()
    decode_priority: int = DEFAULT_RETENTION_PRIORITY
    decode_duration: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.decode_priority <= 100:
            raise ValueError(f"decode priority must be in 0-100, got {self.decode_priority}")
        if self.decode_duration is not None and self.decode_duration <= 0:
            raise ValueError(f"decode duration must be > 0 seconds, got {self.decode_duration}")
        ordered = sorted(self.ranges, key=lambda r: r.start)
        for a, b in zip(ordered, ordered[1:]):
            if a.end is None or a.end > b.start:
                raise ValueError(f"retention ranges overlap: [{a.start}, {a.end}) and [{b.start}, {b.end})")


@dataclass(slots=True)
class GenerationRequest:
    """One completion request for the batch engine.

    Attributes:
        prompt: prompt token ids (already templated and encoded).
        params: sampling and stopping settings shared by the ``n`` choices.
        n: parallel samples of the prompt (prefilled once; dense: the caches are copied, paged: each sample's
            sequence takes the prompt's cached blocks).
        cache_salt: isolates prefix-cache sharing to requests with the same salt (paged storage).
        cache_salt_ranges: ``(start, end, salt)`` prompt token ranges whose blocks (and, through the chained
            hash, every later block) are shared only with requests naming the same salt over the same range: a
            system prompt left unsalted (or under a shared salt) is shared across tenants, the rest is not.
        retention: KV retention rules (paged storage).
        priority: admission order: lower values are admitted first, ties in arrival order; paged storage
            preempts sequences of higher values (then newer ones) first when blocks run out.
        logprobs: report each generated token's log-probability and this many most likely alternatives (0-20;
            ``None``: none), on its token event (:mod:`mlxkv.engine.logprobs` says which distribution).
        response_format: constrain every choice's output to this format's grammar (``None`` or ``text``: free).
            Each choice follows its own copy of the grammar; EOS is allowed once its document is complete. The
            tokenizer's grammar vocabulary is built at the first constrained request if nobody built it before
            (seconds for a large vocabulary, on the engine thread: the server builds it ahead).
        snapshot_at: prompt token positions worth a recurrent-state snapshot (the end of each chat message): a
            model with recurrent layers on paged storage snapshots at the last block boundary at or before each,
            so prompts sharing those messages (a system prompt) resume there. Ignored by other models.
        logits_processors: mlx-lm logits processors applied to every choice after the penalties and logit bias of
            ``params`` (callers inside the process: ``mlxkv generate``; the HTTP routes never set them).
        media: the images in the prompt (:class:`mlxkv.vision.spans.ImageSpan`): their placeholder tokens prefill
            with the images' features as input embeddings, and their keys enter the hashes of the blocks holding
            them and of every later block.
        kv_overflow: this request's per-sequence KV budget policy (a :class:`mlxkv.config.KvOverflowConfig`;
            ``None``: the engine's pool default, ``mlxkv serve --kv-overflow``); every choice gets it.
        num_draft_tokens: speculative decoding on an engine that drafts: tokens each choice proposes per step at
            most (0: this request does not speculate; ``None``: the engine's setting).
        request_id: identifies the request in logs and events.
    """

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    cache_salt: str | None = None
    cache_salt_ranges: tuple[tuple[int, int, str], ...] = ()
    retention: RetentionSpec | None = None
    priority: int = 0
    logprobs: int | None = None
    response_format: ResponseFormat | None = None
    snapshot_at: tuple[int, ...] = ()
    kv_overflow: Any = None
    logits_processors: tuple = ()
    media: tuple = ()
    num_draft_tokens: int | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")

    def __post_init__(self) -> None:
        if len(self.prompt) == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string when given")
        for start, end, salt in self.cache_salt_ranges:
            if not (isinstance(salt, str) and salt and 0 <= start < end and start < len(self.prompt)):
                raise ValueError(f"cache_salt_ranges: ({start}, {end}, {salt!r}) is not a non-empty range starting "
                                 f"inside the {len(self.prompt)}-token prompt with a non-empty salt")
        if any(not (isinstance(p, int) and 0 < p <= len(self.prompt)) for p in self.snapshot_at):
            raise ValueError(f"snapshot_at: positions must be in [1, {len(self.prompt)}], got {self.snapshot_at}")
        if any(not 0 <= m.start < m.end <= len(self.prompt) for m in self.media):
            raise ValueError(f"media: every image span must lie inside the {len(self.prompt)}-token prompt")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


class RequestHandle:
    """The client's side of a submitted request: iterate its events; ``cancel()`` to stop it.

    Events are delivered through a thread queue (iterate with ``for``), or into an asyncio loop when the
    handle was created with one (iterate with ``async for``; the loop is woken once per burst of events, see
    :mod:`mlxkv.engine.output`). Iteration ends after the terminal event.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self._loop = loop
        self._queue: queue.SimpleQueue[Event] | asyncio.Queue[Event]
        self._queue = asyncio.Queue() if loop is not None else queue.SimpleQueue()
        self._delivery = delivery_for(loop) if loop is not None else None
        self._cancelled = threading.Event()
        self._wake = lambda: None  # set by the engine: nudges an idle engine thread to look at us

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request at its next step and release its sequences (idempotent)."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()

    def put(self, event: Event) -> None:
        """Deliver ``event`` (engine thread only). A consumer whose event loop has closed is cancelled."""
        if self._delivery is None:
            self._queue.put(event)
            return
        self._delivery.put(self._queue.put_nowait, self._cancelled.set, event)

    def get(self, timeout: float | None = None) -> Event:
        """Next event (blocking; thread mode). Raises ``queue.Empty`` after ``timeout`` seconds."""
        assert self._loop is None, "this handle delivers into an event loop: use `await handle.aget()`"
        return self._queue.get(timeout=timeout)

    async def aget(self, timeout: float | None = None) -> Event:
        """Next event (asyncio mode). Raises ``asyncio.TimeoutError`` after ``timeout`` seconds."""
        assert self._loop is not None, "this handle delivers into a thread queue: use `handle.get()`"
        return await asyncio.wait_for(self._queue.get(), timeout)

    def empty(self) -> bool:
        """Whether no event is waiting (thread mode)."""
        assert self._loop is None, "this handle delivers into an event loop"
        return self._queue.empty()

    def get_nowait(self) -> Event | None:
        """The next event if one has arrived, else ``None`` (asyncio mode; call on the handle's loop)."""
        assert self._loop is not None, "this handle delivers into a thread queue: use `handle.get()`"
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            yield event
            if event.terminal:
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self.aget()
            yield event
            if event.terminal:
                return
