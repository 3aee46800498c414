"""``python -m mlxkv`` runs the command line."""

from mlxkv.cli.main import app

app(prog_name="mlxkv")
