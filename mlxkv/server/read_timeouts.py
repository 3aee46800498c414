"""Slow clients dropped: a deadline on reading a request's headers, which uvicorn does not have.

uvicorn closes a connection idle after a response (``timeout_keep_alive``), but any byte received cancels that
timer and nothing re-arms it until a response is sent: a client trickling header bytes (slowloris) holds its
connection, and the memory of its half-read request, for ever. :func:`protocol_class` extends uvicorn's HTTP
protocol (httptools when installed, else h11, as uvicorn picks) with a deadline from the connection's start, and
from the end of each response on a kept-alive connection, until the next request's headers are complete: past
it, a client that sent part of a request gets a 408 with a JSON error and the connection is closed; one that sent
nothing is closed as an idle one. The body's own deadline is the app's (:class:`mlxkv.server.limits.BodySizeLimit`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from mlxkv.server.errors import error_body

#: Seconds a client may take to send a request's headers (``mlxkv serve --header-timeout``).
DEFAULT_HEADER_TIMEOUT_S = 10.0


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps(error_body(408, f"the request headers did not arrive within {seconds:g} s",
                                 "request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _HeaderDeadline:
    """Mixin over a uvicorn HTTP protocol (both keep the current request's ``cycle``, replaced when the next
    request's headers are complete): the deadline described in the module docstring."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None
    _waiting_after: Any = None
    _got_bytes = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)  # type: ignore[misc]
        self._headers_done()

    def on_response_complete(self) -> None:
        self._arm()  # before: a pipelined request's headers may complete inside the call
        super().on_response_complete()  # type: ignore[misc]
        self._headers_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._waiting_after, self._got_bytes = self.cycle, False  # type: ignore[attr-defined]
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)  # type: ignore[attr-defined]

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_done(self) -> None:
        if self._deadline is not None and self.cycle is not self._waiting_after:  # type: ignore[attr-defined]
            self._disarm()

    def _expired(self) -> None:
        self._deadline = None
        transport = self.transport  # type: ignore[attr-defined]
        if self.cycle is not self._waiting_after or transport.is_closing():  # type: ignore[attr-defined]
            return
        if self._got_bytes:
            transport.write(_timeout_response(self.header_timeout_s))
        transport.close()


def protocol_class(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol (``Config(http=...)``) with a ``header_timeout_s`` deadline on request headers.

    Raises:
        ValueError: ``header_timeout_s`` is not positive.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {header_timeout_s}")
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type("HeaderDeadlineProtocol", (_HeaderDeadline, AutoHTTPProtocol), {"header_timeout_s": header_timeout_s})
