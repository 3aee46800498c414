"""Secondary-tier stores: host memory and a disk folder, each byte-capped with priority-LRU eviction.

Both key blocks by ``(group_id, block_hash)`` (the chained hash already names the whole prefix and salt).
Eviction inside a store takes the lowest retention priority first, least recently used among equals, and
only entries whose priority is at most the incoming block's: a block that would need to push out a more
valuable one (or is larger than the whole cap) is not stored. Caps are never exceeded.

The disk store writes one file per block (format.py) atomically (temp file, fsync, rename, fsync of the
folder), rebuilds its index by scanning the folder at start (so it survives restarts), skips other models'
files, and drops, with a warning, any file of its own that fails verification when read.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from mlxkv.tier.format import FILE_SUFFIX, FormatError, TierBlock, decode_block, encode_block, file_size, parse_header

log = logging.getLogger("mlxkv.tier")

Key = tuple[int, bytes]  # (group_id, block_hash)
TMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 60.0  # temp files older than this at a scan are leftovers of a crash
_HEADER_PROBE = 1 << 16  # bytes read to parse a header when scanning


def block_key(block: TierBlock) -> Key:
    return (block.group_id, block.block_hash)


class PriorityLRU:
    """Byte accounting and eviction order: per priority, keys in least-recently-used-first order."""

    def __init__(self) -> None:
        self._buckets: dict[int, OrderedDict[Key, int]] = {}
        self._prio: dict[Key, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._prio)

    def __contains__(self, key: Key) -> bool:
        return key in self._prio

    def add(self, key: Key, priority: int, nbytes: int) -> None:
        assert key not in self._prio, "key already indexed"
        self._buckets.setdefault(priority, OrderedDict())[key] = nbytes
        self._prio[key] = priority
        self.nbytes += nbytes

    def touch(self, key: Key) -> None:
        self._buckets[self._prio[key]].move_to_end(key)

    def remove(self, key: Key) -> int:
        p = self._prio.pop(key)
        nbytes = self._buckets[p].pop(key)
        if not self._buckets[p]:
            del self._buckets[p]
        self.nbytes -= nbytes
        return nbytes

    def victims(self, need: int, capacity: int, max_priority: int) -> list[Key] | None:
        """Keys to evict (in order) so that ``need`` more bytes fit, taking only priorities <= max_priority;
        None when that cannot make room."""
        out, freed = [], 0
        if self.nbytes + need <= capacity:
            return out
        for p in sorted(self._buckets):
            if p > max_priority:
                break
            for key, nbytes in self._buckets[p].items():
                out.append(key)
                freed += nbytes
                if self.nbytes - freed + need <= capacity:
                    return out
        return None

    def by_priority(self) -> dict[int, int]:
        return {p: len(b) for p, b in sorted(self._buckets.items())}

    def keys(self) -> list[Key]:
        return list(self._prio)


def _check_capacity(capacity_bytes: int) -> None:
    if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise ValueError(f"capacity_bytes={capacity_bytes!r}: expected an integer >= 0")


class HostMemoryStore:
    """Blocks kept in host memory (numpy arrays), at most ``capacity_bytes`` of K/V payload."""

    def __init__(self, capacity_bytes: int):
        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._lru = PriorityLRU()
        self._blocks: dict[Key, TierBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Key) -> bool:
        return key in self._blocks

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def put(self, block: TierBlock) -> tuple[bool, list[TierBlock]]:
        """Store ``block``; returns ``(stored, evicted blocks)``."""
        key = block_key(block)
        if key in self._blocks:
            self.pop(key)
        victims = self._lru.victims(block.nbytes, self.capacity_bytes, block.priority)
        if victims is None:
            return False, []
        evicted = [self.pop(k) for k in victims]
        self._lru.add(key, block.priority, block.nbytes)
        self._blocks[key] = block
        assert self._lru.nbytes <= self.capacity_bytes
        return True, evicted

    def get(self, key: Key) -> TierBlock | None:
        block = self._blocks.get(key)
        if block is not None:
            self._lru.touch(key)
        return block

    def pop(self, key: Key) -> TierBlock:
        self._lru.remove(key)
        return self._blocks.pop(key)

    def clear(self) -> None:
        for key in list(self._blocks):
            self.pop(key)

    def by_priority(self) -> dict[int, int]:
        return self._lru.by_priority()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_all(f, data: bytes, chunk: int = 1 << 20) -> None:
    for i in range(0, len(data), chunk):
        f.write(data[i:i + chunk])


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temp file in the same folder, fsync, rename, fsync folder.
    On any error the temp file is removed and ``path`` is untouched."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            _write_all(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def is_tier_file(path: Path) -> bool:
    """A committed block file of ours (by name and magic)."""
    if not path.name.endswith(FILE_SUFFIX) or path.name.startswith("."):
        return False
    try:
        with open(path, "rb") as f:
            parse_header(f.read(_HEADER_PROBE))
        return True
    except (OSError, FormatError):
        return False


def is_tier_temp(path: Path) -> bool:
    """A temp file left by an interrupted write of ours."""
    name = path.name
    return name.startswith(".") and name.endswith(TMP_SUFFIX) and f"{FILE_SUFFIX}." in name


def read_header_file(path: Path) -> tuple[dict, int]:
    """``(header, expected file size)`` of a block file; raises FormatError / OSError."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_PROBE)
        try:
            header, start = parse_header(head)
        except FormatError:
            if len(head) < _HEADER_PROBE:
                raise
            f.seek(0)  # a header longer than the probe (very large blocks): read it whole
            header, start = parse_header(f.read())
    return header, file_size(header, start)


