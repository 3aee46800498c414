"""Each claim of ``mlxkv/kv/tier/seal.py``, checked on the files a real ``mlxkv serve --kv-disk-cache`` writes (the
embedded demo model):

- the K/V rows are encrypted: the attack that reads a prompt back from a clear file (layer 0's value rows are
  ``v_proj(norm(embed(token)))``, a function of the token alone, so each row matches one vocabulary entry) recovers
  the prompt from the decrypted payload and nothing from the file as stored;
- no file name or file byte is the unkeyed chained sha256 of the prompt's blocks (a guessed prompt cannot be
  confirmed offline), while the restart still finds the blocks (restart warmth);
- an edited, truncated or spliced file is dropped with one log line and counted, never served: the answer is the
  one computed without it;
- blocks written behind carry their tenant, so the per-tenant quota holds at the default write interval: a tenant
  at retention priority 100 cannot push out the blocks of a tenant within its share;
- every write takes a fresh nonce, and a file does not decrypt under another secret.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from testkit.serve_signals import server

from mlxkv.kv.blocks.hashing import HashContext, extend_block_hashes, make_hash_fn
from mlxkv.kv.tier.disk_store import read_header_file
from mlxkv.kv.tier.format import decode_block, parse_header
from mlxkv.kv.tier.seal import open_seal, secret_path

pytestmark = pytest.mark.server

BS = 16  # the default --kv-block-size
VOCAB = 2048  # the demo model's
PROMPT = [int(t) for t in np.random.default_rng(35).choice(np.arange(3, VOCAB), 4 * BS + 1, replace=False)]
PAGED = ("--kv-backend", "paged")


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.mlxkvblk"))


def complete(s, prompt, **extra) -> tuple[str, int]:
    r = s.client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra or None)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def tier_stats(s) -> dict:
    return httpx.get(f"http://127.0.0.1:{s.port}/v1/cache/stats").json()["tier"]["secondary"]


@pytest.fixture(scope="module")
def vocab_v_rows() -> np.ndarray:
    """Layer 0's value row of every token of the demo model: ``v_proj(input_layernorm(embed(t)))``, (V, kv*D)."""
    import mlx.core as mx

    from mlxkv.models import load

    inner = load(None, progress=False).model.model
    layer = inner.layers[0]
    v = layer.self_attn.v_proj(layer.input_layernorm(inner.embed_tokens(mx.arange(VOCAB))))
    return np.array(v.astype(mx.float32))


