"""Every ``MLXKV_*`` environment flag, read here and nowhere else.

:func:`flags` is the snapshot the code reads: the environment is parsed once, at the first call (the CLI
and the server call it at startup, so a bad value is a one-line error before the model loads), and the same
:class:`Flags` object is returned from then on — no hot path parses the environment. :func:`reload` parses it
again (tests that change a flag call it). The per-flag functions below parse the current environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


def _flag(name: str, default: bool) -> bool:
    """A boolean flag: 1/true/on/yes or 0/false/off/no (any case); anything else is an error."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/true/on/yes or 0/false/off/no")


def _int(name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return value


def kv_inplace_write() -> bool:
    """``MLXKV_KV_INPLACE_WRITE`` (default on): single-token decode appends write in place."""
    return _flag("MLXKV_KV_INPLACE_WRITE", True)


def padded_prefill_override() -> bool | None:
    """Padded-prefill override: ``False`` if ``MLXKV_NO_PADDED_PREFILL`` is set (it wins), ``True`` if
    ``MLXKV_FORCE_PADDED_PREFILL`` is set, ``None`` to let the architecture's default decide."""
    if _flag("MLXKV_NO_PADDED_PREFILL", False):
        return False
    if _flag("MLXKV_FORCE_PADDED_PREFILL", False):
        return True
    return None


def paged_kernel() -> str:
    """``MLXKV_PAGED_KERNEL``: ``auto`` (Metal if available and self-checked), ``metal`` or ``reference``."""
    return _choice("MLXKV_PAGED_KERNEL", "auto", ("auto", "metal", "reference"))


def paged_decode_splits() -> int | None:
    """``MLXKV_PAGED_DECODE_SPLITS``: split-K count for paged decode; ``None`` picks by context length."""
    return _int("MLXKV_PAGED_DECODE_SPLITS", None, minimum=1)


def cascade_min_group_size() -> int:
    """``MLXKV_CASCADE_MIN_GROUP`` (default 2): fewest sequences sharing a prefix to cascade."""
    return _int("MLXKV_CASCADE_MIN_GROUP", 2, minimum=2)


def cascade_min_shared_pages() -> int:
    """``MLXKV_CASCADE_MIN_SHARED_PAGES`` (default 1): fewest shared whole pages to cascade."""
    return _int("MLXKV_CASCADE_MIN_SHARED_PAGES", 1, minimum=1)


def mla_absorbed() -> bool:
    """``MLXKV_MLA_ABSORBED`` (default off): absorbed multi-head latent attention."""
    return _flag("MLXKV_MLA_ABSORBED", False)


def mla_split_kv() -> bool:
    """``MLXKV_MLA_SPLIT_KV`` (default off): split long latent ranges; requires the absorbed path."""
    split = _flag("MLXKV_MLA_SPLIT_KV", False)
    if split and not mla_absorbed():
        raise ValueError("MLXKV_MLA_SPLIT_KV=1 requires MLXKV_MLA_ABSORBED=1")
    return split


def cpu_ops() -> bool:
    """``MLXKV_CPU_OPS`` (default on): on the CPU backend, table RoPE, compiled RMSNorm and blocked causal attention
    (``mlxkv.cpu_ops``), fused and split decode projections (``mlxkv.decode_projections``)."""
    return _flag("MLXKV_CPU_OPS", True)


def cpu_keep_dtype() -> bool:
    """``MLXKV_CPU_KEEP_DTYPE`` (default off): on the CPU backend, keep float16/bfloat16 weights (and quantized
    layers' scales) in their stored dtype instead of upcasting them to float32, so K/V and activations compute in
    the dtype a GPU would use (slower on the CPU; for checking half-precision paths)."""
    return _flag("MLXKV_CPU_KEEP_DTYPE", False)


def gguf_requantize() -> bool:
    """``MLXKV_GGUF_REQUANTIZE`` (default off): a GGUF's Q6_K and Q2_K tensors (16-weight sub-blocks with unrelated
    scales, which no MLX group holds exactly) re-quantized at 8 bits in groups of 32 instead of decoded to float
    (about half the memory of float16; not the file's weights exactly, see :mod:`mlxkv.gguf.kquants`)."""
    return _flag("MLXKV_GGUF_REQUANTIZE", False)


def api_key() -> str | None:
    """``MLXKV_API_KEY``: bearer token required by ``mlxkv serve`` on /v1 routes, if set."""
    value = os.environ.get("MLXKV_API_KEY", "").strip()
    return value or None


def models_file() -> str:
    """``MLXKV_MODELS_FILE``: the JSON list of GGUF files given to ``-m`` that ``mlxkv models`` shows
    (default ``~/.cache/mlxkv/models.json``). Read at each call: it is not a hot-path flag."""
    value = os.environ.get("MLXKV_MODELS_FILE", "").strip()
    return os.path.expanduser(value or "~/.cache/mlxkv/models.json")


#: Where ``mlxkv chat`` keeps saved sessions unless ``MLXKV_SESSIONS_DIR`` or ``--sessions-dir`` says otherwise.
DEFAULT_SESSIONS_DIR = "~/.cache/mlxkv/sessions"


def sessions_dir() -> str:
    """``MLXKV_SESSIONS_DIR``: the folder of ``mlxkv chat``'s saved sessions (default ``~/.cache/mlxkv/sessions``)."""
    value = os.environ.get("MLXKV_SESSIONS_DIR", "").strip()
    return value or DEFAULT_SESSIONS_DIR


@dataclass(frozen=True, slots=True)
class Flags:
    """Every flag's value, parsed once (see the module doc)."""

    kv_inplace_write: bool
    padded_prefill: bool | None
    paged_kernel: str
    paged_decode_splits: int | None
    cascade_min_group_size: int
    cascade_min_shared_pages: int
    mla_absorbed: bool
    mla_split_kv: bool
    cpu_ops: bool
    cpu_keep_dtype: bool
    api_key: str | None
    sessions_dir: str
    gguf_requantize: bool = False


def _read() -> Flags:
    return Flags(kv_inplace_write=kv_inplace_write(), padded_prefill=padded_prefill_override(),
                 paged_kernel=paged_kernel(), paged_decode_splits=paged_decode_splits(),
                 cascade_min_group_size=cascade_min_group_size(),
                 cascade_min_shared_pages=cascade_min_shared_pages(), mla_absorbed=mla_absorbed(),
                 mla_split_kv=mla_split_kv(), cpu_ops=cpu_ops(), cpu_keep_dtype=cpu_keep_dtype(),
                 api_key=api_key(),
                 sessions_dir=sessions_dir(), gguf_requantize=gguf_requantize())


_flags: Flags | None = None


def flags() -> Flags:
    """The flags, parsed from the environment at the first call.

    Raises:
        ValueError: a flag with a value it does not take (one line naming the flag and the valid values).
    """
    global _flags
    if _flags is None:
        _flags = _read()
    return _flags


def reload() -> Flags:
    """Parse the environment again (after a flag changed) and return the new snapshot."""
    global _flags
    _flags = None
    return flags()
