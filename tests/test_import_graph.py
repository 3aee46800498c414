"""The package's import structure: no cycles between modules, and the engine reaches KV only through its facade.

Imports are read from the source (every ``import`` / ``from ... import`` naming an ``mlxkv`` module, inside
functions too), so a cycle hidden behind a lazy import counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mlxkv

ROOT = Path(mlxkv.__file__).parent
#: Packages outside ``mlxkv/`` installed under its name (pyproject's package-dir).
EXTRA = {"mlxkv.cli": ROOT.parent / "cli"}


def _modules() -> dict[str, Path]:
    found = {}
    for base, folder in {"mlxkv": ROOT, **EXTRA}.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([base, *parts])] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported dotted name belongs to (``mlxkv.kv.KVStore`` -> ``mlxkv.kv``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """``{module: the mlxkv modules it imports}`` over the whole package."""
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{a.name}" for a in node.names]  # a submodule, else an attribute of base
            for name in names:
                target = _resolve(name, known)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that ends where it starts), or None. A package importing its own modules
    (``__init__`` re-exports) is not a cycle unless a module of it imports the package back."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_engine_reaches_the_kv_cache_only_through_its_facade():
    """Engine modules import ``mlxkv.kv`` (the store and the sequence handle), never a module below it."""
    below = sorted((m, n) for m, imported in import_graph().items() if m.startswith("mlxkv.engine")
                   for n in imported if n.startswith("mlxkv.kv."))
    assert below == []


def test_the_server_and_the_cli_do_not_reach_into_the_kv_cache():
    """HTTP and the command line talk to engines; only ``mlxkv cache`` reads the disk tier's files."""
    graph = import_graph()
    reach = sorted((m, n) for m, imported in graph.items() if m.startswith(("mlxkv.server", "mlxkv.cli"))
                   for n in imported if n.startswith("mlxkv.kv") and m != "mlxkv.cli.cache")
    assert reach == []
