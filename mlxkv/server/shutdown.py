"""Graceful stop of ``mlxkv serve`` on SIGTERM / SIGINT: stop admitting, end open requests cleanly, flush, exit 0.

uvicorn alone, on a signal, waits for open connections, cancels the ones still streaming after its grace
period (a traceback per stream in the log), stops the app, then re-raises the signal, so the process always
dies by it. :class:`GracefulServer` instead, at the first signal, drains the engine at once (new requests get
503; every unfinished request ends with a final error event saying the server is shutting down, so streams
close on their own), then lets uvicorn close the connections; the app's lifespan then stops the engine, which
writes the KV tier's cached blocks to disk within the flush timeout. The process exits 0. A second SIGINT
forces the exit as uvicorn does.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import uvicorn

from mlxkv.server.read_timeouts import DEFAULT_HEADER_TIMEOUT_S, protocol_class

log = logging.getLogger("mlxkv.server")

SHUTDOWN_MESSAGE = "the server is shutting down"
SHUTDOWN_CODE = "server_shutting_down"


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the drain-then-stop handling above; ``engine`` is the app's BatchEngine."""

    def __init__(self, config: uvicorn.Config, engine: Any):
        super().__init__(config)
        self.engine = engine
        self._drained = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in self._captured_signals: uvicorn would re-raise it at the end and die by it
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        if not self._drained:
            self._drained = True
            log.info("%s received: no new requests; ending open ones and saving the KV cache",
                     signal.Signals(sig).name)
            # a signal handler runs on the event loop's thread: never wait for the engine there
            threading.Thread(target=self._drain, name="mlxkv-drain", daemon=True).start()
        self.should_exit = True

    def _drain(self) -> None:
        try:
            self.engine.drain(SHUTDOWN_MESSAGE)
        except Exception:  # noqa: BLE001 - the engine may have stopped already; the stop still proceeds
            log.warning("draining the engine failed", exc_info=True)


def serve_until_signalled(app: Any, engine: Any, *, host: str, port: int, log_level: str,
                          grace_s: float = 5.0, sockets: list | None = None,
                          header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> bool:
    """Run ``app`` under :class:`GracefulServer` until SIGTERM / SIGINT; ``sockets``: already bound listening
    sockets to serve on (else uvicorn binds ``host``:``port``); ``header_timeout_s``: see
    :mod:`mlxkv.server.read_timeouts`. Returns whether the server had started (False: its start-up failed, and
    uvicorn logged why)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s,
                            http=protocol_class(header_timeout_s))
    server = GracefulServer(config, engine)
    server.run(sockets=sockets)
    return server.started
