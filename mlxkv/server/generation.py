"""Submitting a request to the batch engine and reading its events back, for every API's routes.

What happens between a route's prepared request (:mod:`mlxkv.server.preparation`) and its answer is the same on
every route: :func:`submit` queues the request, then :func:`collect` waits for the whole answer while watching for a
client that went away, or :func:`bursts` hands a streaming response each burst of events as it arrives.

The engine's outcomes map onto HTTP errors here, once for every route (each API's shape is
:mod:`mlxkv.server.errors`'s): refusals at :func:`submit` (400 invalid or too long, 429 queue full, 503 stopped) and
a request's failed end (:func:`failure`: 503 ``server_shutting_down`` when a graceful stop ended it, else 500
``generation_failed``), whether it is answered whole or ends a stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from fastapi import Request

from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import (
    EngineStoppedError,
    Event,
    GenerationRequest,
    PromptTooLongError,
    QueueFullError,
    RequestHandle,
)
from mlxkv.server.errors import APIError
from mlxkv.server.shutdown import SHUTDOWN_CODE

#: How often a non-streaming request checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.25


def submit(engine: BatchEngine, build: Callable[[], GenerationRequest], *, prompt_param: str) -> RequestHandle:
    """Build the request and queue it on ``engine``, its events delivered into the running event loop.

    Args:
        engine: the batch engine.
        build: makes the request (its ``ValueError`` on invalid settings becomes a 400).
        prompt_param: the request field an over-long prompt is blamed on (``messages``, ``prompt``).

    Raises:
        APIError: 400 (invalid settings, prompt over the context), 429 (queue full), 503 (engine stopped).
    """
    try:
        return engine.submit(build(), loop=asyncio.get_running_loop())
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), "context_length_exceeded", prompt_param) from None
    except QueueFullError as exc:
        raise APIError(429, f"{exc}: retry later", "queue_full") from None
    except EngineStoppedError as exc:
        raise APIError(503, str(exc), "engine_stopped") from None
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from None


def failure(event: Event) -> APIError:
    """The HTTP error a request's failed terminal event (kind ``error``) stands for, on every route."""
    if event.finish_reason == "shutdown":  # a graceful stop ended the request
        return APIError(503, event.message, SHUTDOWN_CODE)
    return APIError(500, f"generation failed: {event.message}", "generation_failed")


async def collect(request: Request, handle: RequestHandle) -> list[Event] | None:
    """Every event of the request, the terminal one last; ``None`` if the client disconnected first (the request
    is then cancelled, as it is whenever this returns before the terminal event)."""
    events: list[Event] = []
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                event = await handle.aget(timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() >= next_check:  # tokens may arrive faster than the poll: check by the clock
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return None
            if event is not None:
                events.append(event)
                if event.terminal:
                    return events
    finally:
        if not events or not events[-1].terminal:
            handle.cancel()


async def bursts(handle: RequestHandle, idle_s: float | None = None) -> AsyncIterator[list[Event]]:
    """The request's events in bursts: each list holds every event that had arrived by then (a token as soon as
    it is sampled; under load a whole step's worth), so a stream pays one write per burst, not per event. With
    ``idle_s``, an empty list comes after each ``idle_s`` seconds without an event (the caller's cue for a
    keep-alive). Ends after the terminal event. The caller cancels the request when it stops early (a client
    disconnect closes its generator)."""
    ended = False
    while not ended:
        try:
            burst = [await handle.aget(timeout=idle_s)]
        except asyncio.TimeoutError:
            yield []
            continue
        while not burst[-1].terminal:
            event = handle.get_nowait()
            if event is None:
                break
            burst.append(event)
        ended = burst[-1].terminal
        yield burst
