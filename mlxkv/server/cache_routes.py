"""The KV cache over HTTP: ``/v1/cache/stats``, ``/v1/cache/reset`` and ``/v1/cache/events``.

``POST /v1/cache/reset`` takes an optional ``{"cache_salt": ...}`` that limits it to one tenant's blocks (see
tenancy.py). On a server with an admin key, a reset of every tenant and the events stream (which carries every
tenant's block hashes and token ids) need that key; on a multi-tenant server the events stream always does.

``GET /v1/cache/events`` streams the block manager's events as server-sent events: each has ``id:`` its sequence
number, ``event:`` its type (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) and ``data:`` its JSON
(block hashes in hex). A reader resumes after the last number it saw with ``?since=N`` or the standard
``Last-Event-ID`` header (which browsers' EventSource sends on reconnect); events the bounded buffer no longer
holds are announced by one ``EventsDropped`` event carrying how many. The stream is what a client asking for
``Accept: text/event-stream`` (as EventSource does) or ``?stream=true`` gets; any other request gets what is held
now as one JSON object (``{"events", "cursor", "dropped"}``; ``?stream=false`` forces it). The stream ends when
the server stops.
"""

from __future__ import annotations

import json
import time
from typing import AsyncIterator, Optional

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from mlxkv.engine.batch import BatchEngine
from mlxkv.server.compat import DEFAULT_KEEPALIVE_S, KEEPALIVE_EVENT
from mlxkv.server.auth import key_matches, request_key
from mlxkv.server.errors import APIError
from mlxkv.server.tenancy import CacheResetRequest, reset_scope

#: How often an events stream looks for new events (seconds).
EVENTS_POLL_S = 0.1
#: Event numbers are counted in a 63-bit range: a larger cursor cannot name an event.
MAX_CURSOR = 2**63 - 1
MAX_CURSOR_DIGITS = len(str(MAX_CURSOR))


def _cursor(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        n = int(value) if len(value) <= MAX_CURSOR_DIGITS else -1
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_CURSOR:
        raise APIError(400, f"{name} must be an event sequence number (an integer in [0, 2**63)), got "
                       f"{value[:40]!r}", "invalid_value", name)
    return n


def _sse(event: dict) -> str:
    return f"id: {event['seq']}\nevent: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def cache_router(engine: BatchEngine, *, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 admin_key: str | None = None, multi_tenant: bool = False) -> APIRouter:
    """The cache routes over ``engine`` (mounted under /v1, behind its API key; ``admin_key``: see above;
    ``multi_tenant``: the server's keys name several tenants, whose blocks the events stream must not show to
    one another: it then needs the admin key, and is refused on a server without one)."""
    router = APIRouter()

    @router.get("/cache/stats")
    async def cache_stats() -> dict:
        return engine.stats()

    @router.post("/cache/reset")
    async def cache_reset(request: Request, body: Optional[CacheResetRequest] = None) -> dict:
        salt = reset_scope(body, request, admin_key, key_matches(request_key(request), admin_key))
        freed = await run_in_threadpool(engine.reset_cache, 60.0, salt)
        return {"reset": True, "scope": "all" if salt is None else "tenant", **freed}

    @router.get("/cache/events")
    async def cache_events(request: Request, since: str | None = None) -> object:
        if (admin_key is not None or multi_tenant) and not key_matches(request_key(request), admin_key):
            raise APIError(403, "the KV events stream shows every tenant's blocks: it needs the admin key"
                           + ("" if admin_key else " (start the server with --admin-key)"), "admin_key_required")
        stream = request.query_params.get("stream")
        if stream is None:
            stream = "true" if "text/event-stream" in request.headers.get("accept", "") else "false"
        if stream not in ("true", "false"):
            raise APIError(400, f"stream must be true or false, got {stream!r}", "invalid_value", "stream")
        start = _cursor(since, "since")
        if start is None:
            start = _cursor(request.headers.get("last-event-id"), "Last-Event-ID") or 0
        first = engine.kv_events(start)
        if first is None:
            raise APIError(400, "KV events need the paged KV backend (--kv-backend paged)", "kv_events_unavailable")
        if stream == "false":
            return first
        return StreamingResponse(_events(request, engine, first, keepalive_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router


async def _events(request: Request, engine: BatchEngine, batch: dict, keepalive_s: float) -> AsyncIterator[str]:
    last_write = time.monotonic()
    while True:
        parts = []
        if batch["dropped"]:
            parts.append(f"event: EventsDropped\ndata: {json.dumps({'dropped': batch['dropped']})}\n\n")
        parts += [_sse(e) for e in batch["events"]]
        if parts:
            yield "".join(parts)
            last_write = time.monotonic()
        elif time.monotonic() - last_write >= keepalive_s:
            yield KEEPALIVE_EVENT
            last_write = time.monotonic()
        if engine.draining or await request.is_disconnected():
            return
        await anyio.sleep(EVENTS_POLL_S)
        batch = engine.kv_events(batch["cursor"])
