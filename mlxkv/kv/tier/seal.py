"""Keyed integrity for the disk tier: a per-installation secret and the HMAC-SHA256 tags made with it.

The secret (32 random bytes) lives *beside* the tier folder, as ``<folder>.secret`` (mode 0600, created on first
use), so clearing or copying the folder never takes it along. With it:

- every file carries a tag over its header and one over the whole file, so a file edited or replaced by
  anyone without the secret (a payload swapped and re-checksummed with plain sha256, say) is refused;
- a block's token ids and extra-keys digest (which carries the cache salt) are stored only as keyed tags, so
  the folder's content neither shows the prompt nor lets anyone check a guessed salt offline.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import struct
import time
import uuid
from pathlib import Path

SECRET_BYTES = 32
SECRET_SUFFIX = ".secret"
TAG_BYTES = 32  # HMAC-SHA256
_READ_RETRIES = 20  # another process may be creating the secret right now


class SecretError(ValueError):
    """The tier secret exists but cannot be trusted (wrong owner, group/other access, wrong size)."""


def secret_path(folder: str | Path) -> Path:
    """Where the secret of the tier folder ``folder`` lives: ``<folder>.secret``, beside it."""
    folder = Path(os.path.abspath(folder))
    if folder.parent == folder:
        raise ValueError(f"{folder}: a tier folder cannot be a file system root")
    return folder.with_name(folder.name + SECRET_SUFFIX)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{path}: not a regular file")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise SecretError(f"{path}: owned by uid {st.st_uid}, not by this user: remove it")
        if st.st_mode & 0o077:
            raise SecretError(f"{path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it: "
                              f"remove it (a new one is made, and the tier starts empty)")
        return os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)


def _create(path: Path) -> None:
    """Write a fresh secret to ``path`` unless one appears there first (temp file + hard link: never partial)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if os.write(fd, secrets.token_bytes(SECRET_BYTES)) != SECRET_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        os.fsync(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial secret behind
        raise
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: use theirs
    finally:
        tmp.unlink(missing_ok=True)


def load_secret(folder: str | Path, *, create: bool = True) -> bytes | None:
    """The secret of tier folder ``folder``; made on first use when ``create`` (else None when absent).

    Raises:
        SecretError: the secret file is not private to this user or has the wrong size.
    """
    path = secret_path(folder)
    for _ in range(_READ_RETRIES):
        try:
            key = _read(path)
        except FileNotFoundError:
            if not create:
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            _create(path)
            continue
        if len(key) == SECRET_BYTES:
            return key
        time.sleep(0.01)
    raise SecretError(f"{path}: expected {SECRET_BYTES} bytes: remove it (a new one is made, the tier starts empty)")


class Seal:
    """HMAC-SHA256 tags under one secret, each with its own domain label (a tag of one kind never passes as
    another kind)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if len(key) != SECRET_BYTES:
            raise ValueError(f"a tier secret has {SECRET_BYTES} bytes, not {len(key)}")
        self._key = key

    def tag(self, label: bytes, data: bytes) -> bytes:
        """The 32-byte tag of ``data`` under ``label``."""
        return hmac.new(self._key, label + b"\0" + data, hashlib.sha256).digest()

    def check(self, label: bytes, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is ``data``'s tag (constant time)."""
        return hmac.compare_digest(self.tag(label, data), tag)

    def tokens_tag(self, block_hash: bytes, token_ids) -> str:
        """Hex tag of a block's token ids (what the file keeps instead of the ids)."""
        ids = list(token_ids)
        return self.tag(b"tokens", block_hash + struct.pack(f"<{len(ids)}q", *ids)).hex()

    def extra_tag(self, extra_digest: str) -> str:
        """Hex tag of a block's extra-keys digest (format.extra_digest; carries the salt)."""
        return self.tag(b"extra", extra_digest.encode()).hex()

    def tenant_tag(self, tenant: str) -> str:
        """Hex tag of a tenant id (tenants.tenant_digest): what a file keeps for the per-tenant quota."""
        return self.tag(b"tenant", tenant.encode()).hex()


def open_seal(folder: str | Path, *, create: bool = True) -> Seal | None:
    """:class:`Seal` over ``folder``'s secret (None when absent and not ``create``). Raises SecretError."""
    key = load_secret(folder, create=create)
    return None if key is None else Seal(key)
