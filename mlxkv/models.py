"""Model loading: a Hugging Face repo id, a local folder, a GGUF file, or the embedded demo model.

Architectures, weights and tokenizers come from mlx-lm's loaders (GGUF files through :mod:`mlxkv.gguf`);
this module resolves *where* the model is (downloading through huggingface-hub with progress on stderr when
needed, honouring ``HF_HUB_OFFLINE`` and the local HF cache) and turns every failure into a
:class:`ModelLoadError` with one readable line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

# Files mlx-lm needs from a repo: config, weights, tokenizer, chat templates (mirrors mlx-lm's own list).
DOWNLOAD_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
# A Hugging Face repo id as the hub names them (huggingface_hub's validate_repo_id, with the owner required):
# owner/name, each part 1-96 ASCII letters, digits, '-', '_' or '.', starting and ending with a letter, digit or
# '_'; '--' and '..' are reserved (the cache's folder names use '--'), and a name cannot end in '.git'.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_REPO_PART}/{_REPO_PART}")


class ModelLoadError(Exception):
    """A model could not be located or loaded; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    """A model ready to run: the mlx-lm module, its tokenizer wrapper, config dict and source folder."""

    model: Any
    tokenizer: Any
    config: dict
    path: Path
    name: str = field(default="")
    quantized: bool = False  # whether the weights were stored quantized (before any dequantize)
    adapter: Any = None  # the LoRA adapter applied over the weights (mlxkv.adapters.Adapter), if any

    @property
    def model_type(self) -> str:
        """The architecture name from config.json (``model_type``)."""
        return str(self.config.get("model_type", "unknown"))

    @property
    def is_gguf(self) -> bool:
        """Whether the weights came from a GGUF file."""
        return self.path.is_file()


def demo_model_path() -> Path:
    """Folder of the small trained model shipped inside the package (the default model)."""
    return Path(str(resources.files("mlxkv") / "demo_model"))


def _looks_like_path(spec: str) -> bool:
    """Whether ``spec`` names a local file or folder rather than a repo id, even if nothing is there.

    Explicit paths (``./x``, ``../x``, ``/x``, ``~/x``), Windows separators, more than one ``/`` and GGUF file
    names are paths; anything else with one ``/`` is read as a repo id (names with dots, such as
    ``Qwen/Qwen2.5-0.5B``, are ids: the hub allows dots in names).
    """
    return (spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1
            or spec.lower().endswith(".gguf"))


def _repo_id_problem(spec: str) -> str | None:
    """Why ``spec`` is not a Hugging Face repo id (``owner/name``), or ``None`` when it is one."""
    if spec.count("/") != 1:
        return "a repo id is owner/name"
    if "--" in spec or ".." in spec:
        return "'--' and '..' are not allowed in repo ids"
    if spec.endswith(".git"):
        return "a repo name cannot end in '.git'"
    for part in spec.split("/"):
        if not 1 <= len(part) <= 96:
            return "owner and name must each have 1 to 96 characters"
        bad = sorted({c for c in part if not (c.isascii() and (c.isalnum() or c in "-_."))})
        if bad:
            return f"repo ids use only ASCII letters, digits, '-', '_' and '.', not {' '.join(map(repr, bad))}"
    if not _REPO_ID.fullmatch(spec):
        return "owner and name cannot start or end with '-' or '.'"
    return None


