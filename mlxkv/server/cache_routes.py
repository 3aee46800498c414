"""The KV cache over HTTP: ``/v1/cache/stats``, ``/v1/cache/blocks``, ``/v1/cache/reset`` and ``/v1/cache/events``.

``GET /v1/cache/blocks`` is the block pool as a picture: each block's state, owner and priority, and the prefix tree
of cached chains with hit counts and text, filtered per viewer (``?cache_salt=``: the viewer's own prompts; see
cache_view.py). The built-in page and ``mlxkv top`` draw it.

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

import concurrent.futures
import json
import time
from typing import AsyncIterator, Optional

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import EngineStoppedError
from mlxkv.server.compat import DEFAULT_KEEPALIVE_S, KEEPALIVE_EVENT
from mlxkv.server.auth import key_matches, request_key
from mlxkv.server.cache_view import viewer, viewer_view
from mlxkv.server.errors import APIError
from mlxkv.server.tenancy import CacheResetRequest, reset_scope

#: How often an events stream looks for new events (seconds).
EVENTS_POLL_S = 0.1
#: Event numbers are counted in a 63-bit range: a larger cursor cannot name an event.
MAX_CURSOR = 2**63 - 1
MAX_CURSOR_DIGITS = len(str(MAX_CURSOR))
#: Viewers asking within this many seconds of the last block map get that one: the engine draws it between steps
#: in O(blocks) (~18 ms for 16K blocks), once however many pages and ``mlxkv top`` watch.
BLOCK_MAP_REUSE_S = 0.5
#: How long a viewer waits for the engine to reach a step boundary and draw the map.
BLOCK_MAP_TIMEOUT_S = 10.0


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
    taken: list = [float("-inf"), None]  # when the engine last drew the block map, and the map

    @router.get("/cache/stats")
    async def cache_stats() -> dict:
        return engine.stats()

    @router.get("/cache/blocks")
    async def cache_blocks(request: Request, cache_salt: str | None = None) -> dict:
        if cache_salt is not None and not 1 <= len(cache_salt) <= 256:
            raise APIError(400, "cache_salt must be 1 to 256 characters", "invalid_value", "cache_salt")
        if time.monotonic() - taken[0] >= BLOCK_MAP_REUSE_S:
            taken[:] = [time.monotonic(), await _block_map(engine)]
        raw = taken[1]
        if raw is None:
            return {"paged": False}
        stats = engine.stats().get("kv_blocks", {})
        sees_all, scope = viewer(request, cache_salt, admin_key)
        view = await run_in_threadpool(viewer_view, raw, sees_all=sees_all, scope=scope, decode=_decoder(engine))
        return {"paged": True, "block_size": stats.get("block_size"), "total": len(raw["states"]), **view}

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


async def _block_map(engine: BatchEngine) -> dict | None:
    """The engine's block map, or a 503 when the engine is stopped or does not answer between two steps in time."""
    try:
        return await run_in_threadpool(engine.block_map, BLOCK_MAP_TIMEOUT_S)
    except EngineStoppedError as exc:
        raise APIError(503, str(exc), "engine_stopped") from None
    except concurrent.futures.TimeoutError:
        raise APIError(503, f"the engine did not draw the block map within {BLOCK_MAP_TIMEOUT_S:g} s (a long step "
                            "or a stop under way); try again", "engine_busy") from None


def _decoder(engine: BatchEngine):
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return lambda ids: ""
    return lambda ids: tokenizer.decode(ids)


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
