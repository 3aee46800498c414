"""Conversations whose KV cache persists across turns (``mlxkv chat``): the turn diff, the session, saved files.

- :mod:`mlxkv.chat.turns` — what a turn prefills (the common prefix with the cache) and which turns a long
  conversation drops (pure Python);
- :mod:`mlxkv.chat.session` — :class:`ChatSession`, one conversation and its cache;
- :mod:`mlxkv.chat.store` — sessions saved in mlx-lm's prompt-cache format, refused for another model.
"""

from mlxkv.chat.session import ChatSession, TurnStats
from mlxkv.chat.store import fingerprint_of, list_sessions, load_session, save_session
from mlxkv.chat.turns import common_prefix, fit_conversation, plan_turn

__all__ = ["ChatSession", "TurnStats", "common_prefix", "fingerprint_of", "fit_conversation", "list_sessions",
           "load_session", "plan_turn", "save_session"]
