"""The models ``mlxkv serve`` serves and the names requests pick them by: repeatable ``-m [NAME=]MODEL`` and
``--models-file`` lines of the same form.

A model's name is the ``NAME=`` given, else its folder's name or its GGUF file's stem for a local path, else the
repo id as written. A value that names an existing path is always a path, ``=`` or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional


def served_models(models: Iterable[str], models_file: Optional[str] = None) -> list[tuple[Optional[str], str]]:
    """``(name, model)`` for each ``-m`` value, then each line of ``models_file``; ``name`` is ``None`` where no
    ``NAME=`` was given (:func:`default_name` names it).

    Raises:
        ValueError: one line: an empty name or model, an unreadable or empty models file.
    """
    pairs = [split_name(value, "-m") for value in models]
    if models_file is not None:
        pairs += _read_models_file(models_file)
    return pairs


def split_name(value: str, where: str) -> tuple[Optional[str], str]:
    """``NAME=MODEL`` as ``(NAME, MODEL)``; a plain ``MODEL`` (or an existing path with ``=`` in it) as
    ``(None, MODEL)``.

    Raises:
        ValueError: an empty name or model.
    """
    value = value.strip()
    if "=" not in value or Path(value).expanduser().exists():
        if not value:
            raise ValueError(f"{where}: an empty model")
        return None, value
    name, model = (part.strip() for part in value.split("=", 1))
    if not name or not model:
        raise ValueError(f"{where}: {value!r}: expected NAME=MODEL with both parts, e.g. small=./models/SmolLM2")
    return name, model


def default_name(model: str) -> str:
    """A model's name when none was given: a local folder's name, a local file's stem, else ``model`` itself
    (a repo id, as a one-model server names it)."""
    path = Path(model).expanduser()
    if path.exists():
        return path.name if path.is_dir() else path.stem
    return model


def named(pairs: list[tuple[Optional[str], str]]) -> list[tuple[str, str]]:
    """Every pair with its name (given or :func:`default_name`).

    Raises:
        ValueError: two models with one name.
    """
    out: list[tuple[str, str]] = []
    for name, model in pairs:
        name = name or default_name(model)
        if any(name == taken for taken, _ in out):
            raise ValueError(f"two models are served as {name!r}: name them apart with -m NAME=MODEL")
        out.append((name, model))
    return out


def _read_models_file(path: str) -> list[tuple[Optional[str], str]]:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--models-file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    pairs = [split_name(line, f"--models-file {path} line {n}")
             for n, raw in enumerate(text.splitlines(), 1)
             if (line := raw.split("#", 1)[0].strip())]
    if not pairs:
        raise ValueError(f"--models-file {path}: no model in it (one [NAME=]MODEL per line)")
    return pairs
