"""``python -m mlxkv.server [options]``: run ``mlxkv serve`` without the main CLI (benchmarks use it)."""

import typer

from mlxkv.cli.serve import serve

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(serve)

if __name__ == "__main__":
    app(prog_name="mlxkv-serve")
