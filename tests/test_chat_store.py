"""Saved chat sessions at rest, through ``mlxkv chat`` as a process (the demo model, piped input): the folder is
0700 and the file and its secret 0600, the conversation is not in clear, and ``--resume`` of a file that was
edited, truncated, renamed, left by an older mlxkv or made inconsistent (an edited role, cache rows fewer than the
recorded offset, even when re-sealed with the secret) is one line and exit 1, never a traceback nor another answer."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.chat.store import METADATA_KEY, SECRET_NAME, open_bytes, open_folder, seal_bytes

ROOT = Path(__file__).resolve().parent.parent


def _chat(tmp_path: Path, *args: str, lines: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-m", "mlxkv", "chat", *args], input=lines, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def refused(done: subprocess.CompletedProcess, *words: str) -> None:
    """One ``error:`` line on stderr, exit 1, and nothing answered."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not done.stdout.strip()  # nothing answered


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, bytes, str]:
    """A session saved by ``mlxkv chat`` (folder, the file's bytes, the answer its resume gives next)."""
    tmp = tmp_path_factory.mktemp("chat")
    (tmp / "sessions").mkdir(mode=0o755)
    os.chmod(tmp / "sessions", 0o755)
    done = _chat(tmp, "-n", "4", lines="Hello there, Zanzibar\n/save one\n")
    assert done.returncode == 0, done.stderr
    resumed = _chat(tmp, "-n", "4", "--resume", "one", lines="And then?\n")
    assert resumed.returncode == 0 and "resumed session one: 2 messages" in resumed.stderr, resumed.stderr
    return tmp / "sessions", (tmp / "sessions" / "one.safetensors").read_bytes(), resumed.stdout


def _resume(folder: Path, name: str = "one") -> subprocess.CompletedProcess:
    return _chat(folder.parent, "-n", "4", "--resume", name, lines="And then?\n")


def test_files_are_private_and_the_conversation_is_not_in_clear(saved):
    folder, raw, _ = saved
    assert mode(folder) == 0o700  # tightened from 0755
    assert mode(folder / "one.safetensors") == 0o600 and mode(folder / SECRET_NAME) == 0o600
    assert b"Zanzibar" not in raw and b"Hello" not in raw and b"user" not in raw and METADATA_KEY.encode() not in raw
    assert sorted(p.name for p in folder.iterdir()) == [SECRET_NAME, "one.safetensors"]  # no temp file left


def _copy(folder: Path, tmp_path: Path) -> Path:
    mine = tmp_path / "sessions"
    mine.mkdir(mode=0o700)
    for name in (SECRET_NAME, "one.safetensors"):
        (mine / name).write_bytes((folder / name).read_bytes())
        os.chmod(mine / name, 0o600)
    return mine


def _reseal(folder: Path, raw: bytes, edit) -> bytes:
    """``raw`` opened with the folder's secret, its arrays and metadata passed through ``edit``, sealed again: a file
    only the secret's holder could make, inconsistent inside."""
    seal = open_folder(folder, create=False)
    data = io.BytesIO(open_bytes(seal, "one", raw, folder / "one.safetensors"))
    data.name = "one.safetensors"
    arrays, metadata = mx.load(data, return_metadata=True)
    arrays, metadata = edit(arrays, metadata)
    out = io.BytesIO()
    mx.save_safetensors(out, arrays, metadata)
    return seal_bytes(seal, "one", out.getvalue())


KEY = f"0.{METADATA_KEY}"  # the record's key in a prompt-cache file's metadata


def _shorter_rows(arrays, metadata):
    """Every K/V buffer cut to 3 rows: fewer than the offset the file records."""
    return {k: (v[:, :, :3, :] if v.ndim == 4 else v) for k, v in arrays.items()}, metadata


def _edited_role(arrays, metadata):
    return arrays, {**metadata, KEY: metadata[KEY].replace('"role": "user"', '"role": "hacker"')}


def _edited_tokens(arrays, metadata):
    return arrays, {**metadata, KEY: metadata[KEY].replace('"tokens": [', '"tokens": [7, ')}


def test_resume_of_an_edited_or_inconsistent_file_is_one_line(saved, tmp_path):
    """Through the CLI: a flipped bit, and cache rows fewer than the recorded offset re-sealed with the secret."""
    folder, raw, answer = saved
    mine = _copy(folder, tmp_path)
    edited = bytearray(raw)
    edited[len(raw) // 2] ^= 0x01
    (mine / "one.safetensors").write_bytes(bytes(edited))
    refused(_resume(mine), str(mine / "one.safetensors"), "changed since it was saved")
    (mine / "one.safetensors").write_bytes(_reseal(mine, raw, _shorter_rows))
    refused(_resume(mine), "inconsistent", "rows")


@pytest.fixture(scope="module")
def demo():
    from mlxkv.models import load

    return load(None, progress=False)


def _load(demo, folder: Path, name: str = "one") -> None:
    from mlxkv.chat import ChatSession, fingerprint_of, load_session

    session = ChatSession(demo.model, demo.tokenizer, model_limit=demo.config["max_position_embeddings"])
    load_session(session, folder, name, fingerprint_of(demo))


@pytest.mark.parametrize("case", ["untouched", "truncated", "renamed", "another secret", "no secret", "older mlxkv",
                                  "edited role", "edited tokens", "shorter rows"])
def test_every_changed_or_inconsistent_file_is_one_line_refusal(saved, tmp_path, demo, case):
    """The same checks as ``--resume`` runs them (load_session), for every kind of change."""
    folder, raw, _ = saved
    mine = _copy(folder, tmp_path)
    target = mine / "one.safetensors"
    edits = {"edited role": _edited_role, "edited tokens": _edited_tokens, "shorter rows": _shorter_rows}
    words = {"truncated": "changed since", "renamed": "changed since", "another secret": "changed since",
             "no secret": "cannot be verified", "older mlxkv": "not sealed", "edited role": "roles are",
             "edited tokens": "inconsistent", "shorter rows": "inconsistent"}
    if case == "truncated":
        target.write_bytes(raw[:-1000])
    elif case == "renamed":  # another session's file under this name
        target.rename(mine / "two.safetensors")
        target = mine / "two.safetensors"
    elif case == "another secret":
        (mine / SECRET_NAME).write_bytes(b"s" * 32)
    elif case == "no secret":
        (mine / SECRET_NAME).unlink()
    elif case == "older mlxkv":  # the plain prompt-cache file an older mlxkv wrote
        target.write_bytes(open_bytes(open_folder(mine, create=False), "one", raw, target))
    elif case in edits:
        target.write_bytes(_reseal(mine, raw, edits[case]))
    if case == "untouched":
        _load(demo, mine)
        return
    with pytest.raises(ValueError) as err:
        _load(demo, mine, target.stem)
    message = str(err.value)
    assert "\n" not in message and words[case] in message, message
