"""Secondary tier: disk format round trips and verification, stores (caps, priority-LRU, persistence,
atomic writes) and the offload priority threshold."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxkv.kv.tier.disk_store as disk_module
from mlxkv.kv.tier import (
    DiskStore,
    FormatError,
    HostMemoryStore,
    SecondaryTier,
    Seal,
    TierBlock,
    decode_block,
    encode_block,
    make_fingerprint,
)
from mlxkv.kv.tier.format import extra_digest, to_host, to_mx

FP = make_fingerprint("llama", "sample", "a" * 64)
OTHER_FP = make_fingerprint("llama", "sample", "b" * 64)
B = 4
SEAL = Seal(b"k" * 32)


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def make_block(i: int, priority: int = 35, layers=(0, 1), heads=2, dim=8, dtype="float32", group=0) -> TierBlock:
    rng = np.random.default_rng(i)
    arrays, dtypes = [], []
    for _ in layers:
        for _ in range(2):
            a = mx.array(rng.standard_normal((B, heads, dim)).astype(np.float32)).astype(getattr(mx, dtype))
            host, name = to_host(a)
            arrays.append(host)
            dtypes.append(name)
    return TierBlock(block_hash=h(i), parent_hash=h(i - 1) if i else None, group_id=group, layers=tuple(layers),
                     token_ids=tuple(range(i * B, (i + 1) * B)), extra_digest=extra_digest(()), priority=priority,
                     arrays=arrays, dtypes=dtypes)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_encode_decode_round_trip_is_exact(dtype):
    block = make_block(3, priority=80, dtype=dtype)
    back = decode_block(encode_block(block, FP, SEAL), SEAL, FP["digest"], block_hash=h(3), block_size=B,
                        layout=block.layout())
    assert (back.block_hash, back.parent_hash, back.group_id, back.layers, back.priority, back.created) == (
        block.block_hash, block.parent_hash, block.group_id, block.layers, block.priority, block.created)
    assert back.token_ids is None and back.matches(block.token_ids, block.extra_digest)  # tokens only as a tag
    assert not back.matches(block.token_ids[:-1] + (999,), block.extra_digest)
    assert not back.matches(block.token_ids, extra_digest((("s", "another tenant"),)))
    for a, b, da, db in zip(block.arrays, back.arrays, block.dtypes, back.dtypes):
        x, y = to_mx(a, da), to_mx(b, db)
        assert x.dtype == y.dtype == getattr(mx, dtype)
        assert mx.array_equal(x, y).item()


def test_decode_rejects_every_kind_of_damage():
    block = make_block(1)
    data = encode_block(block, FP, SEAL)
    ok = decode_block(data, SEAL, FP["digest"])
    assert ok.matches(block.token_ids, block.extra_digest)
    bad = {
        "truncated": data[:-1],
        "truncated header": data[:20],
        "padded": data + b"\0",
        "other model": encode_block(block, OTHER_FP, SEAL),
        "other secret": encode_block(block, FP, Seal(b"x" * 32)),
    }
    for pos in (3, 12, 40, len(data) // 2, len(data) - 40, len(data) - 1):  # magic, header, payload, checksum
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        bad[f"flip {pos}"] = bytes(flipped)
    for name, raw in bad.items():
        with pytest.raises(FormatError):
            decode_block(raw, SEAL, FP["digest"])
        assert name  # every damaged variant raised
    with pytest.raises(FormatError, match="hash"):
        decode_block(data, SEAL, FP["digest"], block_hash=h(2))
    with pytest.raises(FormatError, match="block size"):
        decode_block(data, SEAL, FP["digest"], block_size=8)
    with pytest.raises(FormatError, match="layout"):
        decode_block(data, SEAL, FP["digest"], layout=make_block(1, layers=(0,)).layout())


def test_disk_store_persists_across_restart(tmp_path):
    s = DiskStore(tmp_path, FP, 1 << 20, block_size=B)
    blocks = [make_block(i, priority=40 + i) for i in range(3)]
    for b in blocks:
        assert s.put(b)
    s2 = DiskStore(tmp_path, FP, 1 << 20, block_size=B)  # a "restart": a new store over the same folder
    assert len(s2) == 3 and s2.nbytes == s.nbytes == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert s2.by_priority() == {40: 1, 41: 1, 42: 1}
    for b in blocks:
        got = s2.get((0, b.block_hash))
        assert got is not None and got.matches(b.token_ids, b.extra_digest)
        assert all(np.array_equal(x, y) for x, y in zip(got.arrays, b.arrays))


def _only_file(tmp_path):
    (path,) = [p for p in tmp_path.iterdir()]
    return path


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header"])
def test_damaged_file_is_dropped_with_warning_and_never_served(tmp_path, caplog, damage):
    s = DiskStore(tmp_path, FP, 1 << 20)
    b = make_block(5)
    s.put(b)
    path = _only_file(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 100]
    else:
        raw[-60 if damage == "flip_payload" else 30] ^= 0x10
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        # damage found at read time by the live store, or at scan time by a restarted one
        assert s.get((0, b.block_hash)) is None
    assert "dropping" in caplog.text and not path.exists() and len(s) == 0 and s.num_corrupt == 1
    s.put(b)
    path = _only_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        s2 = DiskStore(tmp_path, FP, 1 << 20)
    assert len(s2) == 0 and "truncated" in caplog.text and not path.exists()


def test_other_models_files_are_ignored_not_deleted(tmp_path, caplog):
    DiskStore(tmp_path, OTHER_FP, 1 << 20).put(make_block(1))
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        s = DiskStore(tmp_path, FP, 1 << 20)
    assert len(s) == 0 and s.num_foreign == 1 and "another model" in caplog.text
    assert len(list(tmp_path.iterdir())) == 1  # left for its own model
    assert s.get((0, h(1))) is None
    # the same file renamed to look like ours is still refused (fingerprint inside the header)
    foreign = _only_file(tmp_path)
    os.rename(foreign, s.path_for((0, h(1))))
    s._lru.add((0, h(1)), 35, foreign.stat().st_size if foreign.exists() else 1, "")
    with caplog.at_level(logging.WARNING, logger="mlxkv.kv.tier"):
        assert s.get((0, h(1))) is None
    assert "another model" in caplog.text


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    s = DiskStore(tmp_path, FP, 1 << 20)
    s.put(make_block(0))
    before = sorted(p.name for p in tmp_path.iterdir())

    def half_then_crash(f, data, chunk=1 << 20):
        f.write(data[: len(data) // 2])
        raise KeyboardInterrupt("simulated crash mid-write")

    monkeypatch.setattr(disk_module, "_write_all", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        s.put(make_block(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial file, no temp file
    assert (0, h(1)) not in s and len(s) == 1
    # a crash that killed the process leaves a temp file: a later scan removes it once stale, never serves it
    tmp = tmp_path / f".{s.path_for((0, h(2))).name}.deadbeef.tmp"
    tmp.write_bytes(b"partial")
    os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    s2 = DiskStore(tmp_path, FP, 1 << 20)
    assert not tmp.exists() and len(s2) == 1


def test_priority_lru_eviction_order_memory():
    size = make_block(0).nbytes
    m = HostMemoryStore(3 * size)
    for i, p in enumerate([50, 35, 50]):
        assert m.put(make_block(i, priority=p)) == (True, [])
    m.get((0, h(0)))  # block 0 becomes most recent among priority 50
    stored, evicted = m.put(make_block(3, priority=50))
    assert stored and [b.block_hash for b in evicted] == [h(1)]  # lowest priority first
    stored, evicted = m.put(make_block(4, priority=60))
    assert stored and [b.block_hash for b in evicted] == [h(2)]  # then least recently used
    assert m.put(make_block(5, priority=40)) == (False, [])  # would push out more valuable blocks
    assert HostMemoryStore(size - 1).put(make_block(6)) == (False, [])  # larger than the cap


def test_offload_threshold_and_memory_to_disk_cascade(tmp_path):
    size = make_block(0).nbytes
    tier = SecondaryTier(35, memory=HostMemoryStore(2 * size), disk=DiskStore(tmp_path, FP, 1 << 20))
    assert not tier.offload(make_block(0, priority=34))
    assert tier.offload(make_block(1, priority=35))
    assert not tier.contains((0, h(0))) and tier.contains((0, h(1)))
    tier.offload(make_block(2, priority=90))
    tier.offload(make_block(3, priority=90))  # memory full: block 1 (lowest) cascades to disk
    assert (0, h(1)) in tier.disk and (0, h(1)) not in tier.memory
    assert tier.take((0, h(3))).block_hash == h(3) and (0, h(3)) not in tier.memory  # memory hit moves it
    assert tier.take((0, h(1))).block_hash == h(1) and (0, h(1)) in tier.disk  # disk hit keeps the file
    assert tier.take((0, h(0))) is None
    s = tier.stats()
    assert (s["dropped_low_priority"], s["hits_memory"], s["hits_disk"], s["lookups"]) == (1, 1, 1, 3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 11), st.integers(0, 100),
                              st.sampled_from([1, 2, 3])), min_size=1, max_size=30),
       mem_cap=st.integers(0, 6000), disk_cap=st.integers(0, 9000))
def test_caps_never_exceeded_under_random_workload(tmp_path_factory, ops, mem_cap, disk_cap):
    folder = tmp_path_factory.mktemp("tier")
    tier = SecondaryTier(20, memory=HostMemoryStore(mem_cap), disk=DiskStore(folder, FP, disk_cap))
    for op, i, prio, nlayers in ops:
        if op == "put":
            tier.offload(make_block(i, priority=prio, layers=tuple(range(nlayers))))
        else:
            got = tier.take((0, h(i)))
            assert got is None or got.matches(tuple(range(i * B, (i + 1) * B)), extra_digest(()))
        assert tier.memory.nbytes <= mem_cap and tier.disk.nbytes <= disk_cap
        on_disk = sum(p.stat().st_size for p in folder.iterdir())
        assert on_disk == tier.disk.nbytes
    restarted = DiskStore(folder, FP, disk_cap)
    assert restarted.nbytes == tier.disk.nbytes and sorted(restarted.keys()) == sorted(tier.disk.keys())
