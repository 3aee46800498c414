"""A venv where mlxkv is installed as ``pip install .`` installs it: its runtime dependencies and nothing else.

Built offline in a few seconds:

1. mlxkv's wheel is built from a clean copy of the source tree with this environment's setuptools
   (``pip wheel --no-deps --no-build-isolation``): the same build backend ``pip install .`` runs, without the
   download of an isolated build environment, and without the ``build/`` and ``*.egg-info`` an earlier build or
   an editable install left in the tree (setuptools would package their stale files);
2. ``python -m venv --without-pip`` makes the venv (bare: not even setuptools, so nothing mlxkv forgot to declare
   is lent by the venv either);
3. the runtime dependency closure of the wheel's ``Requires-Dist`` (markers evaluated, extras followed, the test
   extra never), as installed here, is linked into the venv's site-packages: each distribution's files as its
   ``RECORD`` lists them, one symlink per top-level entry (a folder shared with a distribution outside the closure,
   such as a namespace package, is made real and linked one level down) -- never the rest of this environment;
4. ``pip --python VENV/bin/python install --no-index WHEEL`` (this environment's pip, run by the venv's
   interpreter on the venv) installs the wheel with dependencies on: pip's resolver checks that the linked
   distributions satisfy mlxkv's requirements (a missing or wrong one fails the install), and it writes the
   ``mlxkv`` entry point as a user's install does.

So an import that only the test extra provides fails there as it fails on a user's machine; what differs from a
user's ``pip install .`` is only where the dependencies' files come from (this environment, not an index).
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
#: Left out of the copy the wheel is built from: version control, environments, caches and earlier build outputs.
NOT_SOURCE = (".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
              "test_models")
#: Import names of test-extra packages that no runtime dependency brings: none may be importable in the venv.
TEST_IMPORTS = ("httpx", "openai", "anthropic", "hypothesis", "pytest", "xdist", "schemathesis", "jsonschema", "gguf")


@dataclass(frozen=True)
class FreshInstall:
    """A venv with mlxkv and its runtime dependencies only, and the wheel it was installed from."""

    root: Path
    wheel: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with this venv's ``bin`` (its ``mlxkv`` and ``python``) first on PATH
        and no ``PYTHONPATH`` / ``PYTHONHOME`` that could lend the venv other packages."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(PATH=os.pathsep.join([str(self.bin), env.get("PATH", "")]), VIRTUAL_ENV=str(self.root))
        return env


def _isolated_pip_env() -> dict[str, str]:
    """pip reads no configuration (no extra index, no find-links): only what the command line names."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _run(argv: list, what: str, **kwargs) -> None:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=_isolated_pip_env(), **kwargs)
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def build_wheel(out: Path, repo: Path = REPO) -> Path:
    """mlxkv's wheel, built from a clean copy of ``repo`` into ``out``."""
    source = out / "source"
    shutil.copytree(repo, source, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, source], "building mlxkv's wheel")
    (wheel,) = out.glob("mlxkv-*.whl")
    return wheel


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        meta = email.parser.BytesParser().parsebytes(zf.read(name), headersonly=True)
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def only_in_the_test_extra(wheel: Path) -> set[str]:
    """The distributions of the wheel's ``test`` extra that its runtime closure does not hold (canonical names)."""
    requirements = wheel_requirements(wheel)
    test = {canonicalize_name(r.name) for r in requirements if r.marker and r.marker.evaluate({"extra": "test"})
            and not _wanted(r, set())}
    return test - {canonicalize_name(d.name) for d in runtime_closure(requirements)}


def _wanted(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` applies here to a distribution installed with ``extras`` (``""``: none)."""
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""})


def runtime_closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions ``requirements`` need, transitively (markers and extras as pip applies them).

    Raises:
        AssertionError: one is not installed in this environment.
    """
    found: dict[str, metadata.Distribution] = {}
    extras_of: dict[str, set[str]] = {}
    todo = [(req, set()) for req in requirements]
    while todo:
        req, parent_extras = todo.pop()
        if not _wanted(req, parent_extras):
            continue
        key = canonicalize_name(req.name)
        extras = set(req.extras)
        if key in found and extras <= extras_of[key]:
            continue
        try:
            dist = found.get(key) or metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise AssertionError(f"{req} is needed at run time but not installed here") from None
        found[key] = dist
        extras_of[key] = extras_of.get(key, set()) | extras
        todo += [(Requirement(r), extras_of[key]) for r in dist.requires or []]
    return list(found.values())


def _owners() -> dict[Path, set[str]]:
    """Every path (file or folder, below a site folder) that some installed distribution's RECORD lists, with the
    distributions that list it or something below it."""
    owners: dict[Path, set[str]] = {}
    for dist in metadata.distributions():
        base, name = Path(dist.locate_file("")), canonicalize_name(dist.name)
        for rel in dist.files or []:
            parts = rel.parts
            if parts[0] in ("..", "/") or "__pycache__" in parts:
                continue
            for depth in range(1, len(parts) + 1):
                owners.setdefault(base.joinpath(*parts[:depth]), set()).add(name)
    return owners


def link_distributions(dists: list[metadata.Distribution], site: Path) -> None:
    """Symlink ``dists``' files into ``site``: each top-level entry whole, unless a distribution outside ``dists``
    owns something below it (then the folder is made and its entries are linked the same way)."""
    names = {canonicalize_name(d.name) for d in dists}
    owners = _owners()

    def link(target: Path, dest: Path) -> None:
        if dest.is_symlink() or dest.exists():
            return
        if owners.get(target, set()) <= names or not target.is_dir():
            dest.symlink_to(target, target_is_directory=target.is_dir())
            return
        dest.mkdir()
        for child in target.iterdir():
            if owners.get(child, set()) & names:
                link(child, dest / child.name)

    for dist in dists:
        assert dist.files is not None, f"{dist.name} has no RECORD: its files cannot be linked"
        base = Path(dist.locate_file(""))
        tops = {rel.parts[0] for rel in dist.files} - {"..", "/", "__pycache__"}
        for top in sorted(tops):
            link(base / top, site / top)


def bare_venv(path: Path) -> Path:
    """``python -m venv --without-pip path``; returns its site-packages folder."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], "python -m venv")
    return Path(subprocess.check_output([path / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path("
                                         "'purelib'))"], text=True).strip())


def pip_install(venv: Path, wheel: Path) -> subprocess.CompletedProcess:
    """Install ``wheel`` into ``venv`` offline, dependencies checked by pip's resolver (never raises)."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-index",
                           "-q", wheel], capture_output=True, text=True, env=_isolated_pip_env())


def make_fresh_install(root: Path, repo: Path = REPO) -> FreshInstall:
    """Build the venv described in the module docstring at ``root / "venv"`` (``root`` also holds the build)."""
    wheel = build_wheel(root / "wheel", repo)
    site = bare_venv(root / "venv")
    link_distributions(runtime_closure(wheel_requirements(wheel)), site)
    proc = pip_install(root / "venv", wheel)
    assert proc.returncode == 0, f"pip install of mlxkv's wheel failed:\n{proc.stdout}\n{proc.stderr}"
    return FreshInstall(root / "venv", wheel)
