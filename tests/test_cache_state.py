"""State round trips (mx.array_equal) for every layout, and prompt-cache files in mlx-lm's format both ways."""

from functools import cache

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache
from testkit.archs import build_model

from mlxkv.kv.layouts import (
    ChunkedKVCache,
    KVCache,
    LayerCache,
    QuantizedChunkedKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    install_attention_hook,
    load_prompt_cache,
    make_caches,
    save_prompt_cache,
)

LAYOUTS = {
    "standard": lambda: KVCache(step=16),
    "rotating": lambda: RotatingKVCache(8, max_rewind=5, step=4),
    "rotating-sinks": lambda: RotatingKVCache(10, keep=3, max_rewind=5, step=4),
    "chunked": lambda: ChunkedKVCache(8, max_rewind=5, step=4),  # fronts dropped (small steps)
    "standard-q8": lambda: QuantizedKVCache(step=16, bits=8, group_size=32),
    "rotating-q4": lambda: QuantizedRotatingKVCache(8, keep=2, max_rewind=5, step=4, bits=4, group_size=32),
    "chunked-q8": lambda: QuantizedChunkedKVCache(8, max_rewind=5, step=4, bits=8, group_size=32),
}


def flat(x):
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in flat(item)]
    return [x]


def equal_states(a, b):
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array) and x.dtype == y.dtype and mx.array_equal(x, y).item()
        else:
            assert x == y


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [0, 5, 37])
def test_state_round_trip(layout, n):
    kv = mx.random.normal((1, 2, 40, 32), key=mx.random.key(0))  # (B, n_kv, L, D)
    cache = LAYOUTS[layout]()
    if n:
        cache.update_and_fetch(kv[..., :n - 3, :], -kv[..., :n - 3, :])  # a chunk, then tokens
        for i in range(n - 3, n):
            cache.update_and_fetch(kv[..., i:i + 1, :], -kv[..., i:i + 1, :])
    state = cache.state
    copy = type(cache).from_state(state)
    assert type(copy) is type(cache) and copy.offset == cache.offset
    equal_states(copy.state, state)
    assert copy.meta_state == cache.meta_state and all(isinstance(s, str) for s in cache.meta_state)
    # same future: the next update returns the same rows in the same order (a wrapped rotating window's state
    # keeps where its ring started) and the next token attends them alike
    nxt = kv[..., 39:, :]
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(2))

    def future(c):
        mask = c.make_mask(1)
        k, v = c.update_and_fetch(nxt, nxt)
        return c.attend(q, k, v, scale=0.2, mask=mask), (k, v)

    (out_a, kv_a), (out_b, kv_b) = future(copy), future(cache)
    assert mx.allclose(out_a, out_b, atol=1e-6).item()
    equal_states(kv_a, kv_b)


@cache
def model_for(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    return model


PROMPT = mx.array([[(i * 37 + 11) % 1000 + 3 for i in range(40)]])


def continue_decoding(model, caches, n=8):
    token, out = mx.array([[17]]), []
    for _ in range(n):
        logits = model(token, cache=caches)[0, -1]
        out.append(logits)
        token = mx.argmax(logits).reshape(1, 1)
    mx.eval(out)
    return out


def max_diff(a, b):
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4", "qwen3_next"])
def test_prompt_cache_files(arch, tmp_path):
    """Ours -> file -> ours (exact) and -> mlx-lm's loader (its classes, same logits); mlx-lm's file -> ours."""
    model = model_for(arch)
    caches = make_caches(model)
    model(PROMPT, cache=caches)
    path = str(tmp_path / "ours.safetensors")
    save_prompt_cache(path, caches, {"arch": arch})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"arch": arch}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for a, b in zip(loaded, caches):
        equal_states(a.state, b.state)
    theirs = mlx_cache.load_prompt_cache(path)
    assert all(type(c).__module__ == "mlx_lm.models.cache" for c in theirs)

    expected = continue_decoding(model, caches)
    assert max_diff(continue_decoding(model, loaded), expected) == 0.0
    assert max_diff(continue_decoding(model, theirs), expected) <= 1e-5

    ref = mlx_cache.make_prompt_cache(model)
    model(PROMPT, cache=ref)
    mlx_path = str(tmp_path / "mlx.safetensors")
    mlx_cache.save_prompt_cache(mlx_path, ref)
    ours_from_mlx = load_prompt_cache(mlx_path)
    assert all(isinstance(c, (LayerCache, mlx_cache.ArraysCache)) for c in ours_from_mlx)
    assert max_diff(continue_decoding(model, ours_from_mlx), continue_decoding(model, ref)) <= 1e-5


def test_quantized_file_loads_in_mlx_lm(tmp_path):
    cache = QuantizedKVCache(bits=8, group_size=32)
    kv = mx.random.normal((1, 2, 20, 32), key=mx.random.key(1))
    cache.update_and_fetch(kv, kv)
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, [cache])
    (theirs,) = mlx_cache.load_prompt_cache(path)
    assert type(theirs) is mlx_cache.QuantizedKVCache and theirs.offset == 20 and theirs.bits == 8
    equal_states(theirs.state, cache.state)
    (ours,) = load_prompt_cache(path)
    assert type(ours) is QuantizedKVCache
    equal_states(ours.state, cache.state)


def test_cache_list_file_round_trip(tmp_path):
    """CacheList members come back as mlxkv layouts (mlx-lm's own loader would make them mlx-lm's)."""
    lst = mlx_cache.CacheList(KVCache(), RotatingKVCache(8))
    kv = mx.random.normal((1, 1, 12, 4), key=mx.random.key(4))
    for c in lst.caches:
        c.update_and_fetch(kv, kv)
    path = str(tmp_path / "list.safetensors")
    save_prompt_cache(path, [lst])
    (loaded,) = load_prompt_cache(path)
    assert type(loaded) is mlx_cache.CacheList
    assert [type(c) for c in loaded.caches] == [KVCache, RotatingKVCache]
    for a, b in zip(loaded.caches, lst.caches):
        equal_states(a.state, b.state)
