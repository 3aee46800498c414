"""ReadAhead: disk-tier blocks read into host memory by a thread of their own, before the engine restores them.

Read inside :meth:`~mlxkv.kv.tier.bridge.TierBridge.restore`, on the engine thread, the files of a prompt whose prefix
hit continues on disk would hold every decoding sequence for the step. The scheduler asks first
(:meth:`~mlxkv.kv.tier.bridge.TierBridge.ready`): the blocks the prompt's lookup says its restore takes from disk
are read here, the request stays queued meanwhile and the other sequences keep decoding; when they are staged the
restore takes them from host memory.

Staged blocks are copies of files that stay on disk (a staged block is only a read cache): dropping one loses
nothing, so a byte cap and an age limit bound what a cancelled request can leave behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from mlxkv.kv.tier.format import TierBlock
from mlxkv.kv.tier.host_store import Key

log = logging.getLogger("mlxkv.kv.tier")

#: Host bytes staged at most; past it the remaining blocks are read by the restore itself, as without read-ahead.
DEFAULT_MAX_STAGED_BYTES = 1 << 30
#: Seconds a staged block waits for its restore before it is dropped (its request was cancelled or preempted).
STAGED_TTL_S = 60.0


class ReadAhead:
    """Reads disk-tier blocks on one background thread into a staging map the tier's ``take`` looks in first.

    Args:
        read: ``read(key)`` returns the verified block from disk or None (the tier's locked disk read).
        max_bytes: staged bytes at most.
    """

    def __init__(self, read: Callable[[Key], TierBlock | None], max_bytes: int = DEFAULT_MAX_STAGED_BYTES):
        self._read = read
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._staged: dict[Key, tuple[TierBlock, float]] = {}  # key -> (block, monotonic time staged)
        self._pending: set[Key] = set()
        self._given_up: dict[Key, float] = {}  # read, but missing or over the cap: the restore reads it itself
        self._bytes = 0
        self._done = threading.Condition(self._lock)
        self._pool: ThreadPoolExecutor | None = None
        self.blocks_read = 0  # blocks staged by the thread, for stats
        self.blocks_missing = 0  # keys the disk no longer held when their read came

    def request(self, keys: Iterable[Key]) -> bool:
        """Start reading the ``keys`` neither staged nor pending; whether every one of them is staged already
        (True also for the keys that did not fit the byte cap: their restore reads them itself)."""
        with self._lock:
            self._expire(time.monotonic())
            todo = [k for k in keys if k not in self._staged and k not in self._pending and k not in self._given_up]
            if self._bytes >= self.max_bytes:
                todo = []
            self._pending.update(todo)
            waiting = bool(todo) or any(k in self._pending for k in keys)
        if todo:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-tier-read")
            self._pool.submit(self._run, todo)
        return not waiting

    def pending(self, keys: Iterable[Key]) -> bool:
        """Whether any of ``keys`` is still being read."""
        with self._lock:
            return any(k in self._pending for k in keys)

    def wait(self, timeout: float) -> None:
        """Block until a read finishes or ``timeout`` seconds pass (an engine with nothing else to do)."""
        with self._done:
            if self._pending:
                self._done.wait(timeout)

    def take(self, key: Key) -> TierBlock | None:
        """The staged block for ``key`` (removed from staging), or None."""
        with self._lock:
            entry = self._staged.pop(key, None)
            if entry is None:
                return None
            self._bytes -= entry[0].nbytes
            return entry[0]

    def discard(self, key: Key) -> None:
        """Forget a staged copy (its file was removed or replaced)."""
        self.take(key)

    def clear(self) -> None:
        with self._lock:
            self._staged.clear()
            self._given_up.clear()
            self._bytes = 0

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, t) in self._staged.items() if now - t > STAGED_TTL_S]:
            self._bytes -= self._staged.pop(key)[0].nbytes
        for key in [k for k, t in self._given_up.items() if now - t > STAGED_TTL_S]:
            del self._given_up[key]

    def _run(self, keys: list[Key]) -> None:
        for key in keys:
            try:
                block = self._read(key)
            except Exception:  # noqa: BLE001 - a failed read leaves the restore to read (and report) it itself
                log.exception("secondary KV tier: reading ahead %s failed", key)
                block = None
            with self._done:
                self._pending.discard(key)
                if block is None:
                    self.blocks_missing += 1
                    self._given_up[key] = time.monotonic()
                elif self._bytes + block.nbytes <= self.max_bytes:
                    self._staged[key] = (block, time.monotonic())
                    self._bytes += block.nbytes
                    self.blocks_read += 1
                else:
                    self._given_up[key] = time.monotonic()
                self._done.notify_all()
