"""Validators of the commands' Typer options (a bad value names the valid choices or range) and the builders of
the config dataclasses from options, whose ValueError becomes the usual one-line option error."""

from __future__ import annotations

import re
from typing import Any, Callable

import typer

from mlxkv import rules


def from_rule(rule: rules.Rule) -> Callable[[Any], Any]:
    """A Typer callback refusing what ``rule`` refuses (the config dataclasses apply the same rule), as the usual
    option error; ``None`` (an option not given) passes."""

    def check(value: Any) -> Any:
        if value is not None and (why := rule.problem(value)) is not None:
            raise typer.BadParameter(why)
        return value

    return check


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
check_log_level = from_rule(rules.OneOf(LOG_LEVELS))

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


#: KvCacheConfig fields -> the options that set them (errors name what the user typed).
_KV_FLAGS = {"secondary_disk_bytes": "--kv-disk-cache-size", "secondary_disk_dir": "--kv-disk-cache",
             "secondary_memory_bytes": "--host-cache-size", "kv_cache_budget": "--kv-cache-budget",
             "block_size": "--kv-block-size", "max_kv_size": "--max-kv-size", "kv_bits": "--kv-bits",
             "kv_group_size": "--kv-group-size", "secondary_tenant_share": "--kv-tenant-share",
             "primary_tenant_share": "--kv-tenant-share",
             "layout": "--cache-layout", "backend": "--kv-backend",
             "state_snapshot_interval": "--state-snapshot-interval", "kv_overflow": "--kv-overflow",
             "kv_overflow_budget": "--kv-overflow-budget", "kv_overflow_sinks": "--kv-overflow-sinks",
             "kv_overflow_recent": "--kv-overflow-recent", "preallocate": "--kv-preallocate",
             "idle_release_s": "--kv-idle-release"}
#: SamplingDefaults fields -> their options (their messages keep the field name: a request's field too).
_FLAGS = {**_KV_FLAGS, "temp": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
          "max_tokens": "--max-tokens", "repetition_penalty": "--repetition-penalty",
          "chat_template_kwargs": "--chat-template-kwargs"}


def kv_config(*, backend: str, block_size: int, max_kv_size: int | None = None, kv_bits: int | None = None,
              kv_group_size: int = 64, layout: str = "mlxkv", budget: int | None = None, host_cache_bytes: int = 0,
              disk_cache_dir: str | None = None, disk_cache_bytes: int = 0, tenant_share: float = 0.5,
              disk_write_interval_s: float = 2.0, state_snapshot_interval: int = 0, overflow: Any = None,
              preallocate: bool = False, idle_release_s: float | None = None) -> Any:
    """The KV cache configuration the ``generate`` and ``serve`` options describe (one builder for both).

    Raises:
        typer.BadParameter: options that need one another or apply to the other backend, named as the user typed
            them.
    """
    from mlxkv.config import KvCacheConfig

    if disk_cache_bytes and not disk_cache_dir:
        raise typer.BadParameter("needs --kv-disk-cache (the folder of the disk tier)", param_hint="--kv-disk-cache-size")
    paged_only = [flag for flag, value in (("--kv-cache-budget", budget), ("--host-cache-size", host_cache_bytes),
                                           ("--kv-disk-cache", disk_cache_dir), ("--kv-preallocate", preallocate),
                                           ("--kv-idle-release", idle_release_s is not None)) if value]
    if backend == "dense" and paged_only:
        raise typer.BadParameter("applies to the paged backend only: add --kv-backend paged",
                                 param_hint=", ".join(paged_only))
    if preallocate and idle_release_s is not None:
        raise typer.BadParameter("a preallocated pool keeps its memory: drop --kv-idle-release or --kv-preallocate",
                                 param_hint="--kv-idle-release")
    growth = {"preallocate": preallocate, **({} if idle_release_s is None else {"idle_release_s": idle_release_s})}
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
                             state_snapshot_interval=state_snapshot_interval, overflow=overflow, **growth)
    except ValueError as exc:
        raise option_error(exc) from None


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
        raise option_error(exc) from None


def option_error(exc: ValueError) -> typer.BadParameter:
    """A config dataclass's ValueError as the usual option error: a rule's message about one field
    (``temp: 2.5 is not ...``) is that option's error; in others the KV fields are named as their options."""
    message = str(exc)
    field_name, colon, why = message.partition(": ")
    if colon and field_name in _FLAGS:
        return typer.BadParameter(why, param_hint=_FLAGS[field_name])
    first = re.match(r"(\w+)[= ]", message)
    hint = _FLAGS.get(first.group(1)) if first else None
    for name, flag in _KV_FLAGS.items():
        message = re.sub(rf"\b{name}\b", flag, message)
    return typer.BadParameter(message, param_hint=hint)


#: Library words in error messages -> what the user typed on the command line (the library names its settings).
_CLI_WORDS = {"kv_cache_budget / free_memory_fraction": "--kv-cache-budget", "kv_cache_budget": "--kv-cache-budget",
              "max_tokens": "--max-tokens", "block_size": "--kv-block-size"}


def in_cli_words(message: str) -> str:
    """``message`` (a library error) with the settings it names spelled as the CLI options that set them."""
    for word, flag in _CLI_WORDS.items():
        message = re.sub(rf"(?<![\w-]){re.escape(word)}\b", flag, message)
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


def sampling_defaults(*, temp: float, top_p: float, top_k: int, min_p: float, max_tokens: int | None,
                      repetition_penalty: float | None = None, chat_template_kwargs: str | None = None) -> Any:
    """The sampling options of ``generate``, ``chat`` and ``serve`` as a :class:`mlxkv.config.SamplingDefaults`
    (``chat_template_kwargs``: a JSON object).

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
        raise option_error(exc) from None


__all__ = ["from_rule", "check_log_level", "LOG_LEVELS", "FLAG", "parse_size", "with_revision", "kv_config",
           "overflow_config", "option_error", "sampling_defaults", "in_cli_words"]
