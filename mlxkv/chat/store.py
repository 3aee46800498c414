"""Saved chat sessions: the conversation and its KV cache in one sealed file.

A session ``NAME`` is ``<sessions dir>/NAME.safetensors``: the bytes mlx-lm's ``save_prompt_cache`` writes (the
caches' arrays, with metadata; the metadata key ``mlxkv_chat`` holds a JSON record of the messages, the cached
token ids and the fingerprint of the model that computed the cache), encrypted and authenticated with AES-GCM
(``cryptography``, through :class:`mlxkv.kv.tier.seal.Seal`) under the folder's secret, with the session's name
as associated data. The folder is private (0700, tightened if it exists), the files and the secret (``.secret``
in the folder, made on the first save) 0600.

Loading refuses with one line, never a traceback nor a different answer: a file edited, truncated, renamed onto
another session or written under another secret (it does not decrypt); a file of an older mlxkv; a file saved for
another model or ``kv_bits`` (its K/V would be meaningless here); a record whose messages are not
system/user/assistant text or do not render with this model's chat template; caches holding fewer rows than
their recorded offsets, or a record whose token count disagrees with them.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path
from typing import Any

from mlxkv.chat.paths import saved_session_path, session_path
from mlxkv.chat.session import ChatSession
from mlxkv.kv import each_layer_cache, load_prompt_cache, save_prompt_cache
from mlxkv.kv.tier.disk_store import atomic_write, private_folder
from mlxkv.kv.tier.seal import NONCE_BYTES, Seal, SealError, SecretError, load_secret_file

#: Version of the ``mlxkv_chat`` record and of the sealed container; a file of another version is refused.
FORMAT_VERSION = 2
METADATA_KEY = "mlxkv_chat"
MAGIC = b"MLXKVCHT"
PREFIX = struct.Struct("<8sH")  # magic, version
SECRET_NAME = ".secret"
ROLES = ("system", "user", "assistant")
MAX_SESSION_BYTES = 1 << 34  # 16 GiB: a bigger file is not one this tool wrote
# Config keys that say how the weights are stored, not which model they are (--dequantize removes them).
_STORAGE_KEYS = ("quantization", "quantization_config", "torch_dtype")


def open_folder(folder: str | Path, *, create: bool) -> Seal | None:
    """The :class:`Seal` of sessions folder ``folder`` (made private, and its secret made, when ``create``);
    None when the folder has no secret and ``create`` is false.

    Raises:
        ValueError: the secret is not private to this user or has the wrong size; the folder cannot be made.
    """
    folder = Path(folder).expanduser()
    try:
        if create:
            private_folder(folder)
        key = load_secret_file(folder / SECRET_NAME, create=create)
    except SecretError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"cannot use the sessions folder {folder}: {exc.strerror or exc}") from None
    return None if key is None else Seal(key)


def seal_bytes(seal: Seal, name: str, data: bytes) -> bytes:
    """The sealed file bytes of session ``name`` holding ``data`` (a prompt-cache file's bytes)."""
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION)
    nonce, sealed = seal.encrypt(data, prefix + name.encode())
    return prefix + nonce + sealed


def open_bytes(seal: Seal, name: str, raw: bytes, path: Path) -> bytes:
    """The prompt-cache bytes inside sealed file ``raw`` of session ``name``. Raises ValueError (one line)."""
    if len(raw) < PREFIX.size or raw[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path} is not an mlxkv chat session (not sealed: an older mlxkv's, or another file)")
    _, version = PREFIX.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} is a chat session of another format version: save it again")
    start = PREFIX.size
    try:
        return seal.decrypt(raw[start:start + NONCE_BYTES], raw[start + NONCE_BYTES:], raw[:start] + name.encode())
    except SealError as exc:
        raise ValueError(f"{path} was changed since it was saved: it {exc}") from None


