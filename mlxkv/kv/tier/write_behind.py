"""Write-behind: tier blocks written to the disk store by a background thread, off the engine's step.

The engine thread copies a block's K/V to host memory (numpy: MLX arrays are only ever evaluated on the engine
thread) and :meth:`WriteBehind.offer` queues it; a writer thread encodes and writes the file
(:meth:`SecondaryTier.store_on_disk`, which holds the tier's disk lock). The queue is bounded in bytes and
coalesced: a block already queued is not queued twice, and the writer skips one already on disk. A full queue
refuses the offer (the caller keeps the block pending or counts a drop); it never blocks the engine unless asked
to wait (the flush at shutdown).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from mlxkv.kv.tier.format import TierBlock
from mlxkv.kv.tier.host_store import Key, block_key

log = logging.getLogger("mlxkv.kv.tier")

DEFAULT_QUEUE_BYTES = 128 << 20  # host memory the queued K/V copies may take


class WriteBehind:
    """One writer thread draining a bounded, coalesced queue of blocks into ``tier``'s disk store.

    Args:
        tier: the :class:`~mlxkv.kv.tier.secondary.SecondaryTier` (must have a disk store).
        max_bytes: cap on the K/V bytes queued at once (a single larger block is still accepted when the queue is
            empty, so nothing is unstorable).
    """

    def __init__(self, tier, max_bytes: int = DEFAULT_QUEUE_BYTES):
        if tier.disk is None:
            raise ValueError("write-behind needs a disk store")
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes}: expected >= 1")
        self.tier = tier
        self.max_bytes = max_bytes
        self._queue: OrderedDict[Key, TierBlock] = OrderedDict()  # guarded by _cond
        self._queued_bytes = 0
        self._writing: TierBlock | None = None  # the block the writer took from the queue and is writing
        self._closed = False
        self._cond = threading.Condition()
        self.coalesced = 0  # offers of a block already queued
        self.dropped_queue_full = 0  # offers refused (callers that cannot retry count them here)
        self._thread = threading.Thread(target=self._run, name="mlxkv-tier-writer", daemon=True)
        self._thread.start()

    # ---- engine side ---------------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return self.get(key) is not None

    def get(self, key: Key) -> TierBlock | None:
        """The block queued (or being written) under ``key``, or None: until its file exists, a restore reads it
        from here."""
        with self._cond:
            block = self._queue.get(key)
            if block is None and self._writing is not None and block_key(self._writing) == key:
                block = self._writing
            return block

    def room(self) -> int:
        """Bytes that can be queued now."""
        with self._cond:
            return max(0, self.max_bytes - self._queued_bytes)

    def offer(self, block: TierBlock, wait_s: float = 0.0) -> bool:
        """Queue ``block`` (True; also when it is queued already). False when the queue stays full for
        ``wait_s`` seconds or the writer is closed."""
        key = block_key(block)
        deadline = time.monotonic() + wait_s
        with self._cond:
            if key in self._queue:
                self.coalesced += 1
                return True
            while self._queue and self._queued_bytes + block.nbytes > self.max_bytes and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if self._closed:
                return False
            self._queue[key] = block
            self._queued_bytes += block.nbytes
            self._cond.notify_all()
            return True

    def pending(self) -> tuple[int, int]:
        """``(blocks, bytes)`` queued or being written."""
        with self._cond:
            return len(self._queue) + (self._writing is not None), self._queued_bytes

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block is written; False when ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> int:
        """Stop the writer (after the block it is writing); returns how many queued blocks were not written."""
        with self._cond:
            self._closed = True
            lost = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout)
        return lost

    # ---- writer thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, block = self._queue.popitem(last=False)
                self._writing = block
            try:
                self.tier.store_on_disk(block)
            except Exception:  # noqa: BLE001 - a failed write loses one block, never the writer
                log.exception("secondary KV tier: writing a block failed")
            finally:
                with self._cond:
                    self._writing = None
                    self._queued_bytes -= block.nbytes
                    self._cond.notify_all()
