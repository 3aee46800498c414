"""The fresh install (``testkit/fresh_install.py``) the README commands run in: mlxkv imports there, no test-only
package does (so the README lines really run without the test extra), pip refuses the install when a runtime
dependency is missing, and ``mlxkv cache stats`` with no server is one error line there."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from test_hub_resolution import free_port
from testkit.fresh_install import (
    TEST_IMPORTS,
    bare_venv,
    link_distributions,
    pip_install,
    runtime_closure,
    only_in_the_test_extra,
    wheel_requirements,
)

pytestmark = pytest.mark.fresh_install

PROBE = """
import importlib.metadata, importlib.util, json, sys
import mlxkv, mlxkv.cli.main
modules, dists = json.loads(sys.argv[1])
print(json.dumps({"mlxkv": mlxkv.__file__, "prefix": sys.prefix,
                  "importable": [n for n in modules if importlib.util.find_spec(n) is not None],
                  "installed": [d.metadata["Name"] for d in importlib.metadata.distributions()
                                if d.metadata["Name"].lower().replace("_", "-") in dists]}))
"""


@pytest.mark.slow
def test_mlxkv_imports_and_no_test_only_package_does(fresh_install, tmp_path):
    test_only = only_in_the_test_extra(fresh_install.wheel)
    assert {"httpx", "openai", "anthropic", "hypothesis", "pytest"} <= test_only, test_only
    modules = [*TEST_IMPORTS, "testkit", "conftest"]
    proc = subprocess.run([fresh_install.python, "-c", PROBE, json.dumps([modules, sorted(test_only)])], cwd=tmp_path,
                          env=fresh_install.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["prefix"] == str(fresh_install.root)
    assert found["mlxkv"].startswith(str(fresh_install.root) + "/"), found  # the wheel's copy, not the checkout
    assert found["importable"] == [] and found["installed"] == [], found
    # The same probe in this (test) environment finds them all: the probe can see what it looks for.
    here = subprocess.run([sys.executable, "-c", PROBE, json.dumps([list(TEST_IMPORTS), sorted(test_only)])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seen = json.loads(here.stdout)
    assert seen["importable"] == list(TEST_IMPORTS) and len(seen["installed"]) == len(test_only), seen


@pytest.mark.slow
def test_pip_refuses_the_install_when_a_runtime_dependency_is_missing(fresh_install, tmp_path):
    """The check behind the fresh install: pip's resolver, not the linking, decides that the dependencies fit."""
    closure = runtime_closure(wheel_requirements(fresh_install.wheel))
    typer = [d for d in closure if d.name.lower() == "typer"]
    assert typer, [d.name for d in closure]
    site = bare_venv(tmp_path / "venv")
    link_distributions([d for d in closure if d not in typer], site)
    proc = pip_install(tmp_path / "venv", fresh_install.wheel)
    assert proc.returncode != 0 and "typer" in (proc.stdout + proc.stderr).lower(), proc


@pytest.mark.slow
def test_cache_stats_without_a_server_is_one_error_line(fresh_install, tmp_path):
    port = free_port()  # nothing listens there
    proc = subprocess.run([fresh_install.bin / "mlxkv", "cache", "stats", "--url", f"http://127.0.0.1:{port}"], cwd=tmp_path,
                          env=fresh_install.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc
    refused = f"[Errno {errno.ECONNREFUSED}] {os.strerror(errno.ECONNREFUSED)}"
    assert proc.stderr.splitlines() == [f"error: cannot read http://127.0.0.1:{port}/v1/cache/stats: {refused}"], (
        proc.stderr)