def model_fingerprint(config: dict, model_name: str, vocab_size: int, adapter: str | None = None) -> str:
    """A short hash naming the model that computed a cache: its config (storage keys aside), the name of its file
    or folder, the tokenizer's vocabulary size and the digest of its LoRA adapter (``None``: none)."""
    body = {k: v for k, v in config.items() if k not in _STORAGE_KEYS}
    named = {"config": body, "name": model_name, "vocab": vocab_size}
    if adapter is not None:  # without one, the base model's fingerprint as it is
        named["adapter"] = adapter
    text = json.dumps(named, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_of(loaded: Any) -> str:
    """:func:`model_fingerprint` of a :class:`mlxkv.models.LoadedModel`."""
    adapter = getattr(loaded, "adapter", None)
    return model_fingerprint(loaded.config, loaded.path.name, int(getattr(loaded.tokenizer, "vocab_size", 0) or 0),
                             adapter.digest if adapter is not None else None)


def save_session(session: ChatSession, folder: str | Path, name: str, fingerprint: str, model_name: str = "") -> Path:
    """Write ``session`` (messages, cached tokens and KV cache) as session ``name``, sealed; returns the file.

    Raises:
        ValueError: a bad name, or the folder cannot be written.
    """
    path = session_path(folder, name)
    record = {"version": FORMAT_VERSION, "model": fingerprint, "model_name": model_name, "kv_bits": session.kv_bits,
              "messages": session.messages, "tokens": session.tokens}
    seal = open_folder(path.parent, create=True)
    buffer = io.BytesIO()
    save_prompt_cache(buffer, session.caches, metadata={METADATA_KEY: json.dumps(record)})
    try:
        atomic_write(path, seal_bytes(seal, name, buffer.getvalue()))  # 0600; a crash leaves the old file whole
    except OSError as exc:
        raise ValueError(f"cannot save session {name!r} in {path.parent}: {exc.strerror or exc}") from None
    return path


def _rows(buffer: Any) -> int:
    """Rows (tokens) a cache buffer ``(B, n_kv, rows, D)`` holds (a quantized buffer is a tuple of planes)."""
    if isinstance(buffer, (tuple, list)):
        buffer = buffer[0] if buffer else None
    return 0 if buffer is None or getattr(buffer, "ndim", 0) < 2 else int(buffer.shape[-2])


def _check_caches(caches: list, tokens: list, path: Path) -> None:
    """Refuse caches whose buffers hold fewer rows than their own offsets say, or another token count than the
    record's: attention would read rows that are not there (or miss ones that are) and answer differently."""
    for i, c in enumerate(each_layer_cache(caches)):
        offset = getattr(c, "offset", None)
        if not isinstance(offset, int):
            continue  # a recurrent state: no rows
        if offset != len(tokens):
            raise ValueError(f"{path} is inconsistent: layer {i} caches {offset} tokens, its record {len(tokens)}")
        size = c.size() if callable(getattr(c, "size", None)) else offset
        if size and min(_rows(c.keys), _rows(c.values)) < size:
            raise ValueError(f"{path} is inconsistent: layer {i} holds {min(_rows(c.keys), _rows(c.values))} rows "
                             f"for {size} cached tokens")


def _check_record(session: ChatSession, record: Any, path: Path) -> tuple[list, list]:
    messages, tokens = record.get("messages"), record.get("tokens")
    if not (isinstance(messages, list) and all(isinstance(m, dict) and set(m) == {"role", "content"}
                                               and m["role"] in ROLES and isinstance(m["content"], str)
                                               for m in messages)
            and isinstance(tokens, list) and all(type(t) is int and 0 <= t < 1 << 31 for t in tokens)):
        raise ValueError(f"{path} is not an mlxkv chat session (its record has no valid messages and tokens: "
                         f"roles are {', '.join(ROLES)})")
    try:
        session.render(messages)  # the next turn renders them: a template that refuses them must refuse here
    except Exception as exc:  # noqa: BLE001 - any template error is the same one-line refusal
        raise ValueError(f"{path}: its messages do not render with this model's chat template "
                         f"({type(exc).__name__})") from None
    return messages, tokens


def load_session(session: ChatSession, folder: str | Path, name: str, fingerprint: str) -> None:
    """Replace ``session``'s conversation and KV cache with saved session ``name``.

    Raises:
        ValueError (one line): no such session, a file that is not a sealed chat session or was changed since it was
            saved, one saved for another model or another ``kv_bits`` (the cache's layout is the saved one), or
            one whose record and caches disagree.
    """
    path = saved_session_path(folder, name)
    seal = open_folder(path.parent, create=False)
    if seal is None:
        raise ValueError(f"{path} cannot be verified: its folder has no {SECRET_NAME} (saved by an older mlxkv, or "
                         f"the secret was removed): save it again")
    try:
        if path.stat().st_size > MAX_SESSION_BYTES:
            raise ValueError(f"{path} is larger than {MAX_SESSION_BYTES} bytes: not a chat session")
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    data = io.BytesIO(open_bytes(seal, name, raw, path))
    data.name = path.name  # mx.load tells the format by the name
    try:
        caches, metadata = load_prompt_cache(data, return_metadata=True)
        record: Any = json.loads(metadata[METADATA_KEY])
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line refusal
        raise ValueError(f"{path} is not an mlxkv chat session ({type(exc).__name__})") from None
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} is a chat session of another format version: save it again")
    if record.get("model") != fingerprint:
        saved_with = record.get("model_name") or "another model"
        raise ValueError(f"session {name!r} was saved with {saved_with}, not this model: resume it with that model "
                         "(-m, and --adapter-path if it had one)")
    if record.get("kv_bits") != session.kv_bits:
        def bits(b: Any) -> str:
            return f"--kv-bits {b}" if b else "no --kv-bits"

        raise ValueError(f"session {name!r} was saved with {bits(record.get('kv_bits'))}: resume it with that "
                         f"(this chat has {bits(session.kv_bits)})")
    messages, tokens = _check_record(session, record, path)
    _check_caches(caches, tokens, path)
    session.restore(messages, tokens, caches)


__all__ = ["FORMAT_VERSION", "model_fingerprint", "fingerprint_of", "save_session", "load_session"]
