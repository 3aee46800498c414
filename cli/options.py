"""Validators shared by the commands' Typer options: a bad value names the valid choices or range."""

from __future__ import annotations

import re
from typing import Any, Callable

import typer


def one_of(*choices: Any) -> Callable[[Any], Any]:
    """A Typer callback accepting ``None`` or one of ``choices``."""
    names = ", ".join(str(c) for c in choices)

    def check(value: Any) -> Any:
        if value is not None and value not in choices:
            shown = repr(value) if isinstance(value, str) else value
            raise typer.BadParameter(f"{shown} is not one of {names}.")
        return value

    return check


check_kv_bits = one_of(4, 8)
check_kv_backend = one_of("dense", "paged")
check_cache_layout = one_of("mlxkv", "mlx-lm")
check_kv_overflow = one_of("preempt", "window", "h2o", "offload")
check_kv_group_size = one_of(32, 64, 128)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
check_log_level = one_of(*LOG_LEVELS)

# Help panels (``rich_help_panel``): the options of ``generate`` and ``serve`` grouped by what they configure.
MODEL_PANEL = "Model"
SAMPLING_PANEL = "Sampling"
KV_PANEL = "KV cache"
SPECULATIVE_PANEL = "Speculative decoding"
OUTPUT_PANEL = "Output"
SERVER_PANEL = "Server"

FLAG = " "  # metavar of on/off flags (Typer would show "<bool>", as if they took a value)

# Size units: SI with B (8GB = 8e9 bytes), binary with iB or a bare letter (8GiB = 8G = 8 * 2**30 bytes).
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _letter in enumerate("kmgt", start=1):
    _SIZE_UNITS[_letter + "b"] = 1000 ** _i
    _SIZE_UNITS[_letter + "ib"] = _SIZE_UNITS[_letter] = 1024 ** _i
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.I)


