"""Output handling: tokens become text (streaming detokenizer, stop strings, EOS, the token limit), and events
reach their consumers on asyncio event loops.

The direct engine (``mlxkv generate``) and the batch engine (``mlxkv serve``) both turn tokens into text through
:class:`TextStream`, so a request ends on the same token with the same text whichever engine serves it.

Delivery: each ``loop.call_soon_threadsafe`` writes to the loop's self-pipe and costs the loop a wake-up, and every
wake-up makes the loop thread take the GIL back from the engine thread (up to a switch interval each time). A
decode step emits one event per running sequence, so a :class:`LoopDelivery` queues events and keeps at most one
drain scheduled; inside :func:`batched_wakeups` (the engine wraps each step in it) no loop is woken until the block
ends, then each loop once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence


class StopStringMatcher:
    """Feeds on streamed text segments and says what may be shown and whether a stop string appeared.

    Text that could be the beginning of a stop string is held back until the next segment settles it,
    so a stop string is never partially printed.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, segment: str) -> str:
        """Add ``segment``; return the text now safe to emit (stops once a stop string is seen)."""
        if self.stopped:
            return ""
        if not self.stops:
            return segment
        text = self._pending + segment
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        hold = self._held_suffix(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of generation: the held-back text (it never completed a stop string)."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class TextStream:
    """Turns a choice's tokens into safe-to-show text and says when the choice is finished.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``None``: tokens only, no text and no EOS).
        stop: stop strings (never emitted, even in part).
        max_tokens: the choice finishes with ``"length"`` at this many tokens.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], max_tokens: int):
        assert max_tokens >= 1, max_tokens
        self._detok = tokenizer.detokenizer if tokenizer is not None else None  # a fresh copy per call
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        self._stops = StopStringMatcher(stop)
        self.max_tokens = max_tokens
        self.count = 0

    def prime(self, tokens: Sequence[int]) -> None:
        """``tokens`` were shown already (a response prefilled into the prompt): the detokenizer reads them, so
        the first generated token's text continues theirs (its leading space kept), and their text is dropped."""
        if self._detok is None or not tokens:
            return
        for token in tokens:
            self._detok.add_token(token)
        self._detok.last_segment  # noqa: B018 - consumed: their text is not this stream's

    def feed(self, token: int) -> tuple[str, str | None]:
        """Add the next generated token; return (new text, finish reason or ``None`` while running)."""
        self.count += 1
        if self._detok is None:
            return "", ("length" if self.count >= self.max_tokens else None)
        stops, detok = self._stops, self._detok
        if token in self._eos:
            detok.finalize()
            return stops.feed(detok.last_segment) + stops.flush(), "stop"
        detok.add_token(token)
        text = stops.feed(detok.last_segment)
        if stops.stopped:
            return text, "stop"
        if self.count >= self.max_tokens:
            detok.finalize()
            text += stops.feed(detok.last_segment)
            if stops.stopped:
                return text, "stop"
            return text + stops.flush(), "length"
        return text, None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request (``completion_tokens`` sums over the ``n`` choices)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (paged storage)
    draft_tokens: int | None = None  # speculative decoding: tokens proposed (None: the request did not speculate)
    accepted_draft_tokens: int = 0  # of those, accepted

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def speculative(self) -> dict[str, int] | None:
        """The ``usage`` extension of a request that speculated: tokens its choices proposed and accepted (None
        when it did not speculate)."""
        if self.draft_tokens is None:
            return None
        return {"proposed_tokens": self.draft_tokens, "accepted_tokens": self.accepted_draft_tokens}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its position (see
    :mod:`mlxkv.engine.logprobs` for the convention).

    ``top``: ``(token id, log-probability)`` pairs, most likely first; empty when none were asked for.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to a request.

    ``kind`` is ``"token"`` (choice ``index`` produced ``token``; ``text`` is the newly safe text, possibly
    empty; ``finish_reason`` is set on the choice's last token; ``logprob`` when the request asked for
    log-probabilities; the request's first token carries ``usage`` with no completion tokens yet, so a stream
    can report the prompt's cached share before the end), ``"done"`` (every choice finished; carries
    ``usage``; always the last event of a successful request) or ``"error"`` (the request failed or was
    cancelled; ``message`` says why; terminal).
    """

    kind: str
    index: int = 0
    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    message: str = ""
    logprob: TokenLogprob | None = None

    @property
    def terminal(self) -> bool:
        return self.kind in ("done", "error")


def emit_token(choice: Any, token: int, now: float, observer: Any) -> str | None:
    """Stream one generated token of a batch-engine choice to its request: its text through the choice's
    :class:`TextStream`, a token event (with the token's log-probability when its sampler records them), the
    request's timings (first token: ``observer``). Returns the finish
    reason when the choice is done, else None."""
    job = choice.job
    usage = None
    if job.first_token_at is None:
        job.first_token_at = now
        observer.on_first_token(now - job.submitted_at)
        usage = Usage(len(job.request.prompt), 0, job.cached_tokens)
    job.last_token_at = now
    job.completion_tokens += 1
    text, finish = choice.text.feed(token)
    logprob = choice.sampler.pop_logprob(token)
    job.handle.put(Event("token", index=choice.index, text=text, token=token, finish_reason=finish, logprob=logprob,
                         usage=usage))
    choice.generated.append(token)
    if finish is None:
        choice.next_input = token
    return finish


def end_event(job: Any) -> Any:
    """A finished request's terminal event, with its usage."""
    speculated = any(c.drafter is not None for c in job.choices)
    return Event("done", usage=Usage(len(job.request.prompt), job.completion_tokens, job.cached_tokens,
                                     job.draft_tokens if speculated else None, job.accepted_draft_tokens))


Deliver = Callable[[Any], None]  # runs on the loop: hands one event to its consumer
OnClosed = Callable[[], None]  # runs on the caller's thread: the loop is gone, the consumer never reads again


class LoopDelivery:
    """Events from any thread into one event loop, delivered in order, with at most one drain scheduled.

    Attributes:
        wakeups: drains scheduled on the loop so far (one per burst of events).
        delivered: events handed to their consumers so far.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # weak: the registry below is keyed weakly by the loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Deliver, OnClosed, Any]] = []  # guarded by _lock
        self._scheduled = False  # a drain is scheduled and has not taken the pending events yet (by _lock)
        self.wakeups = 0
        self.delivered = 0

    def put(self, deliver: Deliver, on_closed: OnClosed, event: Any) -> None:
        """Queue ``deliver(event)`` to run on the loop; wake the loop unless a drain is already scheduled or
        the calling thread is inside :func:`batched_wakeups`. If the loop has closed, ``on_closed()`` runs
        (on this thread) for every event still queued."""
        with self._lock:
            self._pending.append((deliver, on_closed, event))
        held = getattr(_held, "deliveries", None)
        if held is not None:
            held[id(self)] = self
        else:
            self.wake()

    def wake(self) -> None:
        """Schedule a drain if events are pending and none is scheduled."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
            self.wakeups += 1
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will ever read these
            with self._lock:
                dropped, self._pending, self._scheduled = self._pending, [], False
            for _, closed, _ in dropped:
                closed()

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for deliver, _, event in batch:
            deliver(event)
        self.delivered += len(batch)


_held = threading.local()  # .deliveries: {id: LoopDelivery} put to inside the current batched_wakeups block


@contextlib.contextmanager
def batched_wakeups() -> Iterator[None]:
    """Within this block, events put on this thread queue up; each loop that got some is woken once at the end."""
    if getattr(_held, "deliveries", None) is not None:  # nested: the outer block wakes
        yield
        return
    _held.deliveries = {}
    try:
        yield
    finally:
        deliveries, _held.deliveries = _held.deliveries, None
        for delivery in deliveries.values():
            delivery.wake()


def flush_wakeups() -> None:
    """Inside a :func:`batched_wakeups` block: wake now each loop that got events so far (first tokens sampled
    by a prefill reach their clients before the step's decode runs); the block goes on holding later events."""
    deliveries = getattr(_held, "deliveries", None)
    if deliveries:
        _held.deliveries = {}
        for delivery in deliveries.values():
            delivery.wake()


_deliveries: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDelivery]" = weakref.WeakKeyDictionary()
_deliveries_lock = threading.Lock()


def delivery_for(loop: asyncio.AbstractEventLoop) -> LoopDelivery:
    """The :class:`LoopDelivery` of ``loop``, shared by every request whose events go to that loop."""
    with _deliveries_lock:
        delivery = _deliveries.get(loop)
        if delivery is None:
            delivery = _deliveries[loop] = LoopDelivery(loop)
        return delivery
