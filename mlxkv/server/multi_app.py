"""The HTTP app of a server with several models (``mlxkv serve -m A -m B``): each request goes to the app of the
model it names (:mod:`mlxkv.server.model_registry`), loaded on first use.

Which model a request is for:

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` (and ``/count_tokens``), ``/v1/responses``:
  the body's ``model`` (none: the first model); a model not loaded is loaded first;
- ``/v1/cache/...`` and ``/metrics``: the ``model`` query parameter (none: the first model); the cache routes
  describe a loaded model (409 ``model_not_loaded`` otherwise) and never load one;
- ``/v1/responses/{id}``: the loaded model that stored that response.

A name the server does not serve gets 404 ``model_not_found`` in the route's API shape, after the API-key check (an
unauthenticated request never loads a model). This app answers ``/v1/models`` (every model and its ``state``),
``/health``, ``/metrics`` and the built-in page itself; each model's own app, built by
:func:`mlxkv.server.app.create_app` as for a one-model server, answers the rest.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, AsyncIterator, Callable, Sequence
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from mlxkv.server.auth import bearer_auth
from mlxkv.server.errors import APIError, error_response, install_error_handlers
from mlxkv.server.front_door import install_front_door
from mlxkv.server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from mlxkv.server.model_registry import ModelRegistry, ModelUnavailable
from mlxkv.server.tenancy import Tenants
from mlxkv.server.ui_routes import ui_router
from mlxkv.server.unicode_guard import reject_invalid_unicode

#: The routes whose body's ``model`` picks the model.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                              "/v1/responses"})


def create_multi_app(registry: ModelRegistry, *, tenants: Tenants | None = None,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                     allowed_origins: Sequence[str] = (), metrics_key: str | None = None,
                     public_metrics: bool = False, ui: bool = True) -> FastAPI:
    """The app serving ``registry``'s models (the options as :func:`mlxkv.server.app.create_app`'s; each model's
    own app is built with the same ones, except CORS, which this app's outermost layer answers for all)."""
    tenants = tenants or Tenants({})
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(registry.start)
        try:
            yield
        finally:
            await run_in_threadpool(registry.stop_all)

    app = FastAPI(title="mlxkv", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible local inference over mlxkv's continuous-batching engine.")
    install_error_handlers(app)
    app.add_middleware(ModelDispatch, registry=registry, auth=bearer_auth(tenants))
    install_front_door(app, tenants=tenants, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                       metrics_key=metrics_key, public_metrics=public_metrics, allowed_origins=allowed_origins)
    # every model's app describes the same routes: the API description is the first one built
    app.openapi = lambda: registry.openapi_schema or FastAPI.openapi(app)  # type: ignore[method-assign]

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "mlxkv",
                "state": registry.slots[name].state}

    def slot_named(name: str | None):
        name = registry.default if name is None else name
        if name not in registry.slots:
            raise APIError(404, unknown_model(registry, name), "model_not_found", "model")
        return registry.slots[name]

    @app.get("/health")
    async def health() -> JSONResponse:
        stopped = [s.name for s in registry.loaded() if not s.served.engine.alive]
        body = {"status": "ok" if not stopped else f"engine stopped: {', '.join(stopped)}",
                "models": {name: slot.state for name, slot in registry.slots.items()}}
        return JSONResponse(body, status_code=503 if stopped else 200)

    @app.get("/metrics")
    async def prometheus(model: str | None = None) -> Response:
        body, content_type = slot_named(model).metrics.render()
        return Response(body, media_type=content_type)

    if ui:
        app.include_router(ui_router())

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(tenants)), Depends(reject_invalid_unicode)])

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(name) for name in registry.slots]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return card(slot_named(model_id).name)

    app.include_router(v1)
    return app


def unknown_model(registry: ModelRegistry, name: str) -> str:
    return f"no model {name[:200]!r} here: this server serves {registry.describe()}"


class ModelDispatch:
    """ASGI middleware: hands each model's requests (see the module docstring) to that model's app, holding the
    model (loaded, not unloaded) until the response is sent; everything else goes on to this app's routes."""

    def __init__(self, app: Callable, registry: ModelRegistry, auth: Callable[[Request], None]):
        self.app = app
        self.registry = registry
        self.auth = auth

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/") or path.startswith("/v1/models"):
            await self.app(scope, receive, send)
            return
        try:
            self.auth(Request(scope))  # before anything is read or loaded
        except APIError as exc:
            await error_response(exc.status, exc.message, exc.code, exc.param, path=path)(scope, receive, send)
            return
        registry, load = self.registry, False
        if path in GENERATION_PATHS and scope.get("method") != "POST":
            await error_response(405, "Method Not Allowed", headers={"Allow": "POST"}, path=path)(scope, receive, send)
            return
        if path in GENERATION_PATHS:
            body = await _read_body(receive)
            if body is None:
                return  # the client went away
            name, load = _model_in(body) or registry.default, True
            receive = _replay(body, receive)
        elif path.startswith("/v1/responses/"):
            response_id = path.split("/")[3]
            name = next((s.name for s in registry.loaded()
                         if response_id in getattr(s.served.app.state, "responses_store", ())), registry.default)
        elif path.startswith("/v1/cache/"):
            name = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model") or [registry.default])[0]
        else:
            await self.app(scope, receive, send)  # not a route of any model: this app's 404
            return
        if name not in registry.slots:
            await error_response(404, unknown_model(registry, name), "model_not_found", "model",
                                 path=path)(scope, receive, send)
            return
        try:
            async with registry.use(name, load=load) as served:
                if served is not None:
                    # a copy: routing writes the route's function into the scope, and the connection keeps the
                    # scope after the response (keep-alive): it must not keep an unloaded model's engine alive
                    await served.app(dict(scope), receive, send)
                    return
        except ModelUnavailable as exc:
            await error_response(503, exc.message, exc.code, path=path)(scope, receive, send)
            return
        if path.startswith("/v1/responses/"):
            error = (404, f"no stored response {path.split('/')[3][:200]!r}", "response_not_found", "response_id")
        else:
            error = (409, f"model {name!r} is not loaded now (it loads at its first request)", "model_not_loaded",
                     "model")
        await error_response(*error, path=path)(scope, receive, send)


def _model_in(body: bytes) -> str | None:
    """The ``model`` a JSON request body names (``None``: none, or not a JSON object; the model's own app then
    answers what is wrong with the body)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


async def _read_body(receive: Callable) -> bytes | None:
    """The whole request body (its size already limited by :class:`~mlxkv.server.limits.BodySizeLimit`); ``None``
    when the client disconnects first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that gives ``body`` once, then listens to the client again (disconnects)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
