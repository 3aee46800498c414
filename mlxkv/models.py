"""Model loading: a Hugging Face repo id, a local folder, or the embedded demo model.

Architectures, weights and tokenizers come from mlx-lm's loaders; this module resolves *where* the model is
(downloading through huggingface-hub with a progress bar when needed, honouring ``HF_HUB_OFFLINE`` and the
local HF cache) and turns every failure into a :class:`ModelLoadError` with one readable line.
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
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


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

    @property
    def model_type(self) -> str:
        """The architecture name from config.json (``model_type``)."""
        return str(self.config.get("model_type", "unknown"))


def demo_model_path() -> Path:
    """Folder of the small trained model shipped inside the package (the default model)."""
    return Path(str(resources.files("mlxkv") / "demo_model"))


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") != 1 or Path(spec).suffix != ""


def resolve_model_path(spec: str | None, *, progress: bool = True) -> Path:
    """Return a local folder holding the model named by ``spec``.

    Args:
        spec: ``None`` for the embedded demo model, a local folder, or a Hugging Face repo id
            (``owner/name``) that is downloaded into the standard HF cache unless already there.
        progress: show a rich progress bar while downloading.

    Raises:
        ModelLoadError: missing folder, malformed id, repo not cached while offline, download failure.
    """
    if spec is None:
        path = demo_model_path()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the embedded demo model is missing from the package ({path})")
        return path
    local = Path(spec).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelLoadError(f"model path is not a folder: {spec}")
        return local
    if _looks_like_path(spec) or not _REPO_ID.match(spec):
        raise ModelLoadError(f"model not found: {spec} is neither an existing folder nor a repo id like owner/name")
    return _download(spec, progress=progress)


def _download(repo_id: str, *, progress: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    kwargs: dict[str, Any] = {"allow_patterns": DOWNLOAD_PATTERNS}
    if progress:
        from tqdm.rich import tqdm as rich_tqdm

        kwargs["tqdm_class"] = rich_tqdm
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except hf_errors.LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{repo_id} is not in the local Hugging Face cache and downloads are off or unreachable "
            "(HF_HUB_OFFLINE or no network)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelLoadError(f"no such repository on the Hugging Face Hub: {repo_id}") from None
    except hf_errors.GatedRepoError:
        raise ModelLoadError(f"{repo_id} is gated: log in with `hf auth login` and accept its terms") from None
    except (OSError, hf_errors.HfHubHTTPError) as exc:
        raise ModelLoadError(f"could not download {repo_id}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _check_files(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"config.json in {path} is not valid JSON: {exc}") from None
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


def _upcast_on_cpu(model: Any, config: dict) -> None:
    """On the CPU backend, run float16/bfloat16 (unquantized) weights as float32.

    float32 is MLX's fast CPU dtype (half-precision matmuls bypass BLAS there), and float32 arithmetic makes
    every KV path (dense SDPA, paged reference kernel) agree token for token. GPUs keep the stored dtype.
    """
    import mlx.core as mx
    from mlx.utils import tree_map

    if mx.default_device() != mx.cpu or "quantization" in config:
        return
    halves = (mx.float16, mx.bfloat16)
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in halves else p, model.parameters()))
    # Materialise now: a lazy cast is bound to this thread's stream (serve's engine thread could not evaluate it).
    mx.eval(model.parameters())


def load(spec: str | None = None, *, progress: bool = True) -> LoadedModel:
    """Load a model and its tokenizer through mlx-lm.

    Args:
        spec: see :func:`resolve_model_path` (``None`` = embedded demo model).
        progress: show a download progress bar.

    Returns:
        The loaded model with mlxkv's attention hook installed (the cache decides how attention runs).
        On the CPU backend, half-precision weights are upcast to float32 (see :func:`_upcast_on_cpu`).

    Raises:
        ModelLoadError: with a one-line message for any failure a user can cause.
    """
    from mlx_lm.utils import load_model, load_tokenizer

    path = resolve_model_path(spec, progress=progress)
    config = _check_files(path)
    _check_architecture(config)
    try:
        model, config = load_model(path)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"could not load the model in {path}: {_one_line(exc)}") from None
    _upcast_on_cpu(model, config)
    from mlxkv.cache.hook import install_attention_hook
    from mlxkv.mla import apply_mla

    apply_mla(model)  # absorbed MLA for the DeepSeek family when MLXKV_MLA_ABSORBED=1 (no-op otherwise)
    install_attention_hook(model)  # the cache decides how attention runs
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, name=spec or "mlxkv-demo")

