"""DiskStore: the secondary tier's disk folder, one verified file per block (format.py), byte-capped.

Writes are atomic (temp file in the folder, fsync, rename, fsync of the folder), so a crash leaves either
the whole file or none (plus at most a temp file, removed by a later scan once stale). The index is rebuilt
by scanning the folder at start, so the tier survives restarts; other models' files are skipped (never
served, never deleted); a file of ours that fails verification, at the scan or when read, is dropped with a
warning. Eviction follows store.PriorityLRU.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from mlxkv.kv.tier.format import (
    FILE_SUFFIX,
    MAGIC,
    FormatError,
    TierBlock,
    decode_block,
    encode_block,
    file_size,
    parse_header,
)
from mlxkv.kv.tier.host_store import Key, PriorityLRU, _check_capacity, block_key

log = logging.getLogger("mlxkv.kv.tier")

TMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 60.0  # temp files older than this at a scan are leftovers of a crash
_HEADER_PROBE = 1 << 16  # bytes read to parse a header when scanning


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


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


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
                if _has_magic(path):
                    self._drop_file(path, f"unreadable header ({exc})")
                continue  # without our magic it is not our file: leave it alone
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
