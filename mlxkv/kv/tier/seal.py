"""The disk tier's secret and what is made with it: AES-GCM encryption of every file, keyed names and tags.

The secret (32 random bytes) lives *beside* the tier folder, as ``<folder>.secret`` (mode 0600, created on first
use), so clearing or copying the folder never takes it along. Without it, a tier file tells nothing about the
prompt that made it, and cannot be changed unnoticed:

- a file's header (layout, block hashes, tenant, priority) and its payload (the K/V rows) are each encrypted and
  authenticated with AES-GCM (``cryptography``) under a key derived from the secret, with a fresh random nonce
  per write; the payload's associated data binds it to its header, so K/V rows never appear in clear (the rows
  of layer 0's values, which are a function of the token alone, cannot be matched against the vocabulary) and
  a file edited, truncated, spliced from two files or written under another secret fails to decrypt and is
  refused, never served;
- a file's name is an HMAC of its model, group and block hash, and every block hash (a chained sha256 of the
  tokens and salt) is stored only inside the encrypted header, so a guessed prompt cannot be confirmed offline by
  hashing it, under any salt;
- inside the header a block's token ids, extra-keys digest (which carries the cache salt) and tenant are kept
  only as keyed tags (HMAC-SHA256): restore compares them with the prompt's without storing them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import time
import uuid
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SECRET_BYTES = 32
SECRET_SUFFIX = ".secret"
TAG_BYTES = 32  # HMAC-SHA256
NONCE_BYTES = 12  # AES-GCM
AEAD_TAG_BYTES = 16  # AES-GCM's authentication tag, appended to each ciphertext
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
                              f"remove it (a new one is made; what it sealed can no longer be read)")
        return os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)


def _create(path: Path) -> None:
    """Write a fresh secret to ``path`` unless one appears there first (temp file + hard link: never partial)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:  # whatever fails (a full disk while writing, say), no temp file stays behind
        try:
            if os.write(fd, secrets.token_bytes(SECRET_BYTES)) != SECRET_BYTES:
                raise OSError(f"{tmp}: short write")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        tmp.unlink(missing_ok=True)


def load_secret_file(path: Path, *, create: bool = True) -> bytes | None:
    """The 32-byte secret kept in the file ``path`` (mode 0600); made on first use when ``create`` (else None when
    absent). Shared by the disk tier (:func:`load_secret`) and saved chat sessions (mlxkv.chat.store).

    Raises:
        SecretError: the secret file is not private to this user or has the wrong size.
    """
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
    raise SecretError(f"{path}: expected {SECRET_BYTES} bytes: remove it "
                      f"(a new one is made; what it sealed can no longer be read)")


def load_secret(folder: str | Path, *, create: bool = True) -> bytes | None:
    """The secret of tier folder ``folder`` (beside it, :func:`secret_path`); made on first use when ``create``
    (else None when absent).

    Raises:
        SecretError: the secret file is not private to this user or has the wrong size.
    """
    return load_secret_file(secret_path(folder), create=create)


class SealError(ValueError):
    """A ciphertext that does not decrypt under this secret (edited, truncated, spliced, or another secret's)."""


class Seal:
    """HMAC-SHA256 tags and AES-GCM encryption under one secret. Each tag kind has its own domain label (a tag of
    one kind never passes as another kind); the encryption key is derived from the secret under a label of its
    own, so no tag ever equals key material."""

    __slots__ = ("_key", "_aead")

    def __init__(self, key: bytes):
        if len(key) != SECRET_BYTES:
            raise ValueError(f"a tier secret has {SECRET_BYTES} bytes, not {len(key)}")
        self._key = key
        self._aead = AESGCM(self.tag(b"aes-gcm key", b""))

    def encrypt(self, data: bytes, associated: bytes) -> tuple[bytes, bytes]:
        """``(nonce, ciphertext with its tag)`` of ``data``, authenticated together with ``associated``."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, data, associated)

    def decrypt(self, nonce: bytes, ciphertext: bytes, associated: bytes) -> bytes:
        """The plaintext of :meth:`encrypt`'s output. Raises SealError when anything was changed."""
        if len(nonce) != NONCE_BYTES or len(ciphertext) < AEAD_TAG_BYTES:
            raise SealError("truncated ciphertext")
        try:
            return self._aead.decrypt(nonce, ciphertext, associated)
        except InvalidTag:
            raise SealError("does not decrypt under this secret (corrupt, forged, truncated or "
                            "written under another secret)") from None

    def name_tag(self, fingerprint_digest: str, group_id: int, block_hash: bytes) -> str:
        """Hex tag naming the file of a block: nothing in a file name can be recomputed without the secret."""
        return self.tag(b"name", f"{fingerprint_digest}:{group_id}:".encode() + block_hash).hex()

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
