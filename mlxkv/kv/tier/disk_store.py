"""DiskStore: the secondary tier's disk folder, one verified file per block (format.py), byte-capped.

The folder is private (mode 0700, tightened if it exists), its files 0600, each encrypted and authenticated
under the folder's secret and named by a keyed tag of its block (seal.py; the secret is kept beside the folder).
Writes are atomic (temp file in the folder, fsync, rename, fsync of the folder), so a crash leaves either the
whole file or none (plus at most a temp file, removed by a later scan once stale). The index is rebuilt by
scanning the folder at start, so the tier survives restarts; other models' files are skipped (never served, never
deleted); a file of ours that fails verification, at the scan or when read, is dropped with one warning, and files
of an older format version with one warning for all of them: no file can stop the scan. Eviction follows
host_store.PriorityLRU.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import uuid
from pathlib import Path

from mlxkv.kv.tier.fingerprint import parse_shard_name
from mlxkv.kv.tier.format import (
    FILE_SUFFIX,
    MAGIC,
    PREFIX,
    FormatError,
    OldFormatError,
    TierBlock,
    decode_block,
    encode_block,
    file_size,
    file_tenant,
    header_end,
    parse_header,
    read_prefix,
)
from mlxkv.kv.tier.header import TierHeader
from mlxkv.kv.tier.host_store import Key, _check_capacity, block_key
from mlxkv.kv.tier.quota import TenantLRU
from mlxkv.kv.tier.seal import Seal, open_seal

log = logging.getLogger("mlxkv.kv.tier")

TMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 60.0  # temp files older than this at a scan are leftovers of a crash
FOLDER_MODE, FILE_MODE = 0o700, 0o600


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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_all(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def private_folder(folder: Path) -> Path:
    """``folder`` created with mode 0700, or tightened to it if it exists with group / other access."""
    folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    if stat.S_IMODE(folder.stat().st_mode) & 0o077:
        os.chmod(folder, FOLDER_MODE)
    return folder


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def is_tier_file(path: Path) -> bool:
    """A committed block file of ours, readable or not, of any format version (by name and magic): what
    ``mlxkv cache clear`` removes. Never follows a link."""
    if not path.name.endswith(FILE_SUFFIX) or path.name.startswith(".") or not path.is_file() or path.is_symlink():
        return False
    return _has_magic(path)


def is_tier_temp(path: Path) -> bool:
    """A temp file left by an interrupted write of ours."""
    name = path.name
    return name.startswith(".") and name.endswith(TMP_SUFFIX) and f"{FILE_SUFFIX}." in name


def read_header_file(path: Path, seal: Seal) -> tuple[TierHeader, int]:
    """``(verified header, expected file size)`` of a block file, reading only its header.

    Raises:
        FormatError (OldFormatError for another format version), OSError.
    """
    with open(path, "rb") as f:
        prefix = f.read(PREFIX.size)
        _, hlen = read_prefix(prefix)
        header, start = parse_header(prefix + f.read(header_end(hlen) - PREFIX.size), seal)
    return header, file_size(header, start)


class DiskStore:
    """Blocks of one model in a folder, at most ``capacity_bytes`` of files.

    Args:
        folder: created if missing; may be shared with other models (their files are left alone).
        fingerprint: this model's fingerprint (fingerprint.py); only files with its digest are served.
        capacity_bytes: cap on the total size of this model's files.
        block_size / layout: when given, files must match (``layout``: group id -> TierBlock.layout()).
        tenant_quota_bytes: most bytes one tenant (cache salt) keeps while others need room (quota.TenantLRU);
            None: no quota.
    """

    def __init__(self, folder: str | Path, fingerprint: dict, capacity_bytes: int, *,
                 block_size: int | None = None, layout: dict[int, tuple] | None = None,
                 tenant_quota_bytes: int | None = None):
        _check_capacity(capacity_bytes)
        if tenant_quota_bytes is not None:
            _check_capacity(tenant_quota_bytes)
        self.tenant_quota_bytes = tenant_quota_bytes
        self.folder = private_folder(Path(folder))
        self.seal = open_seal(self.folder)
        self.fingerprint = fingerprint
        self.digest = fingerprint["digest"]
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.layout = layout
        self._lru = TenantLRU()
        self.num_corrupt = 0
        self.num_foreign = 0
        self.num_old_format = 0
        self._scan()

    # ---- index -------------------------------------------------------------------------------------
    def path_for(self, key: Key) -> Path:
        """The file of ``key``: named by a keyed tag, so the name cannot be recomputed from a guessed prompt."""
        return self.folder / f"{self.seal.name_tag(self.digest, key[0], key[1])}{FILE_SUFFIX}"

    def _drop_file(self, path: Path, why: str) -> None:
        log.warning("secondary KV tier: dropping %s: %s", path.name, why)
        self.num_corrupt += 1
        path.unlink(missing_ok=True)

    def _scan(self) -> None:
        found = []
        for path in sorted(self.folder.iterdir()):
            try:
                entry = self._scan_one(path)
            except OSError as exc:  # vanished or unreadable meanwhile: not served
                log.warning("secondary KV tier: skipping %s: %s", path.name, exc)
                continue
            if entry is not None:
                found.append(entry)
        shards = sorted(p.name for p in self.folder.iterdir() if p.is_dir() and parse_shard_name(p.name))
        if shards:  # a --distributed launch's folder used whole: each rank's shard is in its own subfolder
            log.warning("secondary KV tier: %s holds the per-rank folders of --distributed launches (%s): not read "
                        "by this process, which holds whole blocks", self.folder, ", ".join(shards))
        if self.num_foreign:
            log.warning("secondary KV tier: %d file(s) in %s belong to another model, other KV bits or another "
                        "--distributed shard; not served", self.num_foreign, self.folder)
        if self.num_old_format:
            log.warning("secondary KV tier: dropped %d file(s) of an older format in %s (never readable by this "
                        "version)", self.num_old_format, self.folder)
        for _, key, priority, size, tenant in sorted(found):  # oldest first = least recently used first
            self._lru.add(key, priority, size, tenant)
        victims = self._lru.all.victims(0, self.capacity_bytes, 100) or []
        for key in victims:
            self._remove(key)

    def _scan_one(self, path: Path) -> tuple[float, Key, int, int, str] | None:
        """``(created, key, priority, size, tenant tag)`` of a servable file of ours; None for anything else (dropped
        with a warning when it is ours but bad, left alone when it is not ours)."""
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):
            return None  # links, folders: never ours
        if is_tier_temp(path):
            # an interrupted write (never committed); a young one may be another process's live write
            if time.time() - st.st_mtime > STALE_TEMP_SECONDS:
                path.unlink(missing_ok=True)
            return None
        if not path.name.endswith(FILE_SUFFIX) or path.name.startswith("."):
            return None
        try:
            header, expected = read_header_file(path, self.seal)
        except OldFormatError:
            self.num_old_format += 1
            path.unlink(missing_ok=True)
            return None
        except FormatError as exc:
            if _has_magic(path):
                self._drop_file(path, str(exc))
            return None  # without our magic it is not our file: leave it alone
        if header.fingerprint.digest != self.digest:
            self.num_foreign += 1
            return None
        key = (header.group_id, bytes.fromhex(header.block_hash))
        if st.st_size != expected:
            self._drop_file(path, f"size {st.st_size} bytes, header says {expected} (truncated)")
            return None
        if path != self.path_for(key):
            self._drop_file(path, "file name does not match its header")  # a copy or a rename: counted once
            return None
        return header.created, key, header.priority, st.st_size, header.tenant_tag

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

    def by_tenant(self) -> dict[str, int]:
        """Bytes per tenant (keyed tenant tags)."""
        return self._lru.by_tenant()

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
        inherited = None if block.parent_hash is None else self._lru.tenant((key[0], block.parent_hash))
        try:
            data = encode_block(block, self.fingerprint, self.seal, tenant_tag=inherited)
            tenant = file_tenant(block, self.seal, inherited)
        except FormatError as exc:  # a block read from another folder: its clear token ids are gone
            log.warning("secondary KV tier: not writing block %s: %s", block.block_hash.hex()[:12], exc)
            return False
        victims = self._lru.victims(len(data), self.capacity_bytes, block.priority, tenant, self.tenant_quota_bytes)
        if victims is None:
            return False
        for k in victims:
            self._remove(k)
        try:
            atomic_write(self.path_for(key), data)
        except OSError as exc:  # disk full, folder removed: the block is simply not kept
            log.warning("secondary KV tier: cannot write %s: %s", self.path_for(key).name, exc)
            return False
        self._lru.add(key, block.priority, len(data), tenant)
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
            block = decode_block(data, self.seal, self.digest, block_hash=key[1], block_size=self.block_size,
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
