"""SecondaryTier: where blocks evicted from the primary pool go, and where prefix lookups look next.

Offload: a block whose retention priority is below ``min_priority`` is dropped; otherwise it goes to host
memory when there is a memory store (whose own evictions cascade to disk), else straight to disk.
Lookup: memory first (a memory hit *moves* the block back to the primary pool), then disk (the file stays:
it survives restarts and costs no host memory). Every outcome is counted for stats. Disk blocks a restore is
about to need can be read ahead by a thread of their own (:mod:`mlxkv.kv.tier.read_ahead`): ``take`` finds them
staged in host memory.

With a write-behind writer attached (:mod:`mlxkv.kv.tier.write_behind`), blocks bound for disk are queued and
written by its thread; every disk-store call (either thread) holds :attr:`SecondaryTier.disk_lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from mlxkv.kv.tier.disk_store import DiskStore
from mlxkv.kv.tier.format import TierBlock
from mlxkv.kv.tier.host_store import HostMemoryStore, Key, block_key
from mlxkv.kv.tier.read_ahead import ReadAhead


@dataclass(slots=True)
class TierCounters:
    offered: int = 0  # blocks evicted from the primary pool and handed to the tier
    dropped_low_priority: int = 0  # below min_priority: not kept
    dropped_no_room: int = 0  # larger than a cap, or would push out more valuable blocks
    stored_memory: int = 0
    stored_disk: int = 0
    lookups: int = 0
    hits_memory: int = 0
    hits_disk: int = 0
    dropped_queue_full: int = 0  # evicted blocks bound for disk while the write-behind queue was full


class SecondaryTier:
    """Host-memory and/or disk store behind the primary block pool.

    Args:
        min_priority: blocks below this retention priority are dropped on eviction (KvCacheConfig's
            ``secondary_offload_min_priority``).
        memory: host-memory store or None; disk: disk store or None (at least one).
    """

    def __init__(self, min_priority: int = 35, memory: HostMemoryStore | None = None,
                 disk: DiskStore | None = None):
        if memory is None and disk is None:
            raise ValueError("a secondary tier needs a host-memory store, a disk store, or both")
        if not 0 <= min_priority <= 100:
            raise ValueError(f"min_priority={min_priority}: expected 0..100")
        self.min_priority = min_priority
        self.memory = memory
        self.disk = disk
        self.counters = TierCounters()
        self.disk_lock = threading.Lock()  # the disk store is shared with the write-behind thread
        self.writer = None  # a WriteBehind, once attached
        self.ahead = ReadAhead(self._read_disk) if disk is not None else None

    def attach_writer(self, writer) -> None:
        """Send disk-bound blocks through ``writer`` (a :class:`~mlxkv.kv.tier.write_behind.WriteBehind`)."""
        self.writer = writer

    def on_disk(self, key: Key) -> bool:
        """Whether ``key`` is stored on disk or queued to be."""
        if self.disk is None:
            return False
        if self.writer is not None and key in self.writer:
            return True
        with self.disk_lock:
            return key in self.disk

    def store_on_disk(self, block: TierBlock) -> bool:
        """Write ``block`` to the disk store now (the writer thread's call); whether it is stored."""
        with self.disk_lock:
            present = block_key(block) in self.disk
            stored = self.disk.put(block)
            if stored and not present:
                self.counters.stored_disk += 1
            elif not stored:
                self.counters.dropped_no_room += 1
        return stored

    def _to_disk(self, block: TierBlock) -> bool:
        """An evicted block to disk: queued when a writer is attached (refused when its queue is full)."""
        if self.writer is None:
            return self.store_on_disk(block)
        if self.writer.offer(block):
            return True
        self.counters.dropped_queue_full += 1
        return False

    def offload(self, block: TierBlock) -> bool:
        """Keep an evicted block if its priority allows and it fits; returns whether it was kept."""
        c = self.counters
        c.offered += 1
        if block.priority < self.min_priority:
            c.dropped_low_priority += 1
            return False
        if self.memory is not None:
            stored, evicted = self.memory.put(block)
            if self.disk is not None:
                for old in evicted:
                    self._to_disk(old)
            if stored:
                c.stored_memory += 1
                return True
        if self.disk is not None:
            return self._to_disk(block)
        c.dropped_no_room += 1
        return False

    def contains(self, key: Key) -> bool:
        if self.memory is not None and key in self.memory:
            return True
        return self.on_disk(key)  # on disk, or queued for it

    def needs_read(self, key: Key) -> bool:
        """Whether restoring ``key`` would read its file: on disk, neither in host memory nor in the write queue."""
        if self.disk is None or (self.memory is not None and key in self.memory):
            return False
        if self.writer is not None and key in self.writer:
            return False
        with self.disk_lock:
            return key in self.disk

    def _read_disk(self, key: Key) -> TierBlock | None:
        with self.disk_lock:
            return self.disk.get(key)

    def take(self, key: Key) -> TierBlock | None:
        """The block for ``key`` to restore into the primary pool (verified), or None. Counts the lookup."""
        self.counters.lookups += 1
        if self.memory is not None and key in self.memory:
            self.counters.hits_memory += 1
            return self.memory.pop(key)
        if self.disk is not None:
            block = self.ahead.take(key)  # read ahead of the restore
            if block is None and self.writer is not None:
                block = self.writer.get(key)  # evicted, not written yet
            if block is None:
                block = self._read_disk(key)
            if block is not None:
                self.counters.hits_disk += 1
                return block
        return None

    def put_back(self, block: TierBlock) -> None:
        """Return a taken block that could not be restored (keeps the tier's content unchanged)."""
        if self.memory is not None and block_key(block) not in self.memory:
            self.memory.put(block)

    def clear(self) -> None:
        if self.memory is not None:
            self.memory.clear()
        if self.disk is not None:
            self.ahead.clear()
            with self.disk_lock:
                self.disk.clear()

    def stats(self) -> dict:
        """Counters and per-store sizes (JSON-able; served under ``tier.secondary`` by /v1/cache/stats).

        Summary keys: ``blocks`` / ``bytes`` held over both stores, ``hits``, ``writes`` (blocks stored),
        ``drops`` by reason (``low_priority``, ``no_room``, ``queue_full``), ``write_queue`` (write-behind backlog).
        """
        c = self.counters
        hits = c.hits_memory + c.hits_disk
        out: dict = {
            "min_priority": self.min_priority, "offered": c.offered, "dropped_low_priority": c.dropped_low_priority,
            "dropped_no_room": c.dropped_no_room, "stored_memory": c.stored_memory, "stored_disk": c.stored_disk,
            "lookups": c.lookups, "hits_memory": c.hits_memory, "hits_disk": c.hits_disk,
            "hit_rate": hits / c.lookups if c.lookups else 0.0, "hits": hits,
            "writes": c.stored_memory + c.stored_disk,
            "drops": {"low_priority": c.dropped_low_priority, "no_room": c.dropped_no_room,
                      "queue_full": c.dropped_queue_full},
            "blocks": 0, "bytes": 0,
        }
        with self.disk_lock:
            for name, store in (("memory", self.memory), ("disk", self.disk)):
                if store is not None:
                    out[name] = {"blocks": len(store), "bytes": store.nbytes, "capacity_bytes": store.capacity_bytes,
                                 "blocks_by_priority": {str(p): n for p, n in store.by_priority().items()}}
                    out["blocks"] += len(store)
                    out["bytes"] += store.nbytes
            if self.disk is not None:
                out["disk"]["corrupt_dropped"] = self.disk.num_corrupt
                out["disk"]["folder"] = str(self.disk.folder)
                out["disk"]["read_ahead"] = {"blocks": self.ahead.blocks_read, "missing": self.ahead.blocks_missing,
                                             "staged_bytes": self.ahead.staged_bytes}
        if self.writer is not None:
            blocks, nbytes = self.writer.pending()
            out["write_queue"] = {"blocks": blocks, "bytes": nbytes, "capacity_bytes": self.writer.max_bytes,
                                  "coalesced": self.writer.coalesced}
        return out