def resolve_model_path(spec: str | None, *, progress: bool = True) -> Path:
    """Return the local folder (or GGUF file) holding the model named by ``spec``.

    Args:
        spec: ``None`` for the embedded demo model, a local folder (a Hugging Face folder, or one holding a
            single ``.gguf`` file), a ``.gguf`` file, or a Hugging Face repo id (``owner/name``) that is
            downloaded into the standard HF cache unless already there, optionally at a revision
            (``owner/name@rev``: a branch, tag or commit). What exists locally is a path; so is
            what only looks like one (see :func:`_looks_like_path`); anything else must be a repo id.
        progress: draw download progress bars (on stderr, :mod:`mlxkv.hub`).

    Raises:
        ModelLoadError: missing file or folder, malformed id, repo not cached while offline, download failure.
    """
    if spec is None:
        path = demo_model_path()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the embedded demo model is missing from the package ({path})")
        return path
    local = Path(spec).expanduser()
    if local.exists():
        if local.is_file():
            if not is_gguf(local):
                raise ModelLoadError(f"model path is neither a folder nor a GGUF file: {spec}")
            return local
        return _folder_model(local)
    if _looks_like_path(spec):
        raise ModelLoadError(f"model not found: no such file or folder: {spec}")
    from mlxkv.hub import split_revision

    try:
        repo_id, revision = split_revision(spec)
    except ValueError as exc:
        raise ModelLoadError(f"model not found: {exc}") from None
    problem = _repo_id_problem(repo_id)
    if problem is not None:
        raise ModelLoadError(f"model not found: {spec} is neither a local file or folder nor a Hugging Face "
                             f"repo id ({problem})")
    return _download(repo_id, progress=progress, revision=revision)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes)."""
    from mlxkv.gguf import is_gguf as starts_with_magic

    return path.is_file() and starts_with_magic(path)


def _folder_model(folder: Path) -> Path:
    """A Hugging Face folder as it is; a folder without config.json but with one GGUF file: that file."""
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ModelLoadError(f"{folder} holds several GGUF files ({names}): name the one to load")
    return folder  # _check_files says what is missing


def _download(repo_id: str, *, progress: bool, revision: str | None = None) -> Path:
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    from mlxkv.hub import NoProgress, StderrProgress

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=DOWNLOAD_PATTERNS,
                                                      tqdm_class=StderrProgress if progress else NoProgress))
    except hf_errors.LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{repo_id}{'@' + revision if revision else ''} is not in the local Hugging Face cache and downloads "
            "are off or unreachable (HF_HUB_OFFLINE or no network)"
        ) from None
    except hf_errors.GatedRepoError:
        raise ModelLoadError(f"{repo_id} is gated: log in with `hf auth login` and accept its terms") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelLoadError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelLoadError(f"no such repository on the Hugging Face Hub: {repo_id}") from None
    except (OSError, hf_errors.HfHubHTTPError) as exc:
        raise ModelLoadError(f"could not download {repo_id}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    """The whole message of ``exc`` on one line (a multi-line message is joined, not cut after its first line)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _check_files(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"config.json in {path} is not valid JSON: {exc}") from None
    from mlxkv.model_bounds import config_problem

    problem = config_problem(config)  # before mlx-lm builds anything from it
    if problem is not None:
        raise ModelLoadError(f"config.json in {path}: {problem}")
    if not any(path.glob("model*.safetensors")):
        raise ModelLoadError(f"no model*.safetensors weights in {path}")
    if "model_type" not in config:
        raise ModelLoadError(f"config.json in {path} has no model_type")
    return config


def _check_architecture(config: dict) -> None:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except ValueError:
        raise ModelLoadError(
            f"unsupported model_type {config['model_type']!r}: mlx-lm has no implementation for it"
        ) from None


def _load_folder(path: Path) -> tuple[Any, dict, Any]:
    from mlx_lm.utils import load_model, load_tokenizer

    config = _check_files(path)
    _check_architecture(config)
    try:
        model, config = load_model(path)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {_one_line(exc)}") from None
    return model, config, tokenizer


def _load_gguf(path: Path, dequantize: bool) -> tuple[Any, dict, Any]:
    from mlxkv.gguf import GGUFError, load_gguf

    try:
        return load_gguf(path, dequantize=dequantize)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None


def _gguf_quantized(path: Path) -> bool:
    """Whether the GGUF file at ``path`` stores any tensor in a quantized type."""
    from mlxkv.gguf.header import header_tensor_types

    with open(path, "rb") as f:
        return any(kind not in ("F32", "F16", "BF16") for kind in header_tensor_types(f).values())