def parse_size(value: Any) -> int:
    """Bytes from a size a user typed: ``4096``, ``512MB``, ``8GB`` (SI), ``8GiB`` or ``8G`` (binary).

    Raises:
        typer.BadParameter: not a number with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise typer.BadParameter(f"{value!r} is not a size: a number of bytes or one with a unit "
                                 "(B, KB, MB, GB, TB; KiB, MiB, GiB, TiB), e.g. 8GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def check_block_size(value: int) -> int:
    if not 1 <= value <= 256 or value & (value - 1):
        raise typer.BadParameter(f"{value} is not a power of two in the range 1<=x<=256.")
    return value


def check_top_p(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter(f"{value} is not in the range 0<x<=1.")
    return value


def check_min_p(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise typer.BadParameter(f"{value} is not in the range 0<=x<1.")
    return value


#: KvCacheConfig fields -> the options that set them (errors name what the user typed).
_KV_FLAGS = {"secondary_disk_bytes": "--kv-disk-cache-size", "secondary_disk_dir": "--kv-disk-cache",
             "secondary_memory_bytes": "--host-cache-size", "kv_cache_budget": "--kv-cache-budget",
             "block_size": "--kv-block-size", "max_kv_size": "--max-kv-size", "kv_bits": "--kv-bits",
             "kv_group_size": "--kv-group-size", "secondary_tenant_share": "--kv-tenant-share",
             "primary_tenant_share": "--kv-tenant-share",
             "layout": "--cache-layout", "backend": "--kv-backend",
             "state_snapshot_interval": "--state-snapshot-interval", "kv_overflow": "--kv-overflow",
             "kv_overflow_budget": "--kv-overflow-budget", "kv_overflow_sinks": "--kv-overflow-sinks",
             "kv_overflow_recent": "--kv-overflow-recent"}


def kv_config(*, backend: str, block_size: int, max_kv_size: int | None = None, kv_bits: int | None = None,
              kv_group_size: int = 64, layout: str = "mlxkv", budget: int | None = None, host_cache_bytes: int = 0,
              disk_cache_dir: str | None = None, disk_cache_bytes: int = 0, tenant_share: float = 0.5,
              disk_write_interval_s: float = 2.0, state_snapshot_interval: int = 0, overflow: Any = None) -> Any:
    """The KV cache configuration the ``generate`` and ``serve`` options describe (one builder for both).

    Raises:
        typer.BadParameter: options that need one another or apply to the other backend, named as the user typed
            them.
    """
    from mlxkv.config import KvCacheConfig

    if disk_cache_bytes and not disk_cache_dir:
        raise typer.BadParameter("needs --kv-disk-cache (the folder of the disk tier)", param_hint="--kv-disk-cache-size")
    paged_only = [flag for flag, value in (("--kv-cache-budget", budget), ("--host-cache-size", host_cache_bytes),
                                           ("--kv-disk-cache", disk_cache_dir)) if value]
    if backend == "dense" and paged_only:
        raise typer.BadParameter("applies to the paged backend only: add --kv-backend paged",
                                 param_hint=", ".join(paged_only))
    overflow = overflow or overflow_config()
    dense_only = [flag for flag, value in (("--max-kv-size", max_kv_size), ("--cache-layout", layout != "mlxkv"))
                  if value]
    if backend == "paged" and dense_only:
        raise typer.BadParameter("applies to the dense backend only: add --kv-backend dense",
                                 param_hint=", ".join(dense_only))
    try:
        return KvCacheConfig(backend=backend, block_size=block_size, max_kv_size=max_kv_size, kv_bits=kv_bits,
                             kv_group_size=kv_group_size, layout=layout, kv_cache_budget=budget or "auto",
                             secondary_memory_bytes=host_cache_bytes, secondary_disk_dir=disk_cache_dir,
                             secondary_disk_bytes=disk_cache_bytes, secondary_tenant_share=tenant_share,
                             primary_tenant_share=tenant_share,
                             secondary_write_interval_s=disk_write_interval_s,
                             state_snapshot_interval=state_snapshot_interval, overflow=overflow)
    except ValueError as exc:
        raise typer.BadParameter(_flag_names(str(exc))) from None


def overflow_config(policy: str = "preempt", budget: int | None = None, sinks: int | None = None,
                    recent: int | None = None) -> Any:
    """The ``--kv-overflow`` options as a :class:`mlxkv.config.KvOverflowConfig` (``None``: not given).

    Raises:
        typer.BadParameter: a size without a policy that uses it, a policy without its budget, sizes that leave
            no room, named as the user typed them.
    """
    from mlxkv.config import KvOverflowConfig

    if policy == "preempt" and sinks is not None:
        raise typer.BadParameter("applies to --kv-overflow window, h2o or offload", param_hint="--kv-overflow-sinks")
    try:
        return KvOverflowConfig(policy=policy, budget=budget, sinks=4 if sinks is None else sinks, recent=recent)
    except ValueError as exc:
        raise typer.BadParameter(_flag_names(str(exc))) from None


def _flag_names(message: str) -> str:
    """A KvCacheConfig message with its field names replaced by the options that set them."""
    for field_name, flag in _KV_FLAGS.items():
        message = re.sub(rf"\b{field_name}\b", flag, message)
    return message


def with_revision(model: str | None, revision: str | None) -> str | None:
    """``model`` with ``--revision`` folded in as ``owner/name@revision`` (what the loader reads).

    Raises:
        typer.BadParameter: a revision without a repo id, or given twice.
    """
    if revision is None:
        return model
    if model is None:
        raise typer.BadParameter("needs --model owner/name (a Hugging Face repo id)", param_hint="--revision")
    from pathlib import Path

    if "@" in model or Path(model).expanduser().exists():
        raise typer.BadParameter(f"applies to a Hugging Face repo id, not {model!r} (a local path, or a revision "
                                 "given with @ already)", param_hint="--revision")
    return f"{model}@{revision}"


def sampling_defaults(*, temp: float, top_p: float, top_k: int, min_p: float, repetition_penalty: float | None,
                      max_tokens: int | None, chat_template_kwargs: str | None) -> Any:
    """The server's sampling defaults from ``mlxkv serve``'s options (``chat_template_kwargs``: a JSON object).

    Raises:
        typer.BadParameter: a value out of range or JSON that is not an object of template variables.
    """
    import json

    from mlxkv.config import SamplingDefaults

    kwargs = {}
    if chat_template_kwargs is not None:
        try:
            kwargs = json.loads(chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"not valid JSON: {exc}", param_hint="--chat-template-kwargs") from None
    try:
        return SamplingDefaults(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                                repetition_penalty=repetition_penalty, max_tokens=max_tokens,
                                chat_template_kwargs=kwargs)
    except ValueError as exc:
        hint = "--chat-template-kwargs" if "chat_template_kwargs" in str(exc) else "--repetition-penalty"
        raise typer.BadParameter(str(exc), param_hint=hint) from None


__all__ = ["one_of", "check_kv_bits", "check_kv_backend", "check_cache_layout", "check_kv_group_size",
           "check_log_level", "LOG_LEVELS", "FLAG", "parse_size", "with_revision", "check_block_size",
           "check_top_p", "check_min_p", "kv_config", "sampling_defaults"]
