"""Model identity for the secondary KV tier: K/V written by one model must never be served to another.

A fingerprint is a small JSON-able dict: the architecture (``model_type``), a weights identity, and a digest
over both. The weights identity is, in order of preference:

- ``files``: sha256 of ``config.json``'s bytes plus the name, size and mtime of every ``*.safetensors`` file
  of a model folder (cheap; changes when the weights are replaced or touched);
- ``sample``: sha256 over every parameter's name, shape and dtype plus a strided sample of its bytes (for
  models built in memory, such as the tiny test models, which have no folder).

A model whose computation the weights identity may not tell apart carries an extra identity
(:data:`EXTRA_IDENTITY_ATTR`; a LoRA adapter's content digest, set by :mod:`mlxkv.adapters`), which is part of its
fingerprint: K/V computed with one adapter, or none, are never served to another.

Only ``digest`` is compared; the other fields are for people (``mlxkv cache ls``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

FINGERPRINT_VERSION = 1
_SHARD_NAME = re.compile(r"^rank-(\d+)-of-(\d+)-(tensor|pipeline)$")
_SAMPLE_BYTES = 4096  # bytes hashed per parameter (strided over the whole array)
#: The model attribute holding what else, beyond its weights, makes its K/V its own (a string; absent: nothing).
EXTRA_IDENTITY_ATTR = "mlxkv_extra_identity"


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def make_fingerprint(architecture: str, weights_kind: str, weights_id: str) -> dict:
    """A fingerprint dict from its parts (``digest`` derived from them)."""
    parts = {"v": FINGERPRINT_VERSION, "architecture": architecture, "weights_kind": weights_kind,
             "weights_id": weights_id}
    return {**parts, "digest": _digest(parts)}


def fingerprint_folder(path: str | Path) -> dict:
    """Fingerprint of a model folder: config.json content plus safetensors names / sizes / mtimes.

    Raises:
        ValueError: the folder has no config.json.
    """
    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder}: no config.json (expected an mlx-lm model folder)")
    raw = config.read_bytes()
    h = hashlib.sha256(raw)
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    arch = json.loads(raw).get("model_type", "unknown")
    return make_fingerprint(str(arch), "files", h.hexdigest())


def fingerprint_model(model: Any, path: str | Path | None = None) -> dict:
    """Fingerprint of a loaded mlx-lm model: by its folder when ``path`` is given, else by a weight sample; with
    the model's extra identity (:data:`EXTRA_IDENTITY_ATTR`) when it has one."""
    fingerprint = fingerprint_folder(path) if path is not None else _fingerprint_sample(model)
    extra = getattr(model, EXTRA_IDENTITY_ATTR, None)
    if extra:
        fingerprint = make_fingerprint(fingerprint["architecture"], fingerprint["weights_kind"],
                                       f"{fingerprint['weights_id']}+{extra}")
    return fingerprint


def _fingerprint_sample(model: Any) -> dict:
    """Fingerprint of a model built in memory: its parameters' names, shapes, dtypes and a strided byte sample."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, w in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}\0{tuple(w.shape)}\0{w.dtype}\0".encode())
        flat = w.reshape(-1)
        if w.dtype == mx.bfloat16:
            flat = flat.view(mx.uint16)
        step = max(1, flat.size * flat.itemsize // _SAMPLE_BYTES)
        h.update(np.array(flat[::step]).tobytes())
    args = getattr(model, "args", None)
    arch = getattr(args, "model_type", None) or getattr(model, "model_type", None) or type(model).__module__
    return make_fingerprint(str(arch), "sample", h.hexdigest())


def with_kv_quantization(fingerprint: dict, bits: int, group_size: int) -> dict:
    """``fingerprint`` for K/V stored quantized (``bits``, groups of ``group_size``): a tier folder written with
    other bits, another group size or unquantized pages has another digest, so it is never loaded as this one."""
    return make_fingerprint(fingerprint["architecture"], fingerprint["weights_kind"],
                            f"{fingerprint['weights_id']}+kv{bits}g{group_size}")


def shard_name(mode: str, rank: int, size: int) -> str:
    """The name of a rank's shard under ``--distributed``, e.g. ``rank-1-of-2-tensor``: its tier folder (inside the
    ``--kv-disk-cache`` folder) and part of its fingerprint (:func:`with_shard`)."""
    return f"rank-{rank}-of-{size}-{mode}"


def parse_shard_name(name: str) -> tuple[int, int, str] | None:
    """``(rank, size, mode)`` of a per-rank folder name (:func:`shard_name`), or None for any other name."""
    m = _SHARD_NAME.match(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)), m.group(3))


def with_shard(fingerprint: dict, shard: str) -> dict:
    """``fingerprint`` for this process's shard of each block under ``--distributed`` (``shard``: e.g.
    ``"rank-1-of-2-tensor"``, the mode, rank and world size): a folder written by another rank, another world size
    or the other mode has another digest, so its files are never served as this shard's (the disk store counts
    them as foreign and says so)."""
    return make_fingerprint(fingerprint["architecture"], fingerprint["weights_kind"],
                            f"{fingerprint['weights_id']}+{shard}")