def load(spec: str | None = None, *, progress: bool = True, dequantize: bool = False, chat_template: str | None = None,
         tool_parser: str | None = None, adapter_path: str | None = None) -> LoadedModel:
    """Load a model and its tokenizer through mlx-lm.

    Args:
        spec: see :func:`resolve_model_path` (``None`` = embedded demo model).
        progress: draw download progress bars (on stderr).
        dequantize: run quantized weights unquantized (float32 on the CPU backend, where MLX's quantized
            matmuls are far slower than BLAS: SmolLM2-135M Q4_1 prefills at ~9 tok/s quantized and ~130-160
            tok/s dequantized under OpenBLAS).
        chat_template: a Jinja chat template file used instead of the model's.
        tool_parser: the mlx-lm tool parser for the template's tool calls (default: the one mlx-lm infers from the
            template; see :func:`mlxkv.chat_template.with_chat_template`).
        adapter_path: a LoRA adapter folder in mlx-lm's format applied over the weights (stored quantized or not)
            with mlx-lm's loader (:mod:`mlxkv.adapters`); its digest becomes part of the model's cache identity.

    Returns:
        The loaded model with mlxkv's attention hook installed (the cache decides how attention runs).
        On the CPU backend, half-precision weights are upcast to float32 unless ``MLXKV_CPU_KEEP_DTYPE=1``
        (see :func:`mlxkv.precision.upcast_on_cpu`).

    Raises:
        ModelLoadError: with a one-line message for any failure a user can cause.
    """
    from mlxkv.adapters import AdapterError, apply_adapter, check_adapter
    from mlxkv.chat_template import check_tool_parser, read_chat_template, with_chat_template
    from mlxkv.cpu_ops import install_cpu_ops
    from mlxkv.decode_projections import install_decode_projections
    from mlxkv.memory import release_free_memory
    from mlxkv.precision import check_runs_on_cpu, dequantize_in_place, upcast_on_cpu

    try:  # a bad template file or parser name fails before the weights load
        template = read_chat_template(chat_template) if chat_template is not None else None
        check_tool_parser(tool_parser)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    try:  # the adapter's files too
        adapter = check_adapter(adapter_path) if adapter_path is not None else None
    except AdapterError as exc:
        raise ModelLoadError(f"--adapter-path {exc}") from None
    path = resolve_model_path(spec, progress=progress)
    model, config, tokenizer = _load_gguf(path, dequantize) if path.is_file() else _load_folder(path)
    if adapter is not None:  # over the weights as stored, as mlx-lm applies it (a quantized base stays quantized)
        try:
            apply_adapter(model, adapter)
        except AdapterError as exc:
            raise ModelLoadError(f"--adapter-path {exc}") from None
    tokenizer = with_chat_template(tokenizer, template, tool_parser)
    # whether the weights were stored quantized: mlx's quantized layers keep scales; a GGUF read with --dequantize
    # may have decoded its quantized tensors to float already
    quantized = any(hasattr(m, "scales") for _, m in model.named_modules()) or (path.is_file() and _gguf_quantized(path))
    if dequantize:
        config = dequantize_in_place(model, config)
    upcast_on_cpu(model)
    try:
        check_runs_on_cpu(model)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    install_cpu_ops(model, config.get("max_position_embeddings"))  # CPU: table RoPE, compiled RMSNorm (bit-equal)
    install_decode_projections(model)  # CPU: q/k/v and gate/up fused, the LM head split, for decode rows (bit-equal)
    from mlxkv.kv.layouts.attention_hook import install_attention_hook
    from mlxkv.mla import apply_mla

    if apply_mla(model) and adapter is not None:  # absorbed MLA when MLXKV_MLA_ABSORBED=1 (no-op otherwise)
        raise ModelLoadError("MLXKV_MLA_ABSORBED=1 reads the key/value up-projection's weights directly, past a "
                             "LoRA adapter's layers: unset it to run --adapter-path")
    install_attention_hook(model)  # the cache decides how attention runs
    _eval_private_arrays(model)
    release_free_memory()  # loading's transient buffers (decoded GGUF tensors, upcasts) leave the process
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, name=spec or "mlxkv-demo",
                       quantized=quantized, adapter=adapter)


def _eval_private_arrays(model: Any) -> None:
    """Evaluate the arrays modules keep outside their parameters (``_``-prefixed, e.g. DeepSeek V2's YaRN
    ``_freqs``): left lazy, they would first be computed on the engine's thread, and MLX refuses a graph built on
    another thread's stream ("There is no Stream(cpu, 0) in current thread")."""
    import mlx.core as mx

    mx.eval([v for _, m in model.named_modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)])
