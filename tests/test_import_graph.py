"""The package's import structure: no cycles between modules, imports run down the declared layers only, and the
engine reaches KV only through its facade.

Imports are read from the source (every ``import`` / ``from ... import`` naming an ``mlxkv`` module, inside
functions and ``TYPE_CHECKING`` blocks too), so a cycle or an upward import hidden behind a lazy import counts
as well.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mlxkv

ROOT = Path(mlxkv.__file__).parent
#: Packages outside ``mlxkv/`` installed under its name (pyproject's package-dir).
EXTRA = {"mlxkv.cli": ROOT.parent / "cli", "mlxkv.metal_kernels": ROOT.parent / "metal_kernels"}


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


def import_edges() -> list[tuple[str, int, str]]:
    """Every import of one mlxkv module by another, as ``(module, line, imported module)``."""
    known = _modules()
    edges = []
    for module, path in sorted(known.items()):
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
                    edges.append((module, node.lineno, target))
    return sorted(set(edges))


def import_graph() -> dict[str, set[str]]:
    """``{module: the mlxkv modules it imports}`` over the whole package."""
    graph: dict[str, set[str]] = {m: set() for m in _modules()}
    for module, _, target in import_edges():
        graph[module].add(target)
    return graph


#: The layers, bottom first (docs/architecture.md). A module belongs to the layer of its longest prefix (a prefix
#: covers that module and every module below it; a top package, ``mlxkv``, covers only itself). A module may import
#: modules of its own layer and of layers below it, never above.
LAYERS = (
    "mlxkv",  # the version
    "mlxkv.env",  # environment flags and paths, read in this one module
    "mlxkv.rules",  # one rule per setting: valid values and ranges, pure Python
    "mlxkv.memory",  # freed memory handed back to the system (MLX's cache, the C heap)
    "mlxkv.metal_kernels",  # .metal sources (package data)
    "mlxkv.kernels",  # paged attention and KV write: references, Metal factories, dispatch
    "mlxkv.kv.blocks",  # the block manager, pure Python
    "mlxkv.kv.tier",  # the secondary tier: evicted blocks in host memory and on disk
    "mlxkv.config",  # one config per concern (validated against the block manager's names and ranges)
    "mlxkv.cpu_ops",  # CPU fast paths: table RoPE, compiled RMSNorm, blocked causal attention
    "mlxkv.kv.layouts",  # the layer caches per attention type, the attention hook, make_caches
    "mlxkv.kv.overflow",  # budgeted full-attention caches (--kv-overflow)
    "mlxkv.mla",  # absorbed multi-head latent attention: the latent core and the attention module
    "mlxkv.kv.paged",  # paged layer caches over one block pool
    "mlxkv.kv.batching",  # B sequences' caches as one batched cache
    "mlxkv.kv",  # the facade: CachePool, Sequence
    "mlxkv.precision",  # model loading: dtypes
    "mlxkv.gguf",  # model loading: GGUF files
    "mlxkv.model_bounds",  # model loading: a model folder's config.json sizes bounded
    "mlxkv.gguf_registry",  # the GGUF files a user has run
    "mlxkv.hub",  # model loading: Hugging Face specs and progress
    "mlxkv.chat_template",  # model loading: chat template and tool parser
    "mlxkv.decode_projections",  # model loading: fused decode projections
    "mlxkv.adapters",  # model loading: LoRA adapters (mlx-lm's format)
    "mlxkv.models",  # load a model: weights, tokenizer, CPU ops, attention hook, MLA
    "mlxkv.structured",  # grammars: JSON schema, tool calls
    "mlxkv.prompt",  # user text to prompt tokens
    "mlxkv.vision",  # images: decoding, limits, keys, the vision tower through mlx-vlm
    "mlxkv.engine",  # scheduler, runner, decode loop, output, speculative decoding
    "mlxkv.distributed",  # ranks running one engine step together
    "mlxkv.chat",  # interactive chat sessions
    "mlxkv.server",  # HTTP
    "mlxkv.cli",  # the command line
    "mlxkv.server.__main__",  # entry point: python -m mlxkv.server (the CLI's serve)
    "mlxkv.__main__",  # entry point: python -m mlxkv
)

#: Upward imports allowed, each ``(module, imported module): why``. Keep it short: fix an import rather than add it.
ALLOWED_UPWARD = {
    ("mlxkv.kv.layouts.model_layouts", "mlxkv.kv.overflow"):
        "make_caches picks every layer's layout, an overflow policy's included; moving it above kv.overflow "
        "changes the import path of make_caches for the ~20 modules, tests and scripts that import it from "
        "mlxkv.kv.layouts",
}


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the layer ``module`` belongs to (its longest prefix), or None."""
    covering = [i for i, prefix in enumerate(layers)
                if module == prefix or ("." in prefix and module.startswith(prefix + "."))]
    return max(covering, key=lambda i: len(layers[i]), default=None)


def upward_imports(edges, layers: tuple[str, ...] = LAYERS, allowed=ALLOWED_UPWARD) -> list[str]:
    """``module:line -> target (layer -> higher layer)`` for every import of a higher layer's module."""
    found = []
    for module, line, target in edges:
        low, high = layer_of(module, layers), layer_of(target, layers)
        if low is not None and high is not None and high > low and (module, target) not in allowed:
            found.append(f"{module}:{line} -> {target} ({layers[low]} imports {layers[high]})")
    return found


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


def test_every_module_belongs_to_a_layer():
    assert [m for m in sorted(_modules()) if layer_of(m) is None] == []


def test_imports_run_down_the_layers():
    upward = upward_imports(import_edges())
    assert upward == [], "imports of a higher layer:\n" + "\n".join(upward)


def test_the_allowed_upward_imports_are_still_needed():
    """An allow-list entry whose import is gone is removed with it."""
    edges = {(m, t) for m, _, t in import_edges()}
    assert [pair for pair in ALLOWED_UPWARD if pair not in edges] == []


def test_the_layer_checker_finds_upward_imports():
    layers = ("pkg", "pkg.low", "pkg.mid", "pkg.mid.top", "pkg.high")
    edges = [("pkg.low.a", 3, "pkg.high.b"),  # up two layers
             ("pkg.mid.x", 7, "pkg.mid.top.y"),  # up into a sub-layer that has a longer prefix
             ("pkg.mid.top.y", 9, "pkg.mid.x"),  # down: allowed
             ("pkg.high", 1, "pkg.low.a"),  # down: allowed
             ("pkg.low.a", 5, "pkg.low.c"),  # the same layer: allowed
             ("pkg.low.a", 6, "pkg.other")]  # outside every layer: the membership test's job
    assert upward_imports(edges, layers, {}) == [
        "pkg.low.a:3 -> pkg.high.b (pkg.low imports pkg.high)",
        "pkg.mid.x:7 -> pkg.mid.top.y (pkg.mid imports pkg.mid.top)",
    ]
    assert upward_imports(edges, layers, {("pkg.low.a", "pkg.high.b"): "why"}) == [
        "pkg.mid.x:7 -> pkg.mid.top.y (pkg.mid imports pkg.mid.top)",
    ]
    assert layer_of("pkg.other", layers) is None and layer_of("pkg", layers) == 0
    assert layer_of("pkg.mid.top.z", layers) == 3


def test_the_architecture_page_lists_the_layers_in_order():
    """docs/architecture.md's layer table names every layer below the top package, bottom first."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    table = text.split("## Layers", 1)[1].split("\n\n")[2]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    listed = ["mlxkv." + name for row in rows for name in re.findall(r"`([^`]+)`", row)]
    assert listed == list(LAYERS[1:])


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
