"""Request body limits as ASGI middleware: bodies over the size limit get 413, bodies slower than the read
deadline 408, before any route runs."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from mlxkv.server.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Seconds a client may take to send a request's body (``mlxkv serve --body-timeout``): a client trickling its
#: body holds a connection and a worker's memory meanwhile.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Over-limit bodies up to this multiple of the limit are read and dropped before the 413, so the client (still
#: uploading) reliably sees the answer; larger ones are refused at once and the connection closed.
DRAIN_FACTOR = 4


class BodyTimeout(Exception):
    """The request body did not arrive within the deadline."""


class BodySizeLimit:
    """Answer 413 (in the error shape of the path's API) when a request body exceeds ``max_bytes``, and 408 when
    it is not whole within ``timeout_s`` seconds of the request's start (the connection is then closed).

    A declared ``Content-Length`` over the limit is refused without keeping the body (read and dropped up to
    ``DRAIN_FACTOR`` times the limit so the client sees the 413, else not read at all); otherwise (chunked
    uploads) the body is read up to the limit and replayed to the app, whose later ``receive`` calls go to
    the server again (so streaming responses still see client disconnects).
    """

    def __init__(self, app: Callable, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"the body timeout must be > 0 seconds, got {timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def timed() -> dict:
            left = deadline - asyncio.get_running_loop().time()
            try:
                return await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout from None

        try:
            await self._limited(scope, timed, receive, send)
        except BodyTimeout:
            await self._answer(send, scope, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                               "request_timeout")

    async def _limited(self, scope: Scope, timed: Receive, receive: Receive, send: Send) -> None:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= DRAIN_FACTOR * self.max_bytes:
                await self._drain(timed)  # a client still uploading may miss a 413 sent mid-body
            await self._refuse(send, scope)
            return
        chunks, size = [], 0
        while True:
            message = await timed()
            if message["type"] != "http.request":
                break  # disconnected before the body was complete: let the app see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send, scope)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive: Receive) -> None:
        """Read and drop the rest of the request body (bounded by the declared length the caller checked)."""
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    async def _refuse(self, send: Send, scope: Scope) -> None:
        await self._answer(send, scope, 413, f"the request body is larger than {self.max_bytes} bytes",
                           "request_too_large")

    @staticmethod
    async def _answer(send: Send, scope: Scope, status: int, message: str, code: str) -> None:
        """An error in the path's API shape; the connection closes after it (the body was not read whole)."""
        body = json.dumps(error_body(status, message, code, path=scope.get("path", ""))).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