def nearest(rows: np.ndarray, vocab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row: the nearest vocabulary row's token and the squared distance relative to that row's norm."""
    with np.errstate(invalid="ignore", over="ignore"):  # random bytes read as floats: NaN, inf, 1e38
        rows = np.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0).clip(-1e6, 1e6).astype(np.float32)
    e2 = (vocab ** 2).sum(1)
    d = rows @ (-2 * vocab.T)
    d += e2
    best = d.argmin(1)
    return best, (d[np.arange(len(rows)), best] + (rows ** 2).sum(1)) / e2[best]


def attack_clear(data: bytes, seal, vocab: np.ndarray) -> list[int]:
    """The issue's attack on a file's clear K/V (here: decrypted with the secret): layer 0's V rows -> tokens."""
    header, _ = parse_header(data, seal)
    block = decode_block(data, seal, header.fingerprint.digest)
    assert block.layers[0] == 0
    v0 = block.arrays[1].astype(np.float32).reshape(block.block_size, -1)  # (bs, kv_heads * D)
    tokens, dist = nearest(v0, vocab)
    assert dist.max() < 1e-6  # an exact match, row by row
    return [int(t) for t in tokens]


def attack_raw(data: bytes, vocab: np.ndarray) -> float:
    """The same attack without the secret: every 4-byte-aligned window of the file, at each of the 4 alignments, read
    as a value row. Returns the best relative distance to a token's row (a clear file gives ~0)."""
    best = np.inf
    for align in range(4):
        floats = np.frombuffer(data, dtype="<f4", count=(len(data) - align) // 4, offset=align)
        windows = np.lib.stride_tricks.sliding_window_view(floats, vocab.shape[1])
        for lo in range(0, len(windows), 1024):
            best = min(best, float(nearest(windows[lo:lo + 1024], vocab)[1].min()))
    return best


ARGS = (*PAGED, "--kv-disk-write-interval", "3600")  # only the flush at the graceful stop writes the blocks


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, str]:
    """A tier folder (and its secret beside it) written by a server that answered PROMPT, and that answer."""
    folder = tmp_path_factory.mktemp("written") / "tier"
    with server(*ARGS, "--kv-disk-cache", str(folder)) as s:
        reference, cached = complete(s, PROMPT)
        assert cached == 0
        rc, log = s.stop()
    assert rc == 0 and "Traceback" not in log, log
    assert len(files(folder)) == 4, log
    return folder, reference


def copy_of(written, tmp_path: Path) -> Path:
    folder = tmp_path / "tier"
    shutil.copytree(written[0], folder)
    shutil.copy2(secret_path(written[0]), secret_path(folder))
    return folder


def test_the_v_row_attack_reads_only_ciphertext_and_names_are_keyed(written, tmp_path, vocab_v_rows):
    folder = copy_of(written, tmp_path)
    stored = files(folder)
    seal = open_seal(folder, create=False)

    # with the secret, each file's layer-0 V rows give back its 16 prompt tokens: the attack works on clear rows ...
    recovered = {tuple(attack_clear(p.read_bytes(), seal, vocab_v_rows)) for p in stored}
    assert recovered == {tuple(PROMPT[i * BS:(i + 1) * BS]) for i in range(4)}
    # ... and on the files as stored no window comes near the row of any prompt token (the only rows that could
    # give the prompt away: the search is over them, not the whole vocabulary, to keep the test fast)
    targets = vocab_v_rows[PROMPT]
    for p in stored:
        raw = p.read_bytes()
        assert attack_raw(raw, targets) > 1e-2
        assert not any(r.tobytes() in raw for r in decode_block(raw, seal, read_header_file(p, seal)[0]
                                                                   .fingerprint.digest).arrays)

    # the chained sha256 of the prompt's blocks (what the header holds, decrypted) is nowhere in names or bytes
    hashes = extend_block_hashes(make_hash_fn("sha256"), PROMPT, 4 * BS, BS, HashContext(), [])
    headers = {read_header_file(p, seal)[0].block_hash for p in stored}
    assert headers == {h.hex() for h in hashes}  # the guess is right: the test computes what the server hashed
    for p in stored:
        raw = p.read_bytes()
        for h in hashes:
            assert h.hex() not in p.name and h.hex()[:16] not in p.name
            assert h not in raw and h.hex().encode() not in raw and h.hex()[:16].encode() not in raw
        assert b"block_hash" not in raw and b"fingerprint" not in raw  # the header is not readable either

    with server(*ARGS, "--kv-disk-cache", str(folder)) as s:  # restart warmth: the sealed files are served
        assert complete(s, PROMPT) == (written[1], 4 * BS)
        assert tier_stats(s)["hits_disk"] >= 4
        assert s.stop()[0] == 0


def test_a_tampered_or_truncated_tier_file_is_dropped_with_one_line_never_served(written, tmp_path):
    """A bit of the first block's K/V flipped (found when restored), one file truncated and a bit of another's
    encrypted header flipped (found by the start-up scan). A payload spliced from another file:
    tests/test_tier_files.py::test_replaced_payload_rechecksummed_or_retagged_is_refused."""
    folder = copy_of(written, tmp_path)
    seal = open_seal(folder, create=False)
    first = next(p for p in files(folder) if read_header_file(p, seal)[0].parent_hash is None)
    others = [p for p in files(folder) if p != first]
    raw = bytearray(first.read_bytes())
    raw[-100] ^= 0x01
    first.write_bytes(bytes(raw))
    others[0].write_bytes(others[0].read_bytes()[:-100])
    raw = bytearray(others[1].read_bytes())
    raw[20] ^= 0x01
    others[1].write_bytes(bytes(raw))

    with server(*ARGS, "--kv-disk-cache", str(folder)) as s:
        assert complete(s, PROMPT) == (written[1], 0)  # the same answer, computed afresh: nothing bad was served
        assert tier_stats(s)["disk"]["corrupt_dropped"] == 3
        rc, log = s.stop()
    assert rc == 0 and "Traceback" not in log, log
    dropped = [line for line in log.splitlines() if "dropping" in line]
    assert len(dropped) == 3, log
    assert sum("does not decrypt" in line for line in dropped) == 2
    assert sum("header says" in line for line in dropped) == 1  # the truncated one: its size


def test_blocks_written_behind_keep_their_tenant_and_the_quota_holds(tmp_path):
    """At the default write interval (every block reaches the disk by write-behind, none by eviction), tenant B's 7
    blocks (within its half share) stay on disk while tenant A, at priority 100, writes three times as many."""
    folder = tmp_path / "tier"
    per_block = 4 * 2 * BS * 2 * 48 * 4 + 2048  # demo model: 4 layers, K and V, 2 kv heads x 48, float32 on the CPU
    args = (*PAGED, "--kv-disk-cache", str(folder), "--kv-disk-cache-size", str(14 * per_block),
            "--kv-tenant-share", "0.5")
    rng = np.random.default_rng(3)
    with server(*args) as s:
        b_prompt = [int(t) for t in rng.integers(3, VOCAB, 7 * BS + 1)]
        complete(s, b_prompt, cache_salt="tenant-b")
        deadline = time.monotonic() + 30
        while len(files(folder)) < 7:  # written behind by the sweep
            assert time.monotonic() < deadline, "write-behind wrote nothing"
            time.sleep(0.2)
        for _ in range(3):
            a_prompt = [int(t) for t in rng.integers(3, VOCAB, 7 * BS + 1)]
            complete(s, a_prompt, cache_salt="tenant-a", retention={"token_ranges": [{"start": 0, "priority": 100}]})
        rc, log = s.stop()  # the graceful stop flushes what the sweeps have not written yet
    assert rc == 0 and "Traceback" not in log, log
    seal = open_seal(folder, create=False)
    headers = [read_header_file(p, seal)[0] for p in files(folder)]
    a = [h for h in headers if h.priority == 100]
    b = [h for h in headers if h.priority < 100]
    assert len(a) >= 3, log  # A wrote, up to its quota
    assert len(b) == 7, (len(a), len(b))  # every block of B is still there
    assert len({h.tenant_tag for h in b}) == 1 and {h.tenant_tag for h in a}.isdisjoint({h.tenant_tag for h in b})


def test_each_write_uses_a_fresh_nonce_and_a_file_moved_between_secrets_does_not_decrypt(tmp_path):
    from test_tier_store import FP, make_block

    from mlxkv.kv.tier.format import PREFIX, FormatError, encode_block
    from mlxkv.kv.tier.seal import NONCE_BYTES, Seal

    seal, block = Seal(b"k" * 32), make_block(1)
    one, two = encode_block(block, FP, seal), encode_block(block, FP, seal)
    assert one != two and len(one) == len(two)  # the same block twice: nothing in common past the prefix
    assert one[PREFIX.size:PREFIX.size + NONCE_BYTES] != two[PREFIX.size:PREFIX.size + NONCE_BYTES]
    for data in (one, two):
        assert decode_block(data, seal, FP["digest"]).arrays[0].tobytes() == block.arrays[0].tobytes()
    with pytest.raises(FormatError, match="does not decrypt"):
        decode_block(one, Seal(b"j" * 32), FP["digest"])


def test_a_full_disk_while_making_the_secret_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno
    import os

    from mlxkv.kv.tier.seal import load_secret

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        load_secret(tmp_path / "tier")
    assert list(tmp_path.iterdir()) == []  # neither the secret nor a stray .tmp
