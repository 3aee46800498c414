"""Error bodies with the right HTTP status, in the shape of the API a path belongs to: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, or on the Anthropic Messages routes (``/v1/messages...``)
Anthropic's ``{"type": "error", "error": {"type", "message"}}``, so each API's official client parses them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}

#: Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "api_error", 529: "overloaded_error"}
#: Paths answered in Anthropic's shape.
ANTHROPIC_PATHS = ("/v1/messages",)


def is_anthropic(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape."""
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


class APIError(Exception):
    """Raise in a route to answer ``status`` with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def _encodable(text: str | None) -> str | None:
    """``text`` with any lone surrogate written as a ``\\udXXX`` escape: a message quoting a hostile key or value
    must still encode as UTF-8."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, code: str | None = None, param: str | None = None, *,
               path: str = "") -> dict:
    """The error body for ``status`` in the shape of ``path``'s API (OpenAI's unless :func:`is_anthropic`)."""
    message, param = _encodable(message), _encodable(param)
    if is_anthropic(path):
        return anthropic_error_body(status, message)
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    """``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for ``status``."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None, *, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param, path=path), status_code=status, headers=headers)


def _describe(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    """One readable message for pydantic's error list, the first offending field, and a code."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None, \
            "invalid_json"
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return "; ".join(parts), loc, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise answers in its API's shape (never FastAPI's ``{"detail": ...}``)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe(list(exc.errors()))
        return error_response(400, message, code, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, headers=getattr(exc, "headers", None),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal server error: {type(exc).__name__}", "internal_error",
                              path=request.url.path)
