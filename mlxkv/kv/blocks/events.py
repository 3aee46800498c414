"""KV-cache events (what a KV-aware router or a secondary tier listens to) in a bounded ring buffer.

Events: ``BlockStored`` (a full block became cached), ``BlockRemoved`` (a cached full block's hash left the
cache: evicted or about to be overwritten), ``AllBlocksCleared`` (prefix cache reset). Every event gets a
sequence number 1, 2, 3, ...; the buffer keeps the newest ``capacity``.

Readers: ``read(since)`` returns the events numbered above ``since`` that are still held, the cursor to pass
next time, and how many the reader missed because the buffer wrapped (any number of readers, nothing is
consumed). ``drain()`` returns everything held and empties the buffer (a single consumer). The buffer is
thread-safe: the engine thread appends while HTTP handlers read (``GET /v1/cache/events``).
:func:`event_to_json` is the wire form (hashes in hex).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice

from mlxkv.kv.blocks.block import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_id: int
    priority: int
    images: tuple[str, ...] = ()  # the UUIDs (else content hashes) of the images whose tokens the block holds


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    group_id: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Result of ``KVEventBuffer.read``: ``events`` as (seq_no, event), the next ``cursor``, and
    ``dropped``: events after the old cursor that the buffer no longer holds."""

    events: list[tuple[int, KVEvent]]
    cursor: int
    dropped: int


class KVEventBuffer:
    """Bounded ring buffer of numbered KV events. ``enabled=False`` records nothing (zero cost)."""

    def __init__(self, capacity: int = 4096, enabled: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"event buffer capacity={capacity}: expected >= 1")
        self.capacity = capacity
        self.enabled = enabled
        self._buf: deque[tuple[int, KVEvent]] = deque(maxlen=capacity)
        self._last_seq = 0  # number of the newest event ever recorded
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def last_seq(self) -> int:
        """Number of the newest event recorded (0 when none yet)."""
        return self._last_seq

    def append(self, event: KVEvent) -> int:
        """Record ``event``; returns its number (0 when disabled). The oldest event falls off when full."""
        if not self.enabled:
            return 0
        with self._lock:
            self._last_seq += 1
            self._buf.append((self._last_seq, event))
            return self._last_seq

    def read(self, since: int = 0) -> EventBatch:
        """Events numbered above ``since`` still held; pass the returned cursor next time."""
        if since < 0:
            raise ValueError(f"event cursor since={since}: expected >= 0")
        with self._lock:
            last = self._last_seq
            oldest = self._buf[0][0] if self._buf else last + 1
            dropped = max(0, min(oldest, last + 1) - 1 - since)
            start = max(0, since + 1 - oldest)
            events = list(islice(self._buf, start, None))
        return EventBatch(events=events, cursor=max(since, last), dropped=dropped)

    def drain(self) -> list[KVEvent]:
        """Every held event, oldest first; empties the buffer."""
        with self._lock:
            events = [event for _, event in self._buf]
            self._buf.clear()
        return events


def _hash_json(h: BlockHash | None) -> str | int | None:
    return h.hex() if isinstance(h, bytes) else h


def event_to_json(event: KVEvent) -> dict:
    """The JSON form of an event: ``{"type": "BlockStored", ...fields}``, block hashes as hex strings (a
    process-local ``builtin`` hash stays an integer)."""
    out: dict = {"type": type(event).__name__}
    if isinstance(event, BlockStored):
        out.update(block_hashes=[_hash_json(h) for h in event.block_hashes],
                   parent_block_hash=_hash_json(event.parent_block_hash), token_ids=list(event.token_ids),
                   block_size=event.block_size, group_id=event.group_id, priority=event.priority)
        if event.images:
            out["images"] = list(event.images)
    elif isinstance(event, BlockRemoved):
        out.update(block_hashes=[_hash_json(h) for h in event.block_hashes], group_id=event.group_id)
    return out
