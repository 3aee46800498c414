"""``mlxkv models``: the models on this machine — Hugging Face cache repos and the GGUF files given to ``-m`` —
with their sizes; ``mlxkv models rm ID`` deletes a cached repo or forgets a GGUF file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import typer

from mlxkv.cli.errors import Command, Group

from mlxkv.cli.options import FLAG

models_app = typer.Typer(cls=Group, no_args_is_help=False, add_completion=False, pretty_exceptions_enable=False)


def human_size(n: Optional[int]) -> str:
    """``1.2 GB``-style size (SI units, as the size options read them); ``missing`` for ``None``."""
    if n is None:
        return "missing"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - loop returns


@dataclass(frozen=True, slots=True)
class _Row:
    model: str
    size: Optional[int]
    source: str
    last_used: float


def _hub_cache():
    """The Hugging Face cache as ``scan_cache_dir`` reads it, or ``None`` when there is none yet."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:  # the folder at call time (constants can change after import; scan_cache_dir's default cannot)
        return scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return None


def _hub_repos(cache) -> list:
    return sorted((r for r in (cache.repos if cache else ()) if r.repo_type == "model"), key=lambda r: r.repo_id)


def remember_gguf(loaded) -> None:
    """Record a loaded GGUF model for ``mlxkv models`` (a list that cannot be written is not worth failing a run)."""
    if not loaded.is_gguf:
        return
    from mlxkv import gguf_registry

    try:
        gguf_registry.remember(loaded.path)
    except (OSError, ValueError):
        pass  # the list is a convenience; the run the user asked for goes on


def _gguf_spellings(model_id: str) -> list[str]:
    """The GGUF paths ``model_id`` may name as listed: itself, the file it names, or the one GGUF file of the
    folder it names (``-m`` takes such a folder too)."""
    from pathlib import Path

    path = Path(model_id).expanduser()
    spellings = [model_id, str(path.resolve())]
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            spellings.append(str(found[0].resolve()))
    return spellings


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


@models_app.callback(invoke_without_command=True)
def models(ctx: typer.Context,
           as_json: bool = typer.Option(False, "--json", metavar=FLAG, help="A JSON list (model, bytes, source, last_used) "
                                                                 "instead of a table.")) -> None:
    """List the models in the Hugging Face cache and the GGUF files used before, with their sizes."""
    if ctx.invoked_subcommand is not None:
        return
    from mlxkv import gguf_registry

    try:
        ggufs = gguf_registry.entries()
    except ValueError as exc:
        _fail(str(exc))
    rows = [_Row(r.repo_id, r.size_on_disk, "hf cache", r.last_accessed) for r in _hub_repos(_hub_cache())]
    rows += [_Row(g.path, g.size, "gguf", g.last_used) for g in ggufs]
    if as_json:
        import json

        typer.echo(json.dumps([{"model": r.model, "bytes": r.size, "source": r.source, "last_used": r.last_used}
                               for r in rows]))
        return
    if not rows:
        typer.echo("no models yet: `mlxkv generate -m owner/name ...` downloads one into the Hugging Face cache, "
                   "and GGUF files given to -m are listed here after their first use", err=True)
        return
    width = max(len("MODEL"), *(len(r.model) for r in rows))
    typer.echo(f"{'MODEL':<{width}}  {'SIZE':>9}  {'SOURCE':<8}  LAST USED")
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_used)) if r.last_used else "-"
        typer.echo(f"{r.model:<{width}}  {human_size(r.size):>9}  {r.source:<8}  {used}")


@models_app.command("rm", cls=Command)
def rm(
    model_id: str = typer.Argument(..., metavar="ID", help="A repo id (owner/name) or a GGUF path as listed."),
    yes: bool = typer.Option(False, "--yes", "-y", metavar=FLAG, help="Do not ask for confirmation."),
) -> None:
    """Delete a model from the Hugging Face cache, or forget a GGUF file (the file itself is kept); asks first."""
    from mlxkv import gguf_registry

    cache = _hub_cache()
    repo = next((r for r in _hub_repos(cache) if r.repo_id == model_id), None)
    if repo is not None:
        if not yes:
            typer.confirm(f"delete {repo.repo_id} ({human_size(repo.size_on_disk)}) from the Hugging Face cache?",
                          abort=True, err=True)
        strategy = cache.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
        strategy.execute()
        typer.echo(f"deleted {repo.repo_id} ({human_size(strategy.expected_freed_size)} freed)")
        return
    try:
        listed = {g.path for g in gguf_registry.entries()}
    except ValueError as exc:
        _fail(str(exc))
    gguf = next((p for p in _gguf_spellings(model_id) if p in listed), None)
    if gguf is not None:
        if not yes:
            typer.confirm(f"forget {gguf}? (the file stays where it is)", abort=True, err=True)
        gguf_registry.forget(gguf)
        typer.echo(f"forgot {gguf}")
        return
    _fail(f"no model {model_id!r} in the Hugging Face cache or the GGUF list (`mlxkv models` lists them)")


__all__ = ["models_app", "human_size", "remember_gguf"]
