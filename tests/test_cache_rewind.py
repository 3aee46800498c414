"""Exact rewind: ``trim(n)`` restores the state before the last n tokens for every layout — wrapped rotating
caches and chunked caches trimmed back across a chunk boundary included — or raises RewindError."""

from functools import cache

import mlx.core as mx
import pytest
from testkit.archs import build_model

from mlxkv.kv.layouts import (
    ChunkedKVCache,
    KVCache,
    QuantizedChunkedKVCache,
    QuantizedRotatingKVCache,
    RewindError,
    RotatingKVCache,
    install_attention_hook,
    make_caches,
)

PROMPT = [(i * 37 + 11) % 1000 + 3 for i in range(40)]


@cache
def model_for(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    return model


def step(model, caches, tokens):
    logits = model(mx.array([tokens]), cache=caches)[0, -1]  # (vocab,)
    mx.eval(logits)
    return logits


def greedy(model, caches, token, n):
    """Feed ``token``, then n-1 greedy tokens; return the n greedy picks and their logits."""
    picks, logits = [], []
    for _ in range(n):
        out = step(model, caches, [token])
        token = mx.argmax(out).item()
        picks.append(token)
        logits.append(out)
    return picks, logits


def offsets(caches):
    return [c.offset for c in caches]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "llama4"])
@pytest.mark.parametrize("k", [1, 23, 38])
def test_trim_then_regenerate(arch, k):
    """40 prompt tokens + 40 decoded (gemma3's 8-token window has wrapped ten times; llama4 spans chunks
    0-4), trim k, regenerate: the same tokens and logits. k=23 and k=38 cross llama4 chunk boundaries."""
    model = model_for(arch)
    caches = make_caches(model)
    first = mx.argmax(step(model, caches, PROMPT)).item()
    picks, logits = greedy(model, caches, first, 40)
    seq = [first, *picks]  # seq[i] is fed at position 40 + i; 40 fed so far (offset 80)
    assert offsets(caches)[0] == 80
    for c in caches:
        assert c.trim(k) == k
    again, again_logits = greedy(model, caches, seq[40 - k], k)
    assert again == picks[40 - k:]
    assert max(mx.abs(a - b).max().item() for a, b in zip(again_logits, logits[40 - k:])) <= 1e-5


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_speculative_pattern_multi_token_then_trim(arch):
    """Verify-style: append 6 tokens in one forward (3 of them wrong), trim the 3, continue: same greedy run."""
    model = model_for(arch)
    ref = make_caches(model)
    first = mx.argmax(step(model, ref, PROMPT)).item()
    picks, _ = greedy(model, ref, first, 30)
    seq = [first, *picks]

    caches = make_caches(model)
    step(model, caches, PROMPT)
    greedy(model, caches, first, 19)  # fed seq[0..18]
    step(model, caches, seq[19:22] + [7, 8, 9])  # seq[19..21] then 3 rejected drafts
    for c in caches:
        assert c.trim(3) == 3
    again, _ = greedy(model, caches, seq[22], 8)
    assert again == seq[23:31]


def test_beyond_the_undo_record_raises_and_changes_nothing():
    model = model_for("gemma3_text")
    caches = make_caches(model, max_rewind=4)
    ref = make_caches(model, max_rewind=4)
    first = mx.argmax(step(model, caches, PROMPT)).item()
    step(model, ref, PROMPT)
    greedy(model, caches, first, 20)
    picks, _ = greedy(model, ref, first, 30)
    rotating = caches[0]
    assert isinstance(rotating, RotatingKVCache) and rotating.rewindable() == 5  # max_rewind + 1
    with pytest.raises(RewindError, match="at most 5"):
        rotating.trim(6)
    assert RotatingKVCache(8, max_rewind=0).is_trimmable()  # nothing cached yet: trimmable, like mlx-lm
    assert rotating.offset == 60  # unchanged by the refused trim
    again, _ = greedy(model, caches, picks[19], 10)
    assert again == picks[20:30]


