"""API-key check for the /v1 routes (``--api-key``, ``--api-keys-file`` or ``MLXKV_API_KEY``): ``Authorization:
Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's), which also tells the request's tenant
(:mod:`mlxkv.server.tenancy`); and :class:`KeyProtectedPaths`, which puts the operator's routes (``/metrics``,
``/docs``, ``/openapi.json``, ``/redoc``) behind the API keys and ``--metrics-key``."""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable

from fastapi import Request

from mlxkv.server.errors import APIError, error_body
from mlxkv.server.tenancy import Tenants


def request_key(request: Request) -> str:
    """The key a request presents (``Authorization: Bearer <key>``, else ``x-api-key``); "" when none."""
    return _token(request.headers.get("authorization", ""), request.headers.get("x-api-key", "")).strip()


def key_matches(token: str, key: str | None) -> bool:
    """Whether ``token`` is ``key`` (constant time; never with no key set)."""
    return key is not None and bool(token) and hmac.compare_digest(token.encode(), key.encode())


def bearer_auth(tenants: Tenants) -> Callable[[Request], None]:
    """A FastAPI dependency: on a server with keys, require ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    with one of ``tenants``' keys (401 otherwise), and record the key's tenant as ``request.state.tenant``."""

    def check(request: Request) -> None:
        if not tenants.required:
            return
        token = request_key(request)
        if not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           "missing_api_key")
        tenant = tenants.resolve(token)
        if tenant is None:
            raise APIError(401, "invalid API key", "invalid_api_key")
        request.state.tenant = tenant

    return check


def _token(authorization: str, x_api_key: str) -> str:
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" and token else x_api_key


#: The routes an operator (not an API client) reads: metrics and the API's own description.
OPERATOR_PATHS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class KeyProtectedPaths:
    """ASGI middleware: requests for ``paths`` need one of ``keys`` (as for the /v1 routes), else 401 JSON."""

    def __init__(self, app: Any, keys: list[str], paths: frozenset[str] = OPERATOR_PATHS):
        if not keys or not all(keys):
            raise ValueError("KeyProtectedPaths needs at least one non-empty key")
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.paths = paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope.get("path") in self.paths:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            token = _token(headers.get("authorization", ""), headers.get("x-api-key", "")).strip().encode()
            if not (token and any(hmac.compare_digest(token, k) for k in self.keys)):
                body = json.dumps(error_body(401, "this route needs an API key or the metrics key: send "
                                                  "'Authorization: Bearer <key>'",
                                             "invalid_api_key" if token else "missing_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
