"""Usage errors as one line: ``error: <what>`` on stderr and exit status 2, instead of the usage line and the
boxed panel Typer prints by default. Help (``--help``, a group called without a command) keeps Typer's format."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

# Typer (the range pyproject.toml pins) vendors its click; its exception classes are the ones raised while parsing.
from typer._click import exceptions as _click_exceptions


def one_line(exc: Any) -> str:
    """A click usage error as the single line mlxkv prints for it."""
    message = " ".join(exc.format_message().split())
    command = getattr(getattr(exc, "ctx", None), "command_path", None)
    hint = f" (`{command} --help` lists the options)" if command and isinstance(exc, _click_exceptions.UsageError) \
        and not isinstance(exc, _click_exceptions.BadParameter) else ""
    return f"error: {message}{hint}"


class _FlagHelp:
    """``--help`` listed as the flag it is (Typer would show a ``<bool>`` value after it)."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = " "
        return option


class Command(_FlagHelp, TyperCommand):
    """A command of mlxkv (``app.command(cls=Command)``): ``--help`` reads as Typer's help of the pinned range would
    not by itself: flags without a ``<bool>`` value, ``INT``/``NUMBER`` before a range instead of ``<int range>``,
    and required arguments as ``PROMPT`` rather than ``{PROMPT}`` in the usage line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name != "option" or param.metavar is not None:
                continue
            if getattr(param, "is_flag", False):
                param.metavar = " "
            elif getattr(param.type_descriptor, "is_ranged", False):
                param.metavar = "INT" if param.type_descriptor.ranged_type_name == "int" else "NUMBER"

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


class Group(_FlagHelp, TyperGroup):
    """A group of commands below the root (``mlxkv models``, ``mlxkv cache``): ``--help`` shown as a flag."""


class OneLineErrors(_FlagHelp, TyperGroup):
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
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


__all__ = ["OneLineErrors", "Command", "Group", "one_line"]