def rows(n, d=8, seed=0):
    return mx.random.normal((1, 2, n, d), key=mx.random.key(seed))  # (B, n_kv, L, D)


def feed(cache, kv, by_token=True):
    if by_token:
        for i in range(kv.shape[2]):
            out = cache.update_and_fetch(kv[..., i:i + 1, :], -kv[..., i:i + 1, :])
    else:
        out = cache.update_and_fetch(kv, -kv)
    mx.eval(out)
    return out


def attention(cache, kv_new):
    """What the next token at kv_new sees: the attention output for a fixed query (order independent)."""
    mask = cache.make_mask(1)
    k, v = cache.update_and_fetch(kv_new, -kv_new)
    q = mx.random.normal((1, 4, 1, kv_new.shape[-1]), key=mx.random.key(9))
    return cache.attend(q, k, v, scale=0.3, mask=mask)


LAYOUTS = {
    "rotating": lambda: RotatingKVCache(8, keep=0, max_rewind=6, step=4),
    "rotating-sinks": lambda: RotatingKVCache(8, keep=2, max_rewind=6, step=4),
    "chunked": lambda: ChunkedKVCache(8, max_rewind=6, step=4),
    "standard": lambda: KVCache(step=4),
    "rotating-q8": lambda: QuantizedRotatingKVCache(8, keep=2, max_rewind=6, step=4, bits=8, group_size=32),
    "chunked-q4": lambda: QuantizedChunkedKVCache(8, max_rewind=6, step=4, bits=4, group_size=32),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("by_token", [True, False])
def test_every_exact_trim_equals_a_fresh_cache(layout, by_token):
    """For every n the cache says it can rewind: trimmed == a cache that only ever saw the kept tokens
    (bit-equal rows when both were fed token by token); one more raises."""
    kv = rows(60, d=32)
    for m in range(61, 30, -1):  # trim back from 60 tokens (wrapped 6 times) to 30, one size at a time
        cache = LAYOUTS[layout]()
        feed(cache, kv[..., :40, :], by_token)
        feed(cache, kv[..., 40:, :], by_token)
        n = 60 - min(m, 60)
        if n > cache.rewindable():
            with pytest.raises(RewindError):
                cache.trim(n)
            continue
        assert cache.trim(n) == n and cache.offset == 60 - n
        fresh = LAYOUTS[layout]()
        feed(fresh, kv[..., :60 - n, :], True)
        nxt = rows(1, d=32, seed=5)
        if by_token:
            a, b = cache.update_and_fetch(nxt, -nxt), fresh.update_and_fetch(nxt, -nxt)
            assert all(mx.array_equal(x, y).item() for x, y in zip(_flat(a), _flat(b)))
        else:
            assert mx.allclose(attention(cache, nxt), attention(fresh, nxt), atol=1e-5).item()


def _flat(fetched):
    out = []
    for x in fetched:
        out.extend(x if isinstance(x, tuple) else [x])
    return out


def test_rewind_limits_are_as_documented():
    rot = RotatingKVCache(8, keep=2, max_rewind=6, step=4)
    feed(rot, rows(13))  # ring = 6 + 6 rows: not wrapped yet (2 sinks + 11 < 14)
    assert rot.rewindable() == 13
    feed(rot, rows(40, seed=1))
    assert rot.rewindable() == 7  # max_rewind + 1 once wrapped
    chunked = ChunkedKVCache(16, max_rewind=4, step=8)
    feed(chunked, rows(100))
    assert chunked.rewindable() >= 4 and chunked.start_position == 96
    with pytest.raises(RewindError):
        chunked.trim(chunked.rewindable() + 1)
    assert KVCache().trim(5) == 0  # nothing cached: nothing removed (mlx-lm clamps the same way)
    std = KVCache()
    feed(std, rows(10))
    assert std.trim(50) == 10 and std.offset == 0
