"""The secondary tier's block record and its on-disk format (one file per block).

File layout (all integers little-endian)::

    magic    8 bytes   b"MLXKVBLK"
    version  u16       FORMAT_VERSION
    hlen     u32       length of the header
    header   hlen      UTF-8 JSON: fingerprint, group/layer layout, dtypes, shapes, offsets, block size,
                       block hash, parent hash, token ids, extra-keys digest, priority, created time
    payload  ...       raw array bytes, in header order (bfloat16 stored as its uint16 bit pattern)
    checksum 32 bytes  sha256 over everything before it

``decode_block`` verifies all of it (magic, version, lengths, checksum, fingerprint, expected hash, block
size and layout) and raises :class:`FormatError` on any mismatch; nothing unverified is ever returned.
Extra keys (which carry the cache salt) are stored only as a digest, never in clear.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from mlxkv.kv.blocks.hashing import encode_key

MAGIC = b"MLXKVBLK"
FORMAT_VERSION = 1
FILE_SUFFIX = ".mlxkvblk"
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
_SUM = 32
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # host storage dtype


class FormatError(ValueError):
    """A tier file or record that fails verification (corrupt, truncated, wrong model or layout)."""


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
    kv_heads, D)`` on the host; ``dtypes`` their mx dtype names.
    """

    block_hash: bytes  # chained hash (covers the parent chain and the salt)
    parent_hash: bytes | None  # hash of the chain predecessor (None: first block)
    group_id: int  # KV-cache group of the block
    layers: tuple[int, ...]  # model layer of each K/V pair in ``arrays``
    token_ids: tuple[int, ...]
    extra_digest: str  # see extra_digest()
    priority: int  # retention priority when evicted from the primary pool
    arrays: list[np.ndarray]
    dtypes: list[str]
    created: float = field(default_factory=time.time)  # wall-clock seconds

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def block_size(self) -> int:
        return len(self.token_ids)

    def layout(self) -> tuple:
        """``(layers, ((shape, dtype), ...))``: what a restoring store must match."""
        return tuple(self.layers), tuple((tuple(a.shape), d) for a, d in zip(self.arrays, self.dtypes))


def _hex(h: bytes | None) -> str | None:
    return None if h is None else h.hex()


def encode_block(block: TierBlock, fingerprint: dict) -> bytes:
    """The file bytes of ``block`` written by the model ``fingerprint``."""
    specs, offset = [], 0
    for a, d in zip(block.arrays, block.dtypes):
        specs.append({"dtype": d, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
    header = {
        "version": FORMAT_VERSION, "fingerprint": fingerprint, "group_id": block.group_id,
        "layers": list(block.layers), "arrays": specs, "payload_bytes": offset, "block_size": block.block_size,
        "block_hash": block.block_hash.hex(), "parent_hash": _hex(block.parent_hash),
        "token_ids": list(block.token_ids), "extra_digest": block.extra_digest, "priority": block.priority,
        "created": block.created,
    }
    hb = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(hb)), hb,
                     *(np.ascontiguousarray(a).tobytes() for a in block.arrays)])
    return body + hashlib.sha256(body).digest()


def parse_header(data: bytes) -> tuple[dict, int]:
    """``(header, payload start)`` from the first bytes of a file; checks magic, version and sizes only."""
    if len(data) < _PREFIX.size:
        raise FormatError("truncated: shorter than the file prefix")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("not an mlxkv tier file (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, expected {FORMAT_VERSION}")
    start = _PREFIX.size + hlen
    if len(data) < start:
        raise FormatError("truncated header")
    try:
        header = json.loads(data[_PREFIX.size:start])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
        raise FormatError("header version mismatch")
    return header, start


def file_size(header: dict, payload_start: int) -> int:
    """Total bytes a file with this header must have."""
    return payload_start + int(header["payload_bytes"]) + _SUM


def decode_block(data: bytes, fingerprint_digest: str, *, block_hash: bytes | None = None,
                 block_size: int | None = None, layout: tuple | None = None) -> TierBlock:
    """Verify and decode a file's bytes. Raises FormatError naming the first failed check."""
    header, start = parse_header(data)
    try:
        total = file_size(header, start)
    except (KeyError, TypeError, ValueError):
        raise FormatError("header lacks payload_bytes") from None
    if len(data) != total:
        raise FormatError(f"size {len(data)} bytes, header says {total} (truncated or padded)")
    if hashlib.sha256(data[:-_SUM]).digest() != data[-_SUM:]:
        raise FormatError("checksum mismatch (corrupt file)")
    fp = header.get("fingerprint") or {}
    if fp.get("digest") != fingerprint_digest:
        raise FormatError(f"written by another model ({fp.get('architecture')}, {str(fp.get('digest'))[:12]})")
    try:
        arrays, dtypes = [], []
        for spec in header["arrays"]:
            dt = np.dtype(_DTYPES[spec["dtype"]])
            lo = start + int(spec["offset"])
            raw = data[lo:lo + int(spec["nbytes"])]
            arrays.append(np.frombuffer(raw, dtype=dt).reshape(spec["shape"]).copy())
            dtypes.append(spec["dtype"])
        block = TierBlock(
            block_hash=bytes.fromhex(header["block_hash"]),
            parent_hash=None if header["parent_hash"] is None else bytes.fromhex(header["parent_hash"]),
            group_id=int(header["group_id"]), layers=tuple(int(x) for x in header["layers"]),
            token_ids=tuple(int(t) for t in header["token_ids"]), extra_digest=str(header["extra_digest"]),
            priority=int(header["priority"]), arrays=arrays, dtypes=dtypes, created=float(header["created"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"malformed header: {exc}") from None
    if block.block_size != header["block_size"]:
        raise FormatError("token count differs from block_size")
    if block_hash is not None and block.block_hash != block_hash:
        raise FormatError("block hash differs from the requested one")
    if block_size is not None and block.block_size != block_size:
        raise FormatError(f"block size {block.block_size}, expected {block_size}")
    if layout is not None and block.layout() != layout:
        raise FormatError("layer layout / dtype / shape differs from this model's")
    return block
