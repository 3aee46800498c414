"""LoRA adapters in mlx-lm's format, applied over a loaded model with mlx-lm's own loader.

An adapter folder holds ``adapter_config.json`` (``fine_tune_type``: lora, dora or full; ``num_layers``;
``lora_parameters``: rank, scale, dropout, optional keys) and ``adapters.safetensors`` (the trained tensors), as
``mlx_lm.lora`` writes them. :func:`check_adapter` reads the folder before any weights load; :func:`apply_adapter`
wraps the model's layers (:func:`mlx_lm.tuner.utils.load_adapters`: linear, quantized and embedding layers alike,
so mlx folders and GGUF files take adapters the same way) and marks the model with the adapter's identity.

The identity is a digest of both files' bytes. It is part of the model's identity wherever K/V outlive the
process (the disk tier's fingerprint, saved chat sessions): a cache written with one adapter, or none, is never
served to another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora", "full")
_DIGEST_CHUNK = 1 << 20  # bytes read at a time when hashing the weights file


class AdapterError(ValueError):
    """An adapter folder that cannot be applied; the message is one line starting with the folder, then the cause."""


@dataclass(frozen=True)
class Adapter:
    """An adapter as applied: its folder, its kind (``fine_tune_type``) and the digest of its files' bytes."""

    path: Path
    kind: str
    digest: str


def _digest(folder: Path) -> str:
    """sha256 over the config's bytes and the weights' bytes, each prefixed by its file name."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(f"{name}\0".encode())
        with open(folder / name, "rb") as f:
            while chunk := f.read(_DIGEST_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def check_adapter_folder(spec: str | Path) -> tuple[Path, str]:
    """The folder ``spec`` names and its ``fine_tune_type``, once its files and config are as mlx-lm's loader needs
    them (the tensors are not read).

    Raises:
        AdapterError: a missing folder or file, a config that is not a JSON object with ``num_layers`` and (for
            lora and dora) ``lora_parameters`` holding ``rank``, ``scale`` and ``dropout``, or an unknown
            ``fine_tune_type``; the message starts with ``spec``.
    """
    folder = Path(spec).expanduser()
    if not folder.exists():
        raise AdapterError(f"{spec}: no such folder")
    if not folder.is_dir():
        raise AdapterError(f"{spec}: not a folder (an adapter is a folder holding {CONFIG_FILE} and {WEIGHTS_FILE})")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise AdapterError(f"{spec}: no {' or '.join(missing)} in the folder (mlx-lm's adapter format)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{spec}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise AdapterError(f"{spec}: cannot read {CONFIG_FILE}: {exc.strerror or exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{spec}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise AdapterError(f"{spec}: fine_tune_type {kind!r} is not one of {', '.join(FINE_TUNE_TYPES)}")
    problem = _config_problem(config, kind)
    if problem is not None:
        raise AdapterError(f"{spec}: {CONFIG_FILE}: {problem}")
    return folder, kind


def check_adapter(spec: str | Path) -> Adapter:
    """The adapter folder ``spec`` checked (:func:`check_adapter_folder`) and named by the digest of its files.

    Raises:
        AdapterError: see :func:`check_adapter_folder`; a file that cannot be read.
    """
    folder, kind = check_adapter_folder(spec)
    try:
        digest = _digest(folder)
    except OSError as exc:
        raise AdapterError(f"{spec}: cannot read the adapter: {exc.strerror or exc}") from None
    return Adapter(path=folder, kind=kind, digest=digest)


def _config_problem(config: dict, kind: str) -> str | None:
    """What mlx-lm's loader would trip over in ``config`` (with a traceback), or None."""
    layers = config.get("num_layers")
    if not isinstance(layers, int) or isinstance(layers, bool):
        return "num_layers must be an integer (the number of last layers the adapter covers)"
    if kind == "full":
        return None
    lora = config.get("lora_parameters")
    if not isinstance(lora, dict):
        return "lora_parameters must be an object (rank, scale, dropout)"
    if "scale" not in lora and "alpha" in lora:
        return "lora_parameters has no scale (mlx-lm's LoRA config uses 'scale', not 'alpha')"
    rank = lora.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        return "lora_parameters.rank must be a positive integer"
    for name in ("scale", "dropout"):
        value = lora.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"lora_parameters.{name} must be a number"
    keys = lora.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        return "lora_parameters.keys must be a list of module names"
    return None


def model_identity(model: Any) -> str | None:
    """What besides its files makes ``model`` answer as it does (an applied adapter's digest), or None."""
    from mlxkv.kv.tier.fingerprint import EXTRA_IDENTITY_ATTR

    return getattr(model, EXTRA_IDENTITY_ATTR, None)


def apply_adapter(model: Any, adapter: Adapter) -> None:
    """Apply ``adapter`` (from :func:`check_adapter`) to ``model`` in place with mlx-lm's loader, in inference mode
    (dropout off), as ``mlx_lm.utils.load(adapter_path=...)`` does, and make its digest part of the model's
    fingerprint (:data:`mlxkv.kv.tier.fingerprint.EXTRA_IDENTITY_ATTR`).

    Raises:
        AdapterError: tensors that are not the adapter parameters of this model's layers, or of other shapes (an
            adapter trained for another model), adapter parameters the weights file lacks, or a layer mlx-lm cannot
            wrap; the first mismatch named.
    """
    from mlx_lm.tuner.utils import load_adapters

    from mlxkv.kv.tier.fingerprint import EXTRA_IDENTITY_ATTR

    where = str(adapter.path)
    try:
        load_adapters(model, str(adapter.path))
    except ValueError as exc:
        raise AdapterError(f"{where} does not fit this model: {_first_mismatch(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001 - any failure of mlx-lm's loader here is the same one-line refusal
        raise AdapterError(f"{where}: cannot load the adapter: {' '.join(str(exc).split()) or type(exc).__name__}") \
            from None
    missing = _missing_tensors(model, adapter)
    if missing:  # those layers would run mlx-lm's random initial lora_a (or no change at all)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise AdapterError(f"{where} does not fit this model: {WEIGHTS_FILE} lacks {missing[0]}{more}, which "
                           f"{CONFIG_FILE} makes an adapter parameter")
    model.eval()
    setattr(model, EXTRA_IDENTITY_ATTR, f"adapter-{adapter.digest}")


def _tensor_names(path: Path) -> set[str]:
    """The tensor names in a safetensors file, from its header (the tensors themselves are not read)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {name for name in header if name != "__metadata__"}


def _missing_tensors(model: Any, adapter: Adapter) -> list[str]:
    """The adapter parameters the config put in ``model`` that the weights file does not hold (sorted); for a
    full fine-tune, every parameter when the file holds none."""
    from mlx.utils import tree_flatten

    names = _tensor_names(adapter.path / WEIGHTS_FILE)
    params = [name for name, _ in tree_flatten(model.parameters())]
    if adapter.kind == "full":
        return [] if names else sorted(params)
    return sorted(name for name in params if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m") and name not in names)


def _first_mismatch(message: str) -> str:
    """mlx-lm's list of incompatible tensors (one per line) as one line: the first, and how many in all."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    details = lines[1:] if len(lines) > 1 and lines[0].endswith(":") else []
    if not details:
        return " ".join(lines)
    more = f" (and {len(details) - 1} more tensors)" if len(details) > 1 else ""
    return f"{details[0]}{more}"


__all__ = ["Adapter", "AdapterError", "CONFIG_FILE", "WEIGHTS_FILE", "check_adapter_folder", "check_adapter",
           "apply_adapter"]
