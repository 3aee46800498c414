"""``mlxkv pull ID``: download a Hugging Face model into the standard cache without running it (progress on
stderr), as ``-m ID`` would on first use."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mlxkv.cli import shared_options as options
from mlxkv.cli.options import with_revision


def pull(
    model_id: str = typer.Argument(..., metavar="ID", help="A Hugging Face repo id: owner/name or owner/name@rev."),
    revision: Optional[str] = options.REVISION,
) -> None:
    """Download a Hugging Face model into the standard cache (progress on stderr); `mlxkv models` lists it."""
    if Path(model_id).expanduser().exists():
        typer.echo(f"error: {model_id} is a local path: nothing to download (-m takes it as it is)", err=True)
        raise typer.Exit(code=1)
    spec = with_revision(model_id, revision)
    from mlxkv.models import ModelLoadError, resolve_model_path

    try:
        path = resolve_model_path(spec, progress=True)
    except ModelLoadError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"{spec}: {path}")


__all__ = ["pull"]
