"""Hashing, retention rules and KvCacheConfig validation (pure Python)."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.config import KvCacheConfig, num_blocks_for_budget
from mlxkv.kv.blocks.hashing import (
    HashContext,
    builtin_block_hash,
    encode_key,
    extend_block_hashes,
    make_hash_fn,
    sha256_block_hash,
    xxhash_available,
)
from mlxkv.kv.blocks.retention import (
    RetentionConfig,
    TokenRangeRetention,
    merge_retention,
)

ROOT = str(Path(__file__).resolve().parents[1])


# ---- hashing -------------------------------------------------------------------------------------------
def test_sha256_chain_depends_on_parent_tokens_and_extra_keys():
    h0 = sha256_block_hash(None, (1, 2, 3, 4), ())
    assert isinstance(h0, bytes) and len(h0) == 32
    assert sha256_block_hash(None, (1, 2, 3, 4), ()) == h0
    assert sha256_block_hash(h0, (1, 2, 3, 4), ()) != h0
    assert sha256_block_hash(None, (1, 2, 3, 5), ()) != h0
    assert sha256_block_hash(None, (1, 2, 3, 4), (("x", ("lora-a",)),)) != h0
    # the encoding is typed: int 1 and str "1" and True differ, and tuple nesting counts
    assert encode_key(1) != encode_key("1") != encode_key(True)
    assert encode_key(((1, 2), 3)) != encode_key((1, (2, 3)))
    with pytest.raises(TypeError, match="cannot hash extra key"):
        encode_key({1: 2})


def test_sha256_is_stable_across_processes():
    code = ("from mlxkv.kv.blocks.hashing import sha256_block_hash as h;"
            "print(h(h(None,(5,6),(('s','salt'),)),(7,8),()).hex())")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": ROOT, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    here = sha256_block_hash(sha256_block_hash(None, (5, 6), (("s", "salt"),)), (7, 8), ()).hex()
    assert outs == {here}
    # and it is plain sha256 of documented bytes, not something process-specific
    assert len(bytes.fromhex(here)) == hashlib.sha256().digest_size


def test_hash_algorithms_and_choices():
    assert make_hash_fn("builtin") is builtin_block_hash
    assert isinstance(builtin_block_hash(None, (1, 2), ()), int)
    custom = lambda parent, tokens, extra: 0
    assert make_hash_fn(custom) is custom
    with pytest.raises(ValueError, match="sha256, builtin, xxhash"):
        make_hash_fn("md5")
    if not xxhash_available():
        with pytest.raises(ValueError, match="pip install xxhash"):
            make_hash_fn("xxhash")


def test_memoized_hash_returns_the_same_hashes_and_hashes_a_seen_prefix_once():
    from mlxkv.kv.blocks.hashing import MemoizedHash

    calls = []
    memo = MemoizedHash(lambda p, t, e: calls.append(t) or sha256_block_hash(p, t, e), max_entries=3)
    tokens = list(range(16))
    first = extend_block_hashes(memo, tokens, 12, 4, HashContext(salt="a"), [])
    assert first == extend_block_hashes(sha256_block_hash, tokens, 12, 4, HashContext(salt="a"), [])
    assert len(calls) == 3
    assert extend_block_hashes(memo, tokens, 12, 4, HashContext(salt="a"), []) == first
    assert len(calls) == 3  # all three from the memo
    assert extend_block_hashes(memo, tokens, 12, 4, HashContext(salt="b"), []) != first  # the salt is in the key
    assert len(calls) == 6 and len(memo) == 3  # bounded: the oldest entries went
    with pytest.raises(ValueError):
        MemoizedHash(sha256_block_hash, max_entries=0)


def test_salt_enters_first_block_only_and_is_carried_by_the_chain():
    ctx = HashContext(salt="tenant-a", extra=("lora",), spans=((5, 9, "img0"),))
    assert ctx.block_extra_keys(0, 4) == (("x", ("lora",)), ("s", "tenant-a"))
    assert ctx.block_extra_keys(1, 4) == (("x", ("lora",)), ("m", ("img0",)))
    assert ctx.block_extra_keys(2, 4) == (("x", ("lora",)), ("m", ("img0",)))
    assert ctx.block_extra_keys(3, 4) == (("x", ("lora",)),)
    tokens = list(range(12))
    a = extend_block_hashes(sha256_block_hash, tokens, 12, 4, HashContext(salt="a"), [])
    b = extend_block_hashes(sha256_block_hash, tokens, 12, 4, HashContext(salt="b"), [])
    plain = extend_block_hashes(sha256_block_hash, tokens, 11, 4, HashContext(), [])
    assert len(a) == 3 and len(plain) == 2  # full blocks only
    assert all(x != y for x, y in zip(a, b)) and all(x != y for x, y in zip(a, plain))
    # incremental extension equals hashing at once
    part = extend_block_hashes(sha256_block_hash, tokens, 5, 4, HashContext(salt="a"), [])
    assert extend_block_hashes(sha256_block_hash, tokens, 12, 4, HashContext(salt="a"), part) == a


# ---- retention -----------------------------------------------------------------------------------------
def test_retention_validation_messages():
    with pytest.raises(ValueError, match="0..100"):
        RetentionConfig(ranges=[(0, 10, 101)])
    with pytest.raises(ValueError, match="0..100"):
        RetentionConfig(decode_priority=-1)
    with pytest.raises(ValueError, match="overlap"):
        RetentionConfig(ranges=[(0, 10, 50), (5, 20, 60)])
    with pytest.raises(ValueError, match="overlap"):
        RetentionConfig(ranges=[(10, None, 50), (20, 30, 60)])
    with pytest.raises(ValueError, match="end must be None or an integer > start"):
        RetentionConfig(ranges=[(10, 10, 50)])
    with pytest.raises(ValueError, match="start=-1"):
        TokenRangeRetention(-1, 4, 50)
    with pytest.raises(ValueError, match="duration"):
        RetentionConfig(ranges=[(0, 4, 50, 0)])
    with pytest.raises(ValueError, match=r"expected \(start, end\|None, priority"):
        RetentionConfig(ranges=[(0, 4)])
    ok = RetentionConfig(ranges=[(10, None, 20), (0, 10, 90, 30.0)])
    assert [r.start for r in ok.ranges] == [0, 10]  # sorted


def test_block_retention_takes_the_highest_rule_of_its_tokens():
    cfg = RetentionConfig(ranges=[(0, 8, 90, 60.0), (8, 12, 10)], decode_priority=70, decode_duration_s=5.0)
    now = 100.0
    assert cfg.block_retention(0, 4, 20, now) == (90, 160.0)
    assert cfg.block_retention(8, 12, 20, now) == (10, None)
    assert cfg.block_retention(12, 16, 20, now) == (35, None)  # uncovered prompt tokens: default
    assert cfg.block_retention(4, 12, 20, now) == (90, 160.0)  # straddles: the higher wins
    assert cfg.block_retention(16, 24, 20, now) == (70, 105.0)  # reaches into decode tokens
    assert cfg.block_retention(20, 24, 20, now) == (70, 105.0)
    assert RetentionConfig().block_retention(0, 4, 4, now) == (35, None)


def test_merge_retention_expiry_returns_to_default():
    assert merge_retention((90, 10.0), (50, None), now=5.0) == (90, 10.0)
    assert merge_retention((90, 10.0), (50, None), now=10.0) == (50, None)  # 90 expired → 35 < 50
    assert merge_retention((90, 10.0), (20, None), now=11.0) == (35, None)
    assert merge_retention((60, 10.0), (60, None), now=1.0) == (60, None)  # equal: longer-lived wins


# ---- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "sparse"}, "dense, paged"),
        ({"block_size": 12}, "power of two in 1..256"),
        ({"block_size": 512}, "power of two in 1..256"),
        ({"block_size": True}, "power of two"),
        ({"kv_cache_budget": "lots"}, "'auto' or a number of bytes"),
        ({"kv_cache_budget": 0}, "'auto' or a number of bytes"),
        ({"free_memory_fraction": 0.0}, r"\(0, 1\]"),
        ({"free_memory_fraction": 1.5}, r"\(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"enable_block_reuse": "yes"}, "True or False"),
        ({"hash_algo": "md5"}, "sha256, builtin, xxhash"),
        ({"secondary_offload_min_priority": 101}, "0..100"),
        ({"kv_bits": 3}, "None, 4, 8"),
        ({"kv_group_size": 16}, "32, 64, 128"),
        ({"max_kv_size": 0}, "max_kv_size"),
    ],
)
def test_config_rejects_invalid_values_naming_valid_ones(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KvCacheConfig(**kwargs)


def test_config_defaults_and_valid_values():
    c = KvCacheConfig()
    assert (c.backend, c.block_size, c.kv_cache_budget, c.free_memory_fraction) == ("dense", 16, "auto", 0.9)
    assert c.enable_block_reuse and c.enable_partial_reuse and c.copy_on_partial_reuse
    assert c.hash_algo == "sha256" and c.secondary_offload_min_priority == 35
    for b in (1, 2, 64, 256):
        KvCacheConfig(backend="paged", block_size=b, kv_bits=4, kv_group_size=32, max_kv_size=128)


def test_num_blocks_for_budget_smaller_limit_wins():
    per_block = 1000
    frac = KvCacheConfig(block_size=16, free_memory_fraction=0.5)
    assert num_blocks_for_budget(frac, per_block, free_bytes=100_000) == 50
    both = KvCacheConfig(block_size=16, free_memory_fraction=0.5, max_tokens=320)
    assert num_blocks_for_budget(both, per_block, free_bytes=100_000) == 21  # 320/16 blocks + the null block
    assert num_blocks_for_budget(both, per_block, free_bytes=20_000) == 10  # memory is now the smaller
    fixed = KvCacheConfig(kv_cache_budget=64_000, max_tokens=10_000)
    assert num_blocks_for_budget(fixed, per_block) == 64
    with pytest.raises(ValueError, match="needs free_bytes"):
        num_blocks_for_budget(frac, per_block)
    with pytest.raises(ValueError, match="need at least 2"):
        num_blocks_for_budget(frac, per_block, free_bytes=2_000)


def test_no_mlx_import_in_block_manager_or_config():
    code = ("import sys, mlxkv.config, mlxkv.kv.blocks, mlxkv.kv.blocks.manager;"
            "print(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": ROOT}).stdout.strip()
    assert out == "False"
