"""The secondary tier's block record and its on-disk format (one file per block).

File layout (all integers little-endian)::

    magic          8 bytes   b"MLXKVBLK"
    version        u16       FORMAT_VERSION
    hlen           u32       length of the header's ciphertext (at most header.MAX_HEADER_BYTES + 16)
    header nonce   12 bytes
    header         hlen      AES-GCM ciphertext and tag (seal.Seal.encrypt) of the UTF-8 JSON header
                             (header.TierHeader): fingerprint, group/layer layout, dtypes, shapes, offsets, block
                             size, block hash, parent hash, keyed tags of the token ids, of the extra-keys digest
                             and of the tenant, priority, created time; associated data: the three fields above
    payload nonce  12 bytes
    payload        ...       AES-GCM ciphertext and tag of the raw array bytes, in header order (bfloat16 stored as
                             its uint16 bit pattern); associated data: everything before the payload nonce

A file is named by a keyed tag of its model, group and block hash (seal.Seal.name_tag), never by the hash. The
header decrypts on its own, so a folder scan reads no payload; the payload's associated data binds it to that
header. ``decode_block`` verifies all of it (magic, version, lengths, both ciphertexts, every header field's type
and bounds, fingerprint, expected hash, block size and layout) and raises :class:`FormatError` on any mismatch;
nothing unverified is ever returned. Token ids and extra keys (which carry the cache salt) are not stored even
encrypted: restore needs only to compare them with the prompt's, which the keyed tags allow
(:meth:`TierBlock.matches`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from mlxkv.kv.blocks.hashing import encode_key
from mlxkv.kv.tier.header import MAX_HEADER_BYTES, HeaderError, TierHeader, parse_header_json
from mlxkv.kv.tier.seal import AEAD_TAG_BYTES, NONCE_BYTES, Seal, SealError
from mlxkv.kv.tier.tenants import UNSALTED

MAGIC = b"MLXKVBLK"
FORMAT_VERSION = 3
FILE_SUFFIX = ".mlxkvblk"
PREFIX = struct.Struct("<8sHI")  # magic, version, header length
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # host storage dtype
MAX_SEALED_HEADER = MAX_HEADER_BYTES + AEAD_TAG_BYTES


class FormatError(ValueError):
    """A tier file or record that fails verification (corrupt, forged, truncated, wrong model or layout)."""


class OldFormatError(FormatError):
    """A tier file of another format version: never readable by this one."""


def extra_digest(extra_keys: tuple) -> str:
    """Digest of a block's extra keys (salt, LoRA, media keys): compared on restore, never stored in clear."""
    return hashlib.sha256(encode_key(tuple(extra_keys))).hexdigest()


def to_host(a) -> tuple[np.ndarray, str]:
    """An mx array copied to host memory as ``(numpy array, mx dtype name)`` (bfloat16 as uint16 bits)."""
    import mlx.core as mx

    name = str(a.dtype).split(".")[-1]
    if name not in _DTYPES:
        raise ValueError(f"secondary tier stores float32, float16 or bfloat16 K/V, not {name}")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=True), name


def to_mx(a: np.ndarray, name: str):
    """Inverse of :func:`to_host`."""
    import mlx.core as mx

    out = mx.array(a)
    return out.view(mx.bfloat16) if name == "bfloat16" else out


