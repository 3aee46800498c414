"""A structural fuzz of a GGUF file's header, run in its own process so that a native crash, a stall or a large
allocation shows as such instead of taking the test runner down.

:func:`fields` walks a valid file and names every field of its header: the magic, version and counts, each
metadata entry's key length, value type, scalar value, string length, array item type and count, and each tensor
table entry's name length, number of dimensions, dimensions, ggml type and data offset. :func:`cases` mutates
them one at a time with boundary values (and a few at once, and truncations), deterministically. Run as
``python -m testkit.gguf_fuzz BASE.gguf OUT.json [CONVERT_EVERY]``: every case goes through
:func:`mlxkv.gguf.load.translate` (header, bounds, MLX's reader, config, weights, tokenizer) and, when that
succeeds, :func:`build_model`; every ``CONVERT_EVERY``-th refused case also through :func:`convert`, which must
refuse it and write nothing. OUT gets one record per case: outcome, message, seconds and the growth of the
process's peak RSS.
"""

from __future__ import annotations

import json
import random
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

U32 = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 30, 31, 255, 1 << 16, 2**31 - 1, 2**31, 2**32 - 1]
U64 = [0, 1, 2, 31, 32, 33, 4096, 2**20, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]
FLOATS = [0.0, -1.0, 1e-30, 1.0, 1e4, 3.4e38, float("inf"), float("-inf"), float("nan")]
_INT_RANGES = {"B": (0, 255), "b": (-128, 127), "H": (0, 65535), "h": (-32768, 32767), "I": (0, 2**32 - 1),
               "i": (-2**31, 2**31 - 1), "Q": (0, 2**64 - 1), "q": (-2**63, 2**63 - 1), "?": (0, 1)}


def fields(data: bytes) -> list[tuple[int, str, str]]:
    """``(byte offset, struct format, label)`` of every field of the header of the valid GGUF file ``data``."""
    out: list[tuple[int, str, str]] = []
    pos = 0

    def take(fmt: str, label: str | None) -> int | float:
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)[0]
        if label is not None:
            out.append((pos, fmt, label))
        pos += struct.calcsize(fmt)
        return value

    def string(label: str | None) -> str:
        nonlocal pos
        n = take("Q", label)
        text = data[pos:pos + n].decode()
        pos += n
        return text

    def value(kind: int, label: str, first: bool = True) -> None:
        if kind in _SCALARS:
            take(_SCALARS[kind], f"{label}.value" if first else None)
        elif kind == _STRING:
            string(f"{label}.string_length" if first else None)
        elif kind == _ARRAY:
            item = take("I", f"{label}.array_type")
            count = take("Q", f"{label}.array_count")
            for i in range(count):
                value(item, f"{label}[0]", first=i == 0)
        else:
            raise ValueError(f"unknown type {kind}")

    take("I", "magic")
    take("I", "version")
    tensors = take("Q", "tensor_count")
    kvs = take("Q", "kv_count")
    for _ in range(kvs):
        key_at = pos
        key = string(None)
        out.append((key_at, "Q", f"kv[{key}].key_length"))
        kind = take("I", f"kv[{key}].type")
        value(kind, f"kv[{key}]")
    for _ in range(tensors):
        name_at = pos
        name = string(None)
        out.append((name_at, "Q", f"tensor[{name}].name_length"))
        dims = take("I", f"tensor[{name}].n_dims")
        for d in range(dims):
            take("Q", f"tensor[{name}].dim{d}")
        take("I", f"tensor[{name}].type")
        take("Q", f"tensor[{name}].offset")
    return out


def _values(data: bytes, offset: int, fmt: str, label: str) -> list:
    if fmt in ("f", "d"):
        return FLOATS
    original = struct.unpack_from("<" + fmt, data, offset)[0]
    lo, hi = _INT_RANGES[fmt]
    pool = U64 if fmt in ("Q", "q") else U32
    if label.endswith(".value"):  # a metadata scalar: small and boundary numbers
        pool = [0, 1, 2, 3, 4, 7, 16, 31, 32, 33, 64, 1000, 1024, 2**16, 2**31 - 1, 2**32 - 1] + \
            ([-1, -2**31] if fmt in ("b", "h", "i", "q") else [])
    return [v for v in dict.fromkeys([*pool, original - 1, original + 1, original * 2]) if lo <= v <= hi
            and v != original]


def cases(data: bytes, per_field: int = 5, seed: int = 35) -> Iterator[tuple[str, bytes]]:
    """``(label, mutated file bytes)``: every field at ``per_field`` of its boundary values (0 and the largest
    always among them), then random combinations of 2 to 4 fields and truncations inside the header."""
    rng = random.Random(seed)
    table = fields(data)
    for offset, fmt, label in table:
        values = _values(data, offset, fmt, label)
        ends = [v for v in (values[:1] + values[-4:-3]) if v in values]
        rest = [v for v in values if v not in ends]
        for v in dict.fromkeys([*ends, *rng.sample(rest, min(len(rest), per_field - len(ends)))]):
            mutated = bytearray(data)
            struct.pack_into("<" + fmt, mutated, offset, v)
            yield f"{label}={v!r}", bytes(mutated)
    for _ in range(150):
        mutated, labels = bytearray(data), []
        for offset, fmt, label in rng.sample(table, rng.randint(2, 4)):
            v = rng.choice(_values(data, offset, fmt, label) or [0])
            struct.pack_into("<" + fmt, mutated, offset, v)
            labels.append(f"{label}={v!r}")
        yield " ".join(labels), bytes(mutated)
    header_end = max(offset for offset, _, _ in table) + 8
    for cut in sorted(rng.sample(range(1, header_end), 60)):
        yield f"truncated at {cut}", data[:cut]


def _peak_mb() -> float:
    """This process's peak RSS since it started. Linux: /proc's VmHWM, since getrusage's ru_maxrss keeps the
    parent's peak across fork and exec (a child of a large test worker would report the worker's size)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kilobytes
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def run(base: Path, out: Path, convert_every: int = 10) -> None:
    import mlx.core as mx

    from mlxkv.gguf import GGUFError
    from mlxkv.gguf.load import build_model, convert, translate

    data = base.read_bytes()
    records = []
    refused = 0
    t = translate(base)  # the imports a first success pays (transformers) are no case's cost
    build_model(t.config, t.weights)
    del t
    mx.clear_cache()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "case.gguf"
        for label, mutated in cases(data):
            path.write_bytes(mutated)
            before, start = _peak_mb(), time.monotonic()
            record = {"case": label, "outcome": "ok", "message": ""}
            try:
                t = translate(path)
                build_model(t.config, t.weights)
            except GGUFError as exc:
                record.update(outcome="refused", message=str(exc))
                refused += 1
                if refused % convert_every == 0:
                    target = Path(tmp) / "out"
                    try:
                        convert(path, target)
                        record["convert"] = "wrote"
                    except GGUFError:
                        record["convert"] = "refused" if not target.exists() else "refused but wrote"
            except BaseException as exc:  # noqa: BLE001 - what the test reports: anything but a GGUFError
                record.update(outcome="crash", message=f"{type(exc).__name__}: {str(exc)[:500]}")
            record["seconds"] = time.monotonic() - start
            mx.clear_cache()  # freed buffers go back: the next case's growth is its own
            record["rss_growth_mb"] = _peak_mb() - before
            records.append(record)
    out.write_text(json.dumps({"records": records, "peak_rss_mb": _peak_mb()}))


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]), *(int(a) for a in sys.argv[3:4]))
