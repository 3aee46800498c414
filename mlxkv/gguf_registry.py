"""The GGUF files a user has run (``-m FILE``), remembered in a small JSON file so ``mlxkv models`` can list them
next to the Hugging Face cache. Hub downloads need no record: the hub's cache lists itself.

The file (:func:`mlxkv.env.models_file`) holds ``{"gguf": [{"path": absolute path, "last_used": unix time}]}``;
it is rewritten atomically (a temporary file renamed over it), so a crash never leaves half a list.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mlxkv import env


@dataclass(frozen=True, slots=True)
class GGUFEntry:
    """One remembered GGUF file: ``size`` is ``None`` when the file is no longer there."""

    path: str
    last_used: float
    size: int | None


def _file() -> Path:
    return Path(env.models_file())


def _read() -> list[dict]:
    try:
        data = json.loads(_file().read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise ValueError(f"{_file()} is not a readable model list ({exc}): delete it to start a new one") from None
    items = data.get("gguf") if isinstance(data, dict) else None
    return [i for i in items or [] if isinstance(i, dict) and isinstance(i.get("path"), str)]


def _write(items: list[dict]) -> None:
    target = _file()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".models-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump({"gguf": items}, out, indent=1)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remember(path: str | os.PathLike) -> None:
    """Record that the GGUF file ``path`` was used now (moved to the front of the list).

    Raises:
        OSError: the list cannot be written; ValueError: the list file is not ours to overwrite.
    """
    absolute = str(Path(path).expanduser().resolve())
    items = [i for i in _read() if i["path"] != absolute]
    _write([{"path": absolute, "last_used": time.time()}, *items])


def entries() -> list[GGUFEntry]:
    """The remembered GGUF files, most recently used first."""
    found = []
    for item in _read():
        path = Path(item["path"])
        size = path.stat().st_size if path.is_file() else None
        found.append(GGUFEntry(path=item["path"], last_used=float(item.get("last_used") or 0), size=size))
    return found


def forget(path: str) -> bool:
    """Drop ``path`` (as listed, or any spelling of the same file) from the list; the file itself stays.
    Returns whether it was listed."""
    items = _read()
    wanted = {path, str(Path(path).expanduser().resolve())}
    kept = [i for i in items if i["path"] not in wanted]
    if len(kept) == len(items):
        return False
    _write(kept)
    return True


__all__ = ["GGUFEntry", "remember", "entries", "forget"]
