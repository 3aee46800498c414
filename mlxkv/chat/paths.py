"""Names and files of saved chat sessions (pure Python: the CLI checks ``--resume NAME`` before importing MLX)."""

from __future__ import annotations

import re
from pathlib import Path

SUFFIX = ".safetensors"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}")


def session_path(folder: str | Path, name: str) -> Path:
    """The file of session ``name`` in ``folder``.

    Raises:
        ValueError: ``name`` is not 1-100 letters, digits, ``_``, ``.`` or ``-`` (not starting with ``.``/``-``).
    """
    if not _NAME.fullmatch(name or ""):
        raise ValueError(f"bad session name {name!r}: use 1-100 letters, digits, '_', '.' or '-' "
                         "(starting with a letter, digit or '_')")
    return Path(folder).expanduser() / f"{name}{SUFFIX}"


def list_sessions(folder: str | Path) -> list[str]:
    """Names of the sessions saved in ``folder`` (sorted)."""
    path = Path(folder).expanduser()
    return sorted(p.name[: -len(SUFFIX)] for p in path.glob(f"*{SUFFIX}")) if path.is_dir() else []


def saved_session_path(folder: str | Path, name: str) -> Path:
    """The file of saved session ``name`` in ``folder``.

    Raises:
        ValueError: a bad name, or no such session (the message lists the saved ones).
    """
    path = session_path(folder, name)
    if not path.is_file():
        saved = ", ".join(list_sessions(folder)) or "none"
        raise ValueError(f"no saved session {name!r} in {path.parent} (saved: {saved})")
    return path


__all__ = ["SUFFIX", "session_path", "list_sessions", "saved_session_path"]
