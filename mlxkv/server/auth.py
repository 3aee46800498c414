"""API-key check for the /v1 routes (``--api-key`` or ``MLXKV_API_KEY``): ``Authorization: Bearer <key>`` (OpenAI's
clients) or ``x-api-key: <key>`` (Anthropic's)."""

from __future__ import annotations

import hmac
from typing import Callable

from fastapi import Request

from mlxkv.server.errors import APIError


def request_key(request: Request) -> str:
    """The key a request presents (``Authorization: Bearer <key>``, else ``x-api-key``); "" when none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "")
    return token.strip()


def key_matches(token: str, key: str | None) -> bool:
    """Whether ``token`` is ``key`` (constant time; never with no key set)."""
    return key is not None and bool(token) and hmac.compare_digest(token.encode(), key.encode())


def bearer_auth(api_key: str | None, admin_key: str | None = None) -> Callable[[Request], None]:
    """A FastAPI dependency: with ``api_key`` set, require ``Authorization: Bearer <api_key>`` or
    ``x-api-key: <api_key>`` (401 otherwise); the ``admin_key``, when set, is accepted as well."""

    def check(request: Request) -> None:
        if api_key is None:
            return
        token = request_key(request)
        if not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           "missing_api_key")
        if not (key_matches(token, api_key) or key_matches(token, admin_key)):
            raise APIError(401, "invalid API key", "invalid_api_key")

    return check
