"""CachePool: monotonic ids, max_sequences, release, memory accounting."""

import mlx.core as mx
import pytest
from testkit.archs import build_model

from mlxkv.kv.store import CachePool, PoolFullError, SequenceId


@pytest.fixture(scope="module")
def llama():
    model, config = build_model("llama")
    return model, config


def capacity(cache):
    """Token slots allocated in a layer's K buffer, read from the buffer itself."""
    if hasattr(cache, "capacity"):  # mlxkv layouts
        return cache.capacity
    return cache.keys.shape[2]  # mlx-lm: keys is (B, n_kv, capacity, D)


def prefill(model, caches, n):
    tokens = mx.arange(n, dtype=mx.uint32)[None] % 1000  # (1, n)
    mx.eval(model(tokens, cache=caches))


def test_ids_are_monotonic_and_never_reused(llama):
    pool = CachePool(llama[0], max_sequences=2)
    a = pool.open()
    b = pool.open()
    pool.release(a.id)
    c = pool.open()
    assert a.id < b.id < c.id
    assert c.id not in (a.id, b.id)
    assert a.id not in pool and c.id in pool


def test_max_sequences_is_enforced_with_a_clear_error(llama):
    pool = CachePool(llama[0], max_sequences=1)
    seq = pool.open()
    with pytest.raises(PoolFullError, match="max_sequences=1"):
        pool.open()
    pool.release(seq.id)
    pool.open()  # room again after a release


def test_release_unknown_or_twice_raises(llama):
    pool = CachePool(llama[0])
    seq = pool.open()
    pool.release(seq.id)
    with pytest.raises(KeyError):
        pool.release(seq.id)
    with pytest.raises(KeyError):
        pool.get(SequenceId(999))


@pytest.mark.parametrize("bad", [dict(max_sequences=0), dict(layout="nope"), dict(kv_bits=3), dict(max_kv_size=0)])
def test_bad_options_are_rejected(llama, bad):
    with pytest.raises(ValueError):
        CachePool(llama[0], **bad)


@pytest.mark.parametrize("layout", ["mlxkv", "mlx-lm"])
def test_memory_usage_matches_kv_formula(llama, layout):
    model, config = llama
    pool = CachePool(model, max_sequences=2, layout=layout)
    assert pool.memory_usage_bytes() == 0
    seq = pool.open(prompt_length=40)
    prefill(model, seq.caches, 40)
    assert seq.offset == 40
    kv_heads = config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    allocated = [capacity(cache) for cache in seq.caches]  # token slots in each layer's buffer
    assert all(a >= 40 for a in allocated)
    expected = sum(2 * kv_heads * head_dim * 4 * a for a in allocated)  # K and V, float32
    assert pool.memory_usage_bytes() == expected
    # A second sequence adds its own buffers; releasing it gives them back.
    other = pool.open()
    prefill(model, other.caches, 300)
    grown = pool.memory_usage_bytes()
    assert grown > expected
    pool.release(other.id)
    assert pool.memory_usage_bytes() == expected
    pool.release(seq.id)
    assert pool.memory_usage_bytes() == 0


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_window_layers_stop_growing_while_standard_layers_grow(arch):
    """memory_usage_bytes() follows each layout: full layers grow with context, sliding/chunked ones stop
    at their window plus the documented slack (max_rewind rows and one growth step)."""
    from mlxkv.kv.layouts import KVCache

    model, _ = build_model(arch)
    pool = CachePool(model)
    seq = pool.open()
    per_layer = []
    for _ in range(3):
        prefill(model, seq.caches, 300)  # 300, 600, 900 tokens
        per_layer.append([c.nbytes for c in seq.caches])
    totals = per_layer[-1]
    assert pool.memory_usage_bytes() == sum(totals)
    for i, cache in enumerate(seq.caches):
        sizes = [step[i] for step in per_layer]
        if type(cache) is KVCache:
            assert sizes[0] < sizes[1] < sizes[2]
        else:  # rotating(8) / chunked(16): bounded by window + max_rewind + growth step
            assert sizes[1] == sizes[2]
            assert sizes[2] < per_layer[-1][-1]
