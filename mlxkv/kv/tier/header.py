"""A tier file's JSON header, parsed so that no file can crash or stall its reader.

Before JSON parsing: a size cap (:data:`MAX_HEADER_BYTES`) and a nesting cap (:data:`MAX_DEPTH`), so a header
nested 100,000 deep is refused without recursion. JSON constants (``NaN``, ``Infinity``) are refused, and
numbers too large for a float become infinity, which no field accepts. Then every field is checked for type
and bounds by :class:`TierHeader` (pydantic, strict: a string where an object belongs, a float where an
integer belongs, a bool as a number are all refused), and the array specs for consistency with each other.
Any failure is a :class:`HeaderError` (a ``ValueError``); nothing else escapes :func:`parse_header_json`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_HEADER_BYTES = 1 << 18  # ~8 KiB for a 30-layer model; room for 1,024 layers
MAX_DEPTH = 8  # the format nests 3 deep (header -> arrays -> spec -> shape)
MAX_LAYERS = 1024
MAX_DIM = 1 << 31
HEX_HASH = r"^[0-9a-f]{16,128}$"
HEX_TAG = r"^[0-9a-f]{64}$"
#: Storage dtype name -> bytes per element.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

_SPECIAL = re.compile(rb'[\[\]{}"\\]')


class HeaderError(ValueError):
    """A header that is too large, too deep, not JSON, or whose fields fail their type / bounds checks."""


_Strict = ConfigDict(strict=True, extra="forbid", frozen=True)
Count = Annotated[int, Field(ge=0, le=1 << 40)]


class Fingerprint(BaseModel):
    model_config = _Strict
    v: Annotated[int, Field(ge=0, le=1 << 16)]
    architecture: Annotated[str, Field(max_length=256)]
    weights_kind: Annotated[str, Field(max_length=64)]
    weights_id: Annotated[str, Field(max_length=256)]
    digest: Annotated[str, Field(pattern=HEX_TAG)]


class ArraySpec(BaseModel):
    model_config = _Strict
    dtype: Literal["float32", "float16", "bfloat16"]
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_DIM)]], Field(min_length=1, max_length=4)]
    offset: Count
    nbytes: Count


class TierHeader(BaseModel):
    """Every field of a tier file's header (decrypted), typed and bounded."""

    model_config = _Strict
    version: int
    fingerprint: Fingerprint
    group_id: Annotated[int, Field(ge=0, le=MAX_LAYERS)]
    layers: Annotated[list[Annotated[int, Field(ge=0, le=1 << 20)]], Field(min_length=1, max_length=MAX_LAYERS)]
    arrays: Annotated[list[ArraySpec], Field(min_length=2, max_length=2 * MAX_LAYERS)]
    payload_bytes: Count
    block_size: Annotated[int, Field(ge=1, le=1 << 20)]
    block_hash: Annotated[str, Field(pattern=HEX_HASH)]
    parent_hash: Optional[Annotated[str, Field(pattern=HEX_HASH)]]
    tokens_tag: Annotated[str, Field(pattern=HEX_TAG)]  # seal.Seal.tokens_tag: the ids are never stored
    extra_tag: Annotated[str, Field(pattern=HEX_TAG)]  # seal.Seal.extra_tag
    tenant_tag: Annotated[str, Field(pattern=HEX_TAG)]  # seal.Seal.tenant_tag (per-tenant quota)
    priority: Annotated[int, Field(ge=0, le=100)]
    created: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    # "kv": keys then values per layer, ``block_size`` rows each; "state": a recurrent-state snapshot after
    # the block ``block_hash``, one array per entry of ``layers`` (its layer), shaped as the model's caches hold it
    kind: Literal["kv", "state"] = "kv"

    def consistency_error(self) -> str | None:
        """Why the array specs disagree with each other or the header (None: they agree)."""
        state = self.kind == "state"
        if state and len(self.arrays) != len(self.layers):
            return f"{len(self.arrays)} state arrays for {len(self.layers)} layer entries (expected one each)"
        if not state and len(self.arrays) != 2 * len(self.layers):
            return f"{len(self.arrays)} arrays for {len(self.layers)} layers (expected keys and values per layer)"
        offset = 0
        for i, spec in enumerate(self.arrays):
            if spec.offset != offset:
                return f"array {i} at offset {spec.offset}, expected {offset}"
            if not state and spec.shape[0] != self.block_size:
                return f"array {i} has {spec.shape[0]} rows, block_size is {self.block_size}"
            if spec.nbytes != math.prod(spec.shape) * ITEMSIZE[spec.dtype]:
                return f"array {i}: {spec.nbytes} bytes do not match shape {spec.shape} of {spec.dtype}"
            offset += spec.nbytes
        if offset != self.payload_bytes:
            return f"arrays hold {offset} bytes, payload_bytes says {self.payload_bytes}"
        return None


def json_depth_exceeds(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests arrays / objects deeper than ``limit``: one linear pass over its
    brackets, quotes and backslashes (brackets inside strings do not count), stopping at the first bracket past
    the limit, so a hostile input costs no more than a benign one of its size."""
    depth, in_string, escaped = 0, False, -1
    for m in _SPECIAL.finditer(raw):
        i, c = m.start(), raw[m.start()]
        if i == escaped:
            continue  # the character after a backslash
        if in_string:
            if c == 0x5C:  # backslash
                escaped = i + 1
            elif c == 0x22:  # closing quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif c in (0x5D, 0x7D):
            depth -= 1
    return False


def _refuse_constant(name: str) -> float:
    raise HeaderError(f"JSON constant {name} is not allowed")


def parse_header_json(raw: bytes, version: int) -> TierHeader:
    """The checked header of a file of format ``version``.

    Raises:
        HeaderError: size, depth, JSON syntax, a field's type or bounds, or the specs' consistency.
    """
    if len(raw) > MAX_HEADER_BYTES:
        raise HeaderError(f"header of {len(raw)} bytes, more than {MAX_HEADER_BYTES}")
    if json_depth_exceeds(raw):
        raise HeaderError(f"header nested deeper than {MAX_DEPTH}")
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON syntax, huge integers
        raise HeaderError(f"unreadable header: {exc}") from None
    if not isinstance(obj, dict):
        raise HeaderError(f"header is a JSON {type(obj).__name__}, expected an object")
    if obj.get("version") != version:
        raise HeaderError(f"header version {obj.get('version')!r}, file prefix says {version}")
    try:
        header = TierHeader.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "header"
        raise HeaderError(f"{where}: {first.get('msg', 'invalid')} ({exc.error_count()} error(s))") from None
    problem = header.consistency_error()
    if problem is not None:
        raise HeaderError(problem)
    return header
