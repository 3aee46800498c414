"""Saved chat sessions: the conversation and its KV cache in one file of mlx-lm's prompt-cache format.

A session ``NAME`` is ``<sessions dir>/NAME.safetensors``, written by mlx-lm's ``save_prompt_cache`` (the
caches' arrays, with metadata); the metadata key ``mlxkv_chat`` holds a JSON record of the messages, the cached
token ids and the fingerprint of the model that computed the cache. A file saved for another model is refused:
its K/V would be meaningless there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mlxkv.chat.paths import SUFFIX, list_sessions, saved_session_path, session_path
from mlxkv.chat.session import ChatSession
from mlxkv.kv import load_prompt_cache, save_prompt_cache

#: Version of the ``mlxkv_chat`` record; a file of another version is refused.
FORMAT_VERSION = 1
METADATA_KEY = "mlxkv_chat"
# Config keys that say how the weights are stored, not which model they are (--dequantize removes them).
_STORAGE_KEYS = ("quantization", "quantization_config", "torch_dtype")


def model_fingerprint(config: dict, model_name: str, vocab_size: int) -> str:
    """A short hash naming the model that computed a cache: its config (storage keys aside), the name of its file
    or folder, and the tokenizer's vocabulary size."""
    body = {k: v for k, v in config.items() if k not in _STORAGE_KEYS}
    text = json.dumps({"config": body, "name": model_name, "vocab": vocab_size}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_of(loaded: Any) -> str:
    """:func:`model_fingerprint` of a :class:`mlxkv.models.LoadedModel`."""
    return model_fingerprint(loaded.config, loaded.path.name, int(getattr(loaded.tokenizer, "vocab_size", 0) or 0))


def save_session(session: ChatSession, folder: str | Path, name: str, fingerprint: str, model_name: str = "") -> Path:
    """Write ``session`` (messages, cached tokens and KV cache) as session ``name``; returns the file.

    Raises:
        ValueError: a bad name, or the folder cannot be written.
    """
    path = session_path(folder, name)
    record = {"version": FORMAT_VERSION, "model": fingerprint, "model_name": model_name, "kv_bits": session.kv_bits,
              "messages": session.messages, "tokens": session.tokens}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp{SUFFIX}")  # a crash mid-write leaves the old file whole
        save_prompt_cache(str(tmp), session.caches, metadata={METADATA_KEY: json.dumps(record)})
        tmp.replace(path)
    except OSError as exc:
        raise ValueError(f"cannot save session {name!r} in {path.parent}: {exc.strerror or exc}") from None
    return path


def load_session(session: ChatSession, folder: str | Path, name: str, fingerprint: str) -> None:
    """Replace ``session``'s conversation and KV cache with saved session ``name``.

    Raises:
        ValueError: no such session, a file that is not a chat session, or one saved for another model or
            another ``kv_bits`` (the cache's layout is the saved one).
    """
    path = saved_session_path(folder, name)
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
        record: Any = json.loads(metadata[METADATA_KEY])
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line refusal
        raise ValueError(f"{path} is not an mlxkv chat session ({type(exc).__name__})") from None
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is a chat session of another format version: save it again")
    if record.get("model") != fingerprint:
        saved_with = record.get("model_name") or "another model"
        raise ValueError(f"session {name!r} was saved with {saved_with}, not this model: resume it with that model (-m)")
    if record.get("kv_bits") != session.kv_bits:
        def bits(b: Any) -> str:
            return f"--kv-bits {b}" if b else "no --kv-bits"

        raise ValueError(f"session {name!r} was saved with {bits(record.get('kv_bits'))}: resume it with that "
                         f"(this chat has {bits(session.kv_bits)})")
    messages, tokens = record.get("messages"), record.get("tokens")
    if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in messages)
            and isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
        raise ValueError(f"{path} is not an mlxkv chat session (its record has no valid messages and tokens)")
    session.restore(messages, tokens, caches)


__all__ = ["FORMAT_VERSION", "model_fingerprint", "fingerprint_of", "save_session", "load_session"]
