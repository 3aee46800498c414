"""Tier files that cannot hurt: private modes, AES-GCM under a secret beside the folder, no token ids or
salt digests even inside the encrypted header, and malformed / hostile files dropped with one warning by the store's scan and by
``mlxkv cache ls / clear``, never fatal."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlxkv.cli.cache import cache_app
from test_tier_store import FP, B, h, make_block
from typer.testing import CliRunner

from mlxkv.kv.tier import DiskStore, FormatError, SecretError, secret_path
from mlxkv.kv.tier.format import FORMAT_VERSION, MAGIC, PREFIX, encode_block, open_header, parse_header, seal_file
from mlxkv.kv.tier.header import MAX_HEADER_BYTES
from mlxkv.kv.tier.seal import Seal

runner = CliRunner(env={"COLUMNS": "200"})


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def sealed(seal: Seal, header: bytes, payload: bytes = b"") -> bytes:
    """A file encrypted under ``seal`` around any header bytes: what only the secret's holder can make."""
    return seal_file(seal, header, payload)


def good_header(block, seal) -> dict:
    return json.loads(open_header(encode_block(block, FP, seal), seal)[1])


def hostile_headers(seal) -> dict[str, bytes]:
    base = good_header(make_block(1), seal)

    def edit(**fields) -> bytes:
        return json.dumps({**base, **fields}, separators=(",", ":")).encode()

    assert b'"priority":35' in edit() and b'"created":' in edit()  # the edits below find what they replace
    return {
        "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
        "nested in a field": edit(fingerprint=None)[:-1] + b',"x":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        "1e400 priority": edit().replace(b'"priority":35', b'"priority":1e400'),
        "1e400 created": re.sub(rb'"created":[0-9.e+-]+', b'"created":1e400', edit()),
        "NaN": edit().replace(b'"priority":35', b'"priority":NaN'),
        "huge integer": edit().replace(b'"priority":35', b'"priority":' + b"9" * 5000),
        "string for object": edit(fingerprint="llama"),
        "string for list": edit(arrays="abc", layers="ab"),
        "list of strings": edit(arrays=["a", "b"]),
        "bool for int": edit(priority=True),
        "float for int": edit(group_id=0.5),
        "negative offset": edit(arrays=[{**base["arrays"][0], "offset": -1}] + base["arrays"][1:]),
        "shape mismatch": edit(arrays=[{**base["arrays"][0], "shape": [B, 2, 9]}] + base["arrays"][1:]),
        "priority 101": edit(priority=101),
        "bad hex": edit(block_hash="zz" * 32),
        "not an object": b"[1, 2, 3]",
        "not json": b"{not json",
        "not utf-8": b'{"version": 3, "x": "\xff\xfe"}',
        "extra field": edit(token_ids=[1, 2, 3, 4]),
        "missing field": json.dumps({k: v for k, v in base.items() if k != "priority"}).encode(),
    }