@dataclass(slots=True, eq=False)
class TierBlock:
    """One full KV block of one group, off the primary pool: K/V of every layer of the group plus identity.

    ``arrays`` holds keys then values per layer: ``[k_l0, v_l0, k_l1, v_l1, ...]``, each ``(block_size,
    kv_heads, D)`` on the host; ``dtypes`` their mx dtype names. A ``kind="state"`` record is a recurrent-state
    snapshot instead (tier/state_tier.py).
    """

    block_hash: bytes  # chained hash (covers the parent chain and the salt)
    parent_hash: bytes | None  # hash of the chain predecessor (None: first block)
    group_id: int  # KV-cache group of the block
    layers: tuple[int, ...]  # model layer of each K/V pair in ``arrays``
    token_ids: tuple[int, ...] | None  # None on a block read from disk (its file keeps only ``tokens_tag``)
    extra_digest: str  # see extra_digest(); on a block read from disk, ``seal.extra_tag`` of it
    priority: int  # retention priority when evicted from the primary pool
    arrays: list[np.ndarray]
    dtypes: list[str]
    created: float = field(default_factory=time.time)  # wall-clock seconds
    seal: Seal | None = None  # set (by decode_block) on a block read from disk: the key of its tags
    tokens_tag: str | None = None  # seal.tokens_tag of the token ids, on a block read from disk
    tenant: str | None = None  # tenants.tenant_digest (None: unknown); read from disk: seal.tenant_tag of it
    kind: str = "kv"  # "state": a recurrent-state snapshot (tier/state_tier.py): one array per ``layers`` entry
    span: int | None = None  # "state" only: the block size its key's blocks have (its arrays have no token rows)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def block_size(self) -> int:
        if self.span is not None:
            return self.span
        return int(self.arrays[0].shape[0]) if self.arrays else len(self.token_ids or ())

    def matches(self, token_ids: tuple[int, ...], digest: str) -> bool:
        """Whether this block holds the K/V of ``token_ids`` under extra keys with :func:`extra_digest`
        ``digest`` (compared in clear in memory, through the keyed tags for a block read from disk)."""
        if self.seal is None:
            return self.token_ids == tuple(token_ids) and self.extra_digest == digest
        return (self.tokens_tag is not None
                and hmac.compare_digest(self.tokens_tag, self.seal.tokens_tag(self.block_hash, token_ids))
                and hmac.compare_digest(self.extra_digest, self.seal.extra_tag(digest)))

    def tags(self, seal: Seal) -> tuple[str, str, str | None]:
        """``(tokens tag, extra tag, tenant tag or None when unknown)`` for a file sealed with ``seal``.

        Raises:
            FormatError: a block read from disk under another secret (its clear values are gone).
        """
        if self.seal is None:
            return (seal.tokens_tag(self.block_hash, self.token_ids or ()), seal.extra_tag(self.extra_digest),
                    None if self.tenant is None else seal.tenant_tag(self.tenant))
        if self.seal is not seal or self.tokens_tag is None:
            raise FormatError("a block read from another tier folder cannot be re-sealed")
        return self.tokens_tag, self.extra_digest, self.tenant

    def layout(self) -> tuple:
        """``(layers, ((shape, dtype), ...))``: what a restoring store must match."""
        return tuple(self.layers), tuple((tuple(a.shape), d) for a, d in zip(self.arrays, self.dtypes))


def _hex(h: bytes | None) -> str | None:
    return None if h is None else h.hex()


def file_tenant(block: TierBlock, seal: Seal, inherited: str | None = None) -> str:
    """The tenant tag a file of ``block`` records: its own tenant's, else ``inherited`` (its parent's), else the
    unsalted tenant's."""
    own = block.tags(seal)[2]
    return own or inherited or seal.tenant_tag(UNSALTED)


def seal_file(seal: Seal, header: bytes, payload: bytes, version: int = FORMAT_VERSION) -> bytes:
    """The file bytes around a header's JSON bytes and a payload, encrypted under ``seal`` (the one writer of the
    layout; tests use it to make files only the secret's holder could make)."""
    nonce, sealed = seal.encrypt(header, PREFIX.pack(MAGIC, version, len(header) + AEAD_TAG_BYTES))
    head = PREFIX.pack(MAGIC, version, len(sealed)) + nonce + sealed
    pnonce, body = seal.encrypt(payload, head)
    return head + pnonce + body


