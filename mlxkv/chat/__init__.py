"""Conversations whose KV cache persists across turns (``mlxkv chat``): the turn diff, the session, saved files.

- :mod:`mlxkv.chat.turns` — what a turn prefills (the common prefix with the cache) and which turns a long
  conversation drops (pure Python);
- :mod:`mlxkv.chat.session` — :class:`ChatSession`, one conversation and its cache;
- :mod:`mlxkv.chat.store` — sessions saved in mlx-lm's prompt-cache format, refused for another model;
  :mod:`mlxkv.chat.paths` — their names and files (pure Python).

Names are resolved on first use, so the pure-Python modules import without MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ChatSession": "mlxkv.chat.session",
    "TurnStats": "mlxkv.chat.session",
    "fingerprint_of": "mlxkv.chat.store",
    "load_session": "mlxkv.chat.store",
    "save_session": "mlxkv.chat.store",
    "list_sessions": "mlxkv.chat.paths",
    "common_prefix": "mlxkv.chat.turns",
    "fit_conversation": "mlxkv.chat.turns",
    "plan_turn": "mlxkv.chat.turns",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxkv.chat' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
