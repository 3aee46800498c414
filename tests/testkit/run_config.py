"""A :class:`~mlxkv.config.RunConfig` from the flat option names of ``mlxkv generate`` / ``mlxkv serve``."""

from __future__ import annotations

from typing import Any

from mlxkv.config import EngineConfig, KvCacheConfig, RunConfig, SpeculativeConfig

_KV = {"kv_backend": "backend", "kv_block_size": "block_size", "max_kv_size": "max_kv_size", "kv_bits": "kv_bits",
       "kv_group_size": "kv_group_size", "layout": "layout", "kv_cache_budget": "kv_cache_budget",
       "host_cache_bytes": "secondary_memory_bytes", "disk_cache_dir": "secondary_disk_dir",
       "disk_cache_bytes": "secondary_disk_bytes", "kv_overflow": "overflow", "kv_preallocate": "preallocate",
       "kv_idle_release": "idle_release_s"}
_SPECULATIVE = ("draft_model", "prompt_lookup", "num_draft_tokens", "ngram_size")


def run_config(model: str | None = None, *, engine: EngineConfig | None = None, dequantize: bool = False,
               chat_template: str | None = None, tool_parser: str | None = None, adapter_path: str | None = None,
               **options: Any) -> RunConfig:
    """``run_config(model, kv_backend="paged", prompt_lookup=True, ...)``: the options as the CLI would set them
    (flat names; unknown ones raise TypeError)."""
    kv = {_KV[k]: v for k, v in options.items() if k in _KV}
    speculative = {k: v for k, v in options.items() if k in _SPECULATIVE}
    unknown = set(options) - set(_KV) - set(_SPECULATIVE)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    return RunConfig(model=model, dequantize=dequantize, kv=KvCacheConfig(**kv),
                     speculative=SpeculativeConfig(**speculative), engine=engine or EngineConfig(),
                     chat_template=chat_template, tool_parser=tool_parser, adapter_path=adapter_path)
