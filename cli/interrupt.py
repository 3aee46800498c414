"""Ctrl-C while a model works (``generate``, a chat answer): a flag the prefill and the decode loop check between
chunks and tokens, instead of a KeyboardInterrupt raised inside a forward (which could leave the cache's layers
at different lengths, and which Python delivers only after a long prefill chunk returns)."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable


class StopOnCtrlC:
    """A context manager: inside it Ctrl-C sets a flag (``with StopOnCtrlC() as stopped: ... stopped()``) and a
    terminal does not echo what is typed (it would land inside the streamed text; it stays queued for the next
    prompt). Outside the main thread, where Python cannot install signal handlers, the flag never turns."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: Any = None
        self._termios: Any = None

    def __enter__(self) -> Callable[[], bool]:
        self.event.clear()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda *_: self.event.set())
        self._termios = _echo_off()
        return self.event.is_set

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self._termios is not None:
            _restore(self._termios)
            self._termios = None


def _echo_off() -> Any:
    """Turn the terminal's echo off; returns what restores it (``None``: stdin is not a terminal)."""
    try:
        import termios

        fd = sys.stdin.fileno()
        if not sys.stdin.isatty():
            return None
        saved = termios.tcgetattr(fd)
        quiet = list(saved)
        quiet[3] &= ~termios.ECHO
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        return fd, saved
    except (ImportError, OSError, ValueError, AttributeError):  # no termios, or stdin replaced (tests, Windows)
        return None


def _restore(state: Any) -> None:
    import termios

    fd, saved = state
    try:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
    except (OSError, termios.error):  # pragma: no cover - the terminal went away
        pass


__all__ = ["StopOnCtrlC"]
