"""The hand-written package list in pyproject.toml must name every package we ship."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_under_mlxkv_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "mlxkv").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), "add these packages to pyproject.toml"
    assert {"mlxkv.cli", "mlxkv.metal_kernels"} <= listed
    assert config["package-dir"]["mlxkv.cli"] == "cli"


def test_cli_is_importable_as_mlxkv_cli_not_top_level():
    import importlib.util

    import mlxkv.cli.main  # noqa: F401

    assert importlib.util.find_spec("mlxkv.cli") is not None


def test_the_page_files_ship_as_package_data():
    """Every file the built-in page serves lies in mlxkv/server/ui/ and the package data pattern covers it."""
    import fnmatch

    from mlxkv.server.ui_routes import ASSETS

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for name in ASSETS:
        assert (ROOT / "mlxkv" / "server" / "ui" / name).is_file()
        assert any(fnmatch.fnmatch(f"ui/{name}", p) for p in patterns["mlxkv.server"])