class DiskStore:
    """Blocks of one model in a folder, at most ``capacity_bytes`` of files.

    Args:
        folder: created if missing; may be shared with other models (their files are left alone).
        fingerprint: this model's fingerprint (fingerprint.py); only files with its digest are served.
        capacity_bytes: cap on the total size of this model's files.
        block_size / layout: when given, files must match (``layout``: group id -> TierBlock.layout()).
    """

    def __init__(self, folder: str | Path, fingerprint: dict, capacity_bytes: int, *,
                 block_size: int | None = None, layout: dict[int, tuple] | None = None):
        _check_capacity(capacity_bytes)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.digest = fingerprint["digest"]
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.layout = layout
        self._lru = PriorityLRU()
        self.num_corrupt = 0
        self.num_foreign = 0
        self._scan()

    # ---- index -------------------------------------------------------------------------------------
    def path_for(self, key: Key) -> Path:
        return self.folder / f"{self.digest[:16]}-g{key[0]}-{key[1].hex()}{FILE_SUFFIX}"

    def _drop_file(self, path: Path, why: str) -> None:
        log.warning("secondary KV tier: dropping %s: %s", path.name, why)
        self.num_corrupt += 1
        path.unlink(missing_ok=True)

    def _scan(self) -> None:
        found = []
        for path in sorted(self.folder.iterdir()):
            if is_tier_temp(path):
                # an interrupted write (never committed); a young one may be another process's live write
                if time.time() - path.stat().st_mtime > STALE_TEMP_SECONDS:
                    path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(FILE_SUFFIX) or path.name.startswith("."):
                continue
            try:
                header, expected = read_header_file(path)
                fp_digest = (header.get("fingerprint") or {}).get("digest")
                if fp_digest != self.digest:
                    self.num_foreign += 1
                    continue
                key = (int(header["group_id"]), bytes.fromhex(header["block_hash"]))
                priority, created = int(header["priority"]), float(header["created"])
            except (OSError, FormatError, KeyError, TypeError, ValueError) as exc:
                self._drop_file(path, f"unreadable header ({exc})")
                continue
            size = path.stat().st_size
            if size != expected:
                self._drop_file(path, f"size {size} bytes, header says {expected} (truncated)")
                continue
            if path != self.path_for(key):
                self._drop_file(path, "file name does not match its header")
                continue
            found.append((created, key, priority, size))
        if self.num_foreign:
            log.warning("secondary KV tier: %d file(s) in %s belong to another model; not served",
                        self.num_foreign, self.folder)
        for _, key, priority, size in sorted(found):  # oldest first = least recently used first
            self._lru.add(key, priority, size)
        victims = self._lru.victims(0, self.capacity_bytes, 100) or []
        for key in victims:
            self._remove(key)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Key) -> bool:
        return key in self._lru

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def keys(self) -> list[Key]:
        return self._lru.keys()

    def by_priority(self) -> dict[int, int]:
        return self._lru.by_priority()

    def _remove(self, key: Key) -> None:
        self._lru.remove(key)
        self.path_for(key).unlink(missing_ok=True)

    # ---- operations ----------------------------------------------------------------------------------
    def put(self, block: TierBlock) -> bool:
        """Write ``block`` (no-op True if already stored); False when it cannot fit."""
        key = block_key(block)
        if key in self._lru:
            self._lru.touch(key)
            return True
        data = encode_block(block, self.fingerprint)
        victims = self._lru.victims(len(data), self.capacity_bytes, block.priority)
        if victims is None:
            return False
        for k in victims:
            self._remove(k)
        try:
            atomic_write(self.path_for(key), data)
        except OSError as exc:  # disk full, folder removed: the block is simply not kept
            log.warning("secondary KV tier: cannot write %s: %s", self.path_for(key).name, exc)
            return False
        self._lru.add(key, block.priority, len(data))
        assert self._lru.nbytes <= self.capacity_bytes
        return True

    def get(self, key: Key) -> TierBlock | None:
        """The verified block, or None (absent, or dropped with a warning because it failed verification)."""
        if key not in self._lru:
            return None
        path = self.path_for(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._lru.remove(key)
            log.warning("secondary KV tier: %s vanished (%s)", path.name, exc)
            return None
        try:
            block = decode_block(data, self.digest, block_hash=key[1], block_size=self.block_size,
                                 layout=None if self.layout is None else self.layout.get(key[0]))
            if block.group_id != key[0]:
                raise FormatError("group id differs from the file name")
        except FormatError as exc:
            self._lru.remove(key)
            self._drop_file(path, str(exc))
            return None
        self._lru.touch(key)
        return block

    def discard(self, key: Key) -> None:
        if key in self._lru:
            self._remove(key)

    def clear(self) -> int:
        """Remove every file of this model; returns how many."""
        keys = self._lru.keys()
        for key in keys:
            self._remove(key)
        return len(keys)
