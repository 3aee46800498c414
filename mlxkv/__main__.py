"""``python -m mlxkv`` runs the command line."""

from mlxkv.cli.main import main

main()
