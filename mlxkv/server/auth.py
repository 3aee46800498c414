"""API-key check for the /v1 routes (``--api-key`` or ``MLXKV_API_KEY``): ``Authorization: Bearer <key>`` (OpenAI's
clients) or ``x-api-key: <key>`` (Anthropic's)."""

from __future__ import annotations

import hmac
from typing import Callable

from fastapi import Request

from mlxkv.server.errors import APIError


def bearer_auth(api_key: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency: with ``api_key`` set, require ``Authorization: Bearer <api_key>`` or
    ``x-api-key: <api_key>`` (401 otherwise)."""

    def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            token = request.headers.get("x-api-key", "")
        if not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           "missing_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid API key", "invalid_api_key")

    return check