def encode_block(block: TierBlock, fingerprint: dict, seal: Seal, tenant_tag: str | None = None) -> bytes:
    """The file bytes of ``block`` written by the model ``fingerprint``, sealed with ``seal`` (``tenant_tag``:
    the tenant tag to record when the block's own tenant is unknown; else the unsalted tenant's)."""
    specs, offset = [], 0
    for a, d in zip(block.arrays, block.dtypes):
        specs.append({"dtype": d, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
    tokens_tag, extra_tag, _ = block.tags(seal)
    tenant = file_tenant(block, seal, tenant_tag)
    header = {
        "version": FORMAT_VERSION, "fingerprint": fingerprint, "group_id": block.group_id,
        "layers": list(block.layers), "arrays": specs, "payload_bytes": offset, "block_size": block.block_size,
        "block_hash": block.block_hash.hex(), "parent_hash": _hex(block.parent_hash), "tokens_tag": tokens_tag,
        "extra_tag": extra_tag, "tenant_tag": tenant, "priority": block.priority, "created": float(block.created),
    }
    if block.kind != "kv":
        header["kind"] = block.kind
    hb = json.dumps(header, separators=(",", ":")).encode()
    return seal_file(seal, hb, b"".join(np.ascontiguousarray(a).tobytes() for a in block.arrays))


def read_prefix(data: bytes) -> tuple[int, int]:
    """``(version, header ciphertext length)`` from a file's first bytes.

    Raises:
        FormatError: not our magic, or a header length out of bounds; OldFormatError: another format version.
    """
    if len(data) < PREFIX.size:
        raise FormatError("truncated: shorter than the file prefix")
    magic, version, hlen = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("not an mlxkv tier file (bad magic)")
    if version != FORMAT_VERSION:
        raise OldFormatError(f"format version {version}, this mlxkv reads {FORMAT_VERSION}")
    if not AEAD_TAG_BYTES <= hlen <= MAX_SEALED_HEADER:
        raise FormatError(f"header length {hlen}, outside {AEAD_TAG_BYTES}..{MAX_SEALED_HEADER}")
    return version, hlen


def header_end(hlen: int) -> int:
    """Bytes from the file's start through the header's ciphertext, for a ciphertext of ``hlen`` bytes."""
    return PREFIX.size + NONCE_BYTES + hlen


def open_header(data: bytes, seal: Seal) -> tuple[int, bytes, int]:
    """``(version, header JSON bytes, payload start)`` from a file's first :func:`header_end` bytes (more is
    fine), decrypted and authenticated. Raises FormatError."""
    version, hlen = read_prefix(data)
    end = header_end(hlen)
    if len(data) < end:
        raise FormatError("truncated header")
    try:
        raw = seal.decrypt(data[PREFIX.size:PREFIX.size + NONCE_BYTES], data[PREFIX.size + NONCE_BYTES:end],
                           data[:PREFIX.size])
    except SealError as exc:
        raise FormatError(f"header {exc}") from None
    return version, raw, end


def parse_header(data: bytes, seal: Seal) -> tuple[TierHeader, int]:
    """``(header, payload start)`` from a file's first :func:`header_end` bytes (more is fine): checks the
    prefix, decrypts the header, then checks every field (header.parse_header_json). Raises FormatError."""
    version, raw, end = open_header(data, seal)
    try:
        header = parse_header_json(raw, version)
    except HeaderError as exc:
        raise FormatError(f"malformed header: {exc}") from None
    return header, end


def file_size(header: TierHeader, payload_start: int) -> int:
    """Total bytes a file with this header must have."""
    return payload_start + NONCE_BYTES + header.payload_bytes + AEAD_TAG_BYTES


def decode_block(data: bytes, seal: Seal, fingerprint_digest: str, *, block_hash: bytes | None = None,
                 block_size: int | None = None, layout: tuple | None = None) -> TierBlock:
    """Verify and decode a file's bytes. Raises FormatError naming the first failed check."""
    header, start = parse_header(data, seal)
    total = file_size(header, start)
    if len(data) != total:
        raise FormatError(f"size {len(data)} bytes, header says {total} (truncated or padded)")
    try:
        payload = seal.decrypt(data[start:start + NONCE_BYTES], data[start + NONCE_BYTES:], data[:start])
    except SealError as exc:
        raise FormatError(f"payload {exc}") from None
    if header.fingerprint.digest != fingerprint_digest:
        fp = header.fingerprint
        raise FormatError(f"written by another model ({fp.architecture}, {fp.digest[:12]})")
    arrays, dtypes = [], []
    for spec in header.arrays:  # offsets, sizes and shapes checked consistent by parse_header
        lo = spec.offset
        arrays.append(np.frombuffer(payload[lo:lo + spec.nbytes], dtype=_DTYPES[spec.dtype]).reshape(spec.shape).copy())
        dtypes.append(spec.dtype)
    block = TierBlock(
        block_hash=bytes.fromhex(header.block_hash),
        parent_hash=None if header.parent_hash is None else bytes.fromhex(header.parent_hash),
        group_id=header.group_id, layers=tuple(header.layers), token_ids=None, extra_digest=header.extra_tag,
        priority=header.priority, arrays=arrays, dtypes=dtypes, created=header.created, seal=seal,
        tokens_tag=header.tokens_tag, tenant=header.tenant_tag, kind=header.kind,
        span=header.block_size if header.kind == "state" else None,
    )
    if block_hash is not None and block.block_hash != block_hash:
        raise FormatError("block hash differs from the requested one")
    if block_size is not None and block.block_size != block_size:
        raise FormatError(f"block size {block.block_size}, expected {block_size}")
    if layout is not None and block.layout() != layout:
        raise FormatError("layer layout / dtype / shape differs from this model's")
    return block