def test_folder_files_and_secret_are_private(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    s = DiskStore(folder, FP, 1 << 20)
    s.put(make_block(0))
    assert mode(folder) == 0o700  # tightened
    (path,) = folder.iterdir()
    assert mode(path) == 0o600
    secret = secret_path(folder)
    assert secret.parent == tmp_path and secret.name == "tier.secret"  # beside the folder, not in it
    assert mode(secret) == 0o600 and secret.stat().st_size == 32
    key = secret.read_bytes()
    DiskStore(folder, FP, 1 << 20)  # reopening keeps the secret
    assert secret.read_bytes() == key
    assert mode(DiskStore(tmp_path / "new" / "tier", FP, 1 << 20).folder) == 0o700


def test_a_secret_others_can_read_is_refused(tmp_path):
    DiskStore(tmp_path / "tier", FP, 1 << 20)
    os.chmod(secret_path(tmp_path / "tier"), 0o644)
    with pytest.raises(SecretError, match="lets others read it"):
        DiskStore(tmp_path / "tier", FP, 1 << 20)
    os.chmod(secret_path(tmp_path / "tier"), 0o600)
    secret_path(tmp_path / "tier").write_bytes(b"short")
    with pytest.raises(SecretError, match="32 bytes"):
        DiskStore(tmp_path / "tier", FP, 1 << 20)


def test_no_token_ids_or_salt_digest_in_clear(tmp_path):
    from mlxkv.kv.tier.format import extra_digest

    block = make_block(3)
    salted = extra_digest((("s", "tenant-a"),))
    block.extra_digest = salted
    block.token_ids = (101, 202, 303, 404)
    s = DiskStore(tmp_path, FP, 1 << 20)
    s.put(block)
    raw = s.path_for((0, h(3))).read_bytes()
    header = good_header(block, s.seal)
    assert "token_ids" not in header and "extra_digest" not in header
    assert b"101,202" not in raw and b"101, 202" not in raw and salted.encode() not in raw
    assert all(v not in (101, 202, 303, 404) for v in header.values() if isinstance(v, int))
    assert hashlib.sha256(b"tenant-a").hexdigest().encode() not in raw
    got = s.get((0, h(3)))  # restore still compares both, through the keyed tags
    assert got.matches((101, 202, 303, 404), salted)
    assert not got.matches((101, 202, 303, 404), extra_digest((("s", "tenant-b"),)))
    assert not got.matches((101, 202, 303, 405), salted)


def test_replaced_payload_rechecksummed_or_retagged_is_refused(tmp_path, caplog):
    s = DiskStore(tmp_path, FP, 1 << 20)
    s.put(make_block(1))
    path = s.path_for((0, h(1)))
    raw = path.read_bytes()
    other = encode_block(make_block(2), FP, s.seal)
    _, _, start = open_header(raw, s.seal)
    path.write_bytes(raw[:start] + other[len(other) - (len(raw) - start):])  # another block's sealed K/V
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        assert s.get((0, h(1))) is None
    assert "payload does not decrypt" in caplog.text and not path.exists()
    # a whole file made with a guessed secret: refused at the scan, from its header alone
    path.write_bytes(encode_block(make_block(1, priority=100), FP, Seal(b"g" * 32)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        assert len(DiskStore(tmp_path, FP, 1 << 20)) == 0
    assert "header does not decrypt" in caplog.text and not path.exists()


@pytest.mark.parametrize("case", list(hostile_headers(Seal(b"k" * 32))))
def test_hostile_header_is_dropped_with_one_warning_never_fatal(tmp_path, caplog, case):
    folder = tmp_path / "tier"
    s = DiskStore(folder, FP, 1 << 20)
    s.put(make_block(0))  # a good file beside the hostile one
    hostile = hostile_headers(s.seal)[case]
    bad = folder / f"{FP['digest'][:16]}-g0-{h(9).hex()}.mlxkvblk"
    bad.write_bytes(sealed(s.seal, hostile, b"\0" * 64))
    with pytest.raises(FormatError):
        parse_header(bad.read_bytes(), s.seal)
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        s2 = DiskStore(folder, FP, 1 << 20)
    assert len(s2) == 1 and s2.num_corrupt == 1 and not bad.exists()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    bad.write_bytes(sealed(s.seal, hostile, b"\0" * 64))
    result = runner.invoke(cache_app, ["ls", str(folder)])
    assert result.exit_code == 0, result.output
    assert "1 blocks" in result.output and "1 unreadable file(s)" in result.output
    assert result.output.count(f"warning: skipping {bad.name}") == 1
    result = runner.invoke(cache_app, ["clear", str(folder), "--yes"])
    assert result.exit_code == 0 and "removed 2 file(s)" in result.output and list(folder.iterdir()) == []


def test_oversized_header_length_and_old_format_files(tmp_path, caplog):
    folder = tmp_path / "tier"
    s = DiskStore(folder, FP, 1 << 20)
    big = folder / f"{FP['digest'][:16]}-g0-{h(7).hex()}.mlxkvblk"
    big.write_bytes(PREFIX.pack(MAGIC, FORMAT_VERSION, MAX_HEADER_BYTES + 17) + b"{" * 64)
    for i in range(3):  # format v1 files (token ids in clear, plain sha256) and v2 (K/V in clear, unkeyed names)
        (folder / f"old{i}.mlxkvblk").write_bytes(PREFIX.pack(MAGIC, 1 + i % 2, 2) + b"{}" + b"\0" * 32)
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        s2 = DiskStore(folder, FP, 1 << 20)
    assert len(s2) == 0 and s2.num_old_format == 3 and s2.num_corrupt == 1 and list(folder.iterdir()) == []
    old = [r.getMessage() for r in caplog.records if "older format" in r.getMessage()]
    assert len(old) == 1 and "3 file(s)" in old[0] and s.seal is not None


def test_ls_handles_cycles_and_duplicates_and_clear_asks(tmp_path):
    s = DiskStore(tmp_path, FP, 1 << 20)
    a, b = make_block(1), make_block(2)
    a.parent_hash, b.parent_hash = b.block_hash, a.block_hash  # each names the other as its parent
    s.put(a)
    s.put(b)
    s.put(make_block(5))
    shutil.copy(s.path_for((0, h(5))), tmp_path / "copy.mlxkvblk")  # the same block under another name
    result = runner.invoke(cache_app, ["ls", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "3 blocks" in result.output and "1 duplicate(s) not counted" in result.output
    rows = [line for line in result.output.splitlines() if "llama" in line]
    assert len(rows) == 2 and any(" 2 " in r and " 8 " in r for r in rows)  # the cycle: 2 blocks, 8 tokens

    assert "Asks for confirmation unless --yes" in runner.invoke(cache_app, ["clear", "--help"]).output
    result = runner.invoke(cache_app, ["clear", str(tmp_path)], input="n\n")
    assert result.exit_code == 1 and "nothing deleted" in result.output and len(list(tmp_path.iterdir())) == 4
    result = runner.invoke(cache_app, ["clear", str(tmp_path)], input="y\n")
    assert result.exit_code == 0 and "removed 4 file(s)" in result.output and list(tmp_path.iterdir()) == []


def test_ls_without_the_secret_verifies_nothing(tmp_path):
    DiskStore(tmp_path / "tier", FP, 1 << 20).put(make_block(0))
    secret_path(tmp_path / "tier").unlink()
    result = runner.invoke(cache_app, ["ls", str(tmp_path / "tier")])
    assert result.exit_code == 0 and "0 blocks" in result.output and "cannot verify" in result.output
    assert not secret_path(tmp_path / "tier").exists()  # ls never creates one


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
                                              lambda c: st.lists(c) | st.dictionaries(st.text(), c),
                                              max_leaves=30).map(lambda x: json.dumps(x).encode()))
def test_any_sealed_header_raises_only_format_error(raw):
    seal = Seal(b"k" * 32)
    try:
        parse_header(sealed(seal, raw), seal)
    except FormatError:
        pass  # anything else (RecursionError, OverflowError, AttributeError, ...) fails the test


@pytest.mark.server
def test_a_real_server_starts_over_a_folder_of_hostile_files(tmp_path):
    """``mlxkv serve --kv-disk-cache DIR`` (the embedded demo model) over every hostile header above, an old-format
    file and junk: it starts, answers, and has dropped each bad file of ours with one warning."""
    from testkit.serve_process import serve_process

    folder = tmp_path / "tier"
    seal = DiskStore(folder, FP, 1 << 20).seal  # makes the folder and its secret, as a first run would
    names = []
    for i, raw in enumerate(hostile_headers(seal).values()):
        names.append(f"{FP['digest'][:16]}-g0-{h(100 + i).hex()}.mlxkvblk")
        (folder / names[-1]).write_bytes(sealed(seal, raw, b"\0" * 64))
    (folder / "old.mlxkvblk").write_bytes(PREFIX.pack(MAGIC, 1, 2) + b"{}" + b"\0" * 32)
    (folder / "notes.txt").write_text("not ours: kept")
    with serve_process("--kv-backend", "paged", "--kv-disk-cache", str(folder), "--log-level", "warning") as client:
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
