"""Validators shared by the commands' Typer options: a bad value names the valid choices or range."""

from __future__ import annotations

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


def kv_config(*, backend: str, block_size: int, max_kv_size: int | None = None, kv_bits: int | None = None,
              kv_group_size: int = 64, layout: str = "mlxkv", budget: int | None = None, host_cache_bytes: int = 0,
              disk_cache_dir: str | None = None, disk_cache_bytes: int = 0) -> Any:
    """The KV cache configuration the ``generate`` and ``serve`` options describe (one builder for both).

    Raises:
        typer.BadParameter: options that need one another, named as the user typed them.
    """
    from mlxkv.config import KvCacheConfig

    if disk_cache_bytes and not disk_cache_dir:
        raise typer.BadParameter("needs --kv-disk-cache (the folder of the disk tier)", param_hint="--kv-disk-cache-size")
    return KvCacheConfig(backend=backend, block_size=block_size, max_kv_size=max_kv_size, kv_bits=kv_bits,
                         kv_group_size=kv_group_size, layout=layout, kv_cache_budget=budget or "auto",
                         secondary_memory_bytes=host_cache_bytes, secondary_disk_dir=disk_cache_dir,
                         secondary_disk_bytes=disk_cache_bytes)


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


__all__ = ["one_of", "check_kv_bits", "check_kv_backend", "check_cache_layout", "check_block_size",
           "check_top_p", "check_min_p", "kv_config", "sampling_defaults"]
