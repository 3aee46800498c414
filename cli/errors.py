"""Usage errors as one line: ``error: <what>`` on stderr and exit status 2, instead of the usage line and the
boxed panel Typer prints by default. Help (``--help``, a group called without a command) keeps Typer's format."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

# Typer vendors its click; its exception classes are the ones raised while parsing.
try:
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover - a Typer that uses the click package
    from click import exceptions as _click_exceptions


def one_line(exc: Any) -> str:
    """A click usage error as the single line mlxkv prints for it."""
    message = " ".join(exc.format_message().split())
    command = getattr(getattr(exc, "ctx", None), "command_path", None)
    hint = f" (`{command} --help` lists the options)" if command and isinstance(exc, _click_exceptions.UsageError) \
        and not isinstance(exc, _click_exceptions.BadParameter) else ""
    return f"error: {message}{hint}"


class OneLineErrors(TyperGroup):
    """The root command group: parses and runs as Typer does, but a usage error (a bad value, an unknown option, a
    missing argument) is one line and exit status 2, and an aborted confirmation one line and exit status 1."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except _click_exceptions.NoArgsIsHelpError as exc:
            typer.echo(exc.format_message())  # `mlxkv` or `mlxkv cache` alone: the help, as asked
            sys.exit(0)
        except _click_exceptions.ClickException as exc:
            typer.echo(one_line(exc), err=True)
            sys.exit(exc.exit_code)
        except _click_exceptions.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


__all__ = ["OneLineErrors", "one_line"]
