"""A KV pool wrapper that records every use of the pool from a thread other than the engine's.

The engine thread owns the pool (:class:`mlxkv.kv.CachePool` is not thread-safe). Wrap the pool before building the
engine, :meth:`EngineThreadOnly.arm` it once the engine is built (its constructor reads the pool on the building
thread, before the engine thread exists), serve requests, and assert :attr:`EngineThreadOnly.strangers` is empty.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

#: The engine thread's name (:meth:`mlxkv.engine.batch.BatchEngine.start`).
ENGINE_THREAD = "mlxkv-engine"


class EngineThreadOnly:
    """``pool`` behind attribute access that notes, once armed, each use off the engine thread."""

    def __init__(self, pool: Any):
        object.__setattr__(self, "_pool", pool)
        object.__setattr__(self, "_armed", False)
        object.__setattr__(self, "strangers", [])  # (thread name, attribute) of each use off the engine thread

    def arm(self) -> None:
        object.__setattr__(self, "_armed", True)

    def _note(self, name: str) -> None:
        thread = threading.current_thread().name
        if self._armed and thread != ENGINE_THREAD:
            self.strangers.append((thread, name))

    def __getattr__(self, name: str) -> Any:
        self._note(name)
        return getattr(self._pool, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._note(name)
        setattr(self._pool, name, value)

    def __len__(self) -> int:
        self._note("__len__")
        return len(self._pool)

    def __contains__(self, item: object) -> bool:
        self._note("__contains__")
        return item in self._pool

    def __iter__(self) -> Iterator[Any]:
        self._note("__iter__")
        return iter(self._pool)
