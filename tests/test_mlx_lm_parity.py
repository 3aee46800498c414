"""mlx-lm's cache protocol on mlxkv's layouts: code written for mlx-lm's caches runs on ours unchanged.

mlx-lm's own functions (``save_prompt_cache`` / ``load_prompt_cache``, ``trim_prompt_cache``,
``create_attention_mask``, ``generate_step``, ``batch_generate``, ``BatchKVCache`` / ``CacheList`` merging)
run here on mlxkv caches, and mlxkv's answers are compared with mlx-lm's own classes fed the same rows.
Where mlx-lm's loader instantiates classes by name, the ``ours_in_mlx_lm`` fixture puts mlxkv's classes
under mlx-lm's names, as code that substitutes them would.

Deliberate differences: a rotating cache trims exactly up to its rewind limit where mlx-lm refuses once
its window is full (asserted as such); rotating sinks (``keep > 0``) stay visible to every query and a
``window_size`` beyond the cache's window is capped to it, so those masks are compared by shape only.
"""

import copy
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_attention_mask
from testkit.archs import build_from_config, get_config

import mlxkv.kv.layouts as ours
from mlxkv.kv.layouts import (
    BatchKVCache,
    BatchRotatingKVCache,
    ChunkedKVCache,
    KVCache,
    QuantizedChunkedKVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RewindError,
    RotatingKVCache,
    install_attention_hook,
    make_caches,
)
from mlxkv.kv.layouts import load_prompt_cache as our_load

pytestmark = pytest.mark.float_order

D = 32  # head_dim: a valid quantization group size
SUBSTITUTED = ("KVCache", "RotatingKVCache", "ChunkedKVCache", "QuantizedKVCache", "BatchKVCache",
               "BatchRotatingKVCache")
EXTRA = ("QuantizedRotatingKVCache", "QuantizedChunkedKVCache")  # no mlx-lm class has these names


@pytest.fixture
def ours_in_mlx_lm(monkeypatch):
    """mlx-lm's cache module with mlxkv's classes under mlx-lm's names (and our extra twins under theirs)."""
    for name in SUBSTITUTED + EXTRA:
        monkeypatch.setattr(mlx_cache, name, getattr(ours, name), raising=name in SUBSTITUTED)


def rows(n, seed=0, heads=2):
    """Random K/V rows ``(1, heads, n, D)`` and their negation (distinct keys and values)."""
    k = mx.random.normal((1, heads, n, D), key=mx.random.key(seed))  # (B, n_kv, L, D)
    return k, -k


def feed(caches, sizes, seed=0):
    """Append chunks of ``sizes`` rows to every cache alike (a negative size trims that many tokens, at most
    what the first cache can rewind; ``"max"`` trims that far); returns each cache's last fetched pair."""
    out = [None] * len(caches)
    for i, n in enumerate(sizes):
        if n == "max" or n < 0:
            n = caches[0].rewindable() if n == "max" else min(-n, caches[0].rewindable())
            for c in caches:
                c.trim(n)
            continue
        k, v = rows(n, seed=seed * 1000 + i)
        out = [c.update_and_fetch(k, v) for c in caches]
    return out


def flat(x):
    return [y for item in x for y in flat(item)] if isinstance(x, (tuple, list)) else [x]


def assert_equal_trees(a, b):
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array) and x.shape == y.shape and mx.array_equal(x, y).item()
        else:
            assert x == y


def assert_same_mask(a, b, what=""):
    """Same kind (None / "causal" / array), and for arrays the same shape, dtype and values."""
    assert type(a) is type(b), (what, a, b)
    if isinstance(a, mx.array):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
        assert mx.array_equal(a, b).item(), what
    else:
        assert a == b, what


# -- keys / values attributes ------------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True])
def test_keys_and_values_are_mlx_lm_buffers(quantized):
    """``cache.keys[..., :offset, :]`` are the cached rows (whole buffers, as mlx-lm's; plane tuples when
    quantized), and ``nbytes`` counts those buffers."""
    a = QuantizedKVCache(group_size=32, bits=8) if quantized else KVCache()
    b = mlx_cache.QuantizedKVCache(group_size=32, bits=8) if quantized else mlx_cache.KVCache()
    assert a.keys is None and a.values is None and a.empty() and a.nbytes == 0
    feed([a, b], [5, 1, 300, 1])
    off = a.offset
    for x, y in ((a.keys, b.keys), (a.values, b.values)):
        assert type(x) is type(y) and all(p.shape[2] >= off for p in flat(x))
        assert_equal_trees([p[..., :off, :] for p in flat(x)], [p[..., :off, :] for p in flat(y)])
    assert a.nbytes == sum(p.nbytes for p in flat((a.keys, a.values)))
    assert a.size() == off and not a.empty() and not b.empty()  # (mlx-lm's QuantizedKVCache.size() is 0)


def test_assigning_keys_as_mlx_lm_models_do():
    """Pipelined models write ``cache.keys = mx.depends(cache.keys, h)``; deepseek_v32's indexer writes
    ``cache.values = mx.zeros_like(cache.keys)``. Both leave a working cache."""
    a, b = KVCache(), KVCache()
    feed([a, b], [7, 1])
    a.keys = mx.depends(a.keys, mx.zeros((1,)))
    (ka, va), (kb, vb) = feed([a, b], [1, 3], seed=1)
    assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()
    a.values = mx.zeros_like(a.keys)
    k, v = a.update_and_fetch(*rows(1, seed=9))
    assert v.shape == k.shape and mx.array_equal(v[..., -1:, :], rows(1, seed=9)[1]).item()
    assert not mx.any(v[..., :-1, :]).item()  # the assigned buffer is the one the cache writes into
    a.keys = a.values = None
    assert a.empty() and a.nbytes == 0


def test_trim_then_update_overwrites_row_and_deepcopy_is_independent():
    """mlx-lm's test_cache_copying idea: after a deep copy and a trim the new row lands at the trimmed slot."""
    cache = KVCache()
    x, y, z = rows(10, 1)[0], rows(1, 2)[0], rows(1, 3)[0]
    cache.update_and_fetch(x, x)
    cache.update_and_fetch(y, y)
    old = copy.deepcopy(cache)
    assert mlx_cache.trim_prompt_cache([cache], 1) == 1 and (old.offset, cache.offset) == (11, 10)
    cache.update_and_fetch(z, z)
    assert mx.array_equal(old.keys[..., 10:11, :], y).item()
    assert mx.array_equal(cache.keys[..., 10:11, :], z).item()


BIG = 1 << 18  # rows: a 32 MiB buffer per K / V here


def decode_peak(cache_cls, hold):
    """Peak memory over 24 decode steps that read ``cache.keys`` the way mlx-lm code does; ``hold`` keeps
    the slices read alive across the next write (the negative control: views of the buffer; the next write is
    scheduled after the next read, so the last two)."""
    cache = cache_cls(step=BIG)
    k, v = rows(40, heads=1)
    mx.eval(cache.update_and_fetch(k, v), cache.arrays())
    mx.reset_peak_memory()
    start, prev, held = mx.get_active_memory(), None, []
    for i in range(24):
        k, v = cache.update_and_fetch(*rows(1, seed=i, heads=1))
        out = k.sum() + v.sum() + cache.keys[..., : cache.offset, :].sum()
        held = [*held[-1:], cache.keys[..., : cache.offset, :]] if hold else []
        del k, v
        if prev is not None:
            prev.item()  # step n done before step n + 1 is scheduled (the documented order)
        mx.async_eval(out)
        prev = out
    prev.item()
    del held
    return mx.get_peak_memory() - start


def test_reading_keys_keeps_decode_writes_in_place():
    buffer_bytes = BIG * D * 4
    assert decode_peak(KVCache, hold=False) < buffer_bytes / 4
    assert decode_peak(KVCache, hold=True) > buffer_bytes / 2  # holding views makes MLX copy: the check sees it


# -- masks -------------------------------------------------------------------------------------------------

# (ours, mlx-lm's cache that must answer the same); a chunked cache within its first chunk is a standard one
MASK_PAIRS = {
    "standard": (KVCache, mlx_cache.KVCache),
    "standard-q8": (lambda: QuantizedKVCache(group_size=32, bits=8),
                    lambda: mlx_cache.QuantizedKVCache(group_size=32, bits=8)),
    "rotating": (lambda: RotatingKVCache(8), lambda: mlx_cache.RotatingKVCache(8)),
    "rotating-q8": (lambda: QuantizedRotatingKVCache(8, bits=8, group_size=32), lambda: mlx_cache.RotatingKVCache(8)),
    "chunked": (lambda: ChunkedKVCache(64), mlx_cache.KVCache),
}
HISTORIES = [[], [3], [8], [12], [5, 1, 1], [3] + [1] * 12, [10, 1, 1, 1, 5, 1], [1] * 30]


@pytest.mark.parametrize("layout", MASK_PAIRS)
@pytest.mark.parametrize("N", [1, 3, 9])
@pytest.mark.parametrize("return_array", [False, True])
@pytest.mark.parametrize("window_size", [None, 4, 8])
def test_make_mask_matches_mlx_lm(layout, N, return_array, window_size):
    """Same kind, shape and values as mlx-lm's make_mask, directly and through create_attention_mask."""
    make_ours, make_theirs = MASK_PAIRS[layout]
    h = mx.zeros((1, N, 4))  # (B, L, hidden): create_attention_mask reads L
    for history in HISTORIES:
        a, b = make_ours(), make_theirs()
        feed([a, b], history)
        what = (layout, history, N, return_array, window_size)
        assert_same_mask(a.make_mask(N, return_array=return_array, window_size=window_size),
                         b.make_mask(N, return_array=return_array, window_size=window_size), what)
        assert_same_mask(create_attention_mask(h, a, window_size=window_size, return_array=return_array),
                         create_attention_mask(h, b, window_size=window_size, return_array=return_array), what)


@pytest.mark.parametrize("make", [lambda: RotatingKVCache(8, keep=3, max_rewind=4, step=4),
                                  lambda: ChunkedKVCache(16, max_rewind=4, step=8),
                                  lambda: QuantizedChunkedKVCache(16, max_rewind=4, bits=4, group_size=32)],
                         ids=["rotating-sinks", "chunked", "chunked-q4"])
def test_mask_arrays_span_the_fetched_rows(make):
    """Sinks and chunk boundaries included: an array mask is ``(N, K)``, K being the rows the update then
    returns, except one rotating query's, ``(K,)`` (mlx-lm's convention: its RotatingKVCache answers one query
    with a 1-D mask, its KVCache with ``(1, K)``, which chunked follows); with sinks the shape is mlx-lm's."""
    cache = make()
    rotating = isinstance(cache, RotatingKVCache)
    theirs = mlx_cache.RotatingKVCache(8, keep=3) if rotating else None
    for i, n in enumerate([5, 1, 1, 7, 1, 1, 1, 1, 9, 1, 3, 1, 1, 1, 1, 1, 1, 1, 20, 1]):
        for ws in (None, 4, 8):
            for ra in (False, True):
                m = cache.make_mask(n, return_array=ra, window_size=ws)
                k = feed([copy.deepcopy(cache)], [n], seed=i)[0][0]
                K = flat(k)[0].shape[2]
                if isinstance(m, mx.array):
                    assert m.shape == ((K,) if n == 1 and rotating else (n, K)) and m.dtype == mx.bool_
                t = theirs.make_mask(n, return_array=ra, window_size=ws) if theirs else None
                if isinstance(m, mx.array) and isinstance(t, mx.array):
                    assert m.shape == t.shape
        feed([cache] + ([theirs] if theirs else []), [n], seed=i)


def test_rotating_masks_as_mlx_lm_tests_them():
    """mlx-lm's test_rotating_cache_mask expectations, on ours."""
    cache = RotatingKVCache(max_size=8)
    assert cache.make_mask(4, window_size=5) == "causal"
    mask = create_attention_mask(mx.zeros((1, 4, 32)), cache, window_size=5, return_array=True)
    assert mask.dtype == mx.bool_ and mask.shape == (4, 4)
    assert cache.make_mask(6, window_size=5).sum(axis=-1).max().item() == 5
    assert cache.make_mask(1, window_size=5) is None
    cache.update_and_fetch(mx.zeros((1, 1, 10, 32)), mx.zeros((1, 1, 10, 32)))
    mask = cache.make_mask(3, window_size=5)
    assert mask.shape == (3, 10) and mx.all(mask.sum(axis=-1) == 5).item()
    assert cache.make_mask(1) is None
    assert cache.make_mask(1, window_size=5).tolist() == [True] + [False] * 3 + [True] * 4
    cache.update_and_fetch(mx.zeros((1, 1, 1, 32)), mx.zeros((1, 1, 1, 32)))
    assert cache.make_mask(1, window_size=5).tolist() == [True] * 2 + [False] * 3 + [True] * 3


# -- saving and loading --------------------------------------------------------------------------------------

LAYOUTS = {
    "standard": KVCache,
    "rotating": lambda: RotatingKVCache(8, keep=2),
    "rotating-ring-wraps": lambda: RotatingKVCache(8, max_rewind=3, step=4),
    "rotating-sinks-ring-wraps": lambda: RotatingKVCache(8, keep=2, max_rewind=3, step=4),
    "chunked": lambda: ChunkedKVCache(8, max_rewind=3, step=4),
    "standard-q4": lambda: QuantizedKVCache(group_size=32, bits=4),
    "rotating-q8": lambda: QuantizedRotatingKVCache(8, keep=2, max_rewind=3, step=4, bits=8, group_size=32),
    "chunked-q8": lambda: QuantizedChunkedKVCache(8, max_rewind=3, bits=8, group_size=32),
}
# a prefill past the window then two decodes (mlx-lm's own rotation check), decoding past a wrapped ring,
# a multi-token update after the wrap, a trim after it, and a trim to the rewind limit
SAVED_HISTORIES = [[10, 1, 1], [3] + [1] * 20, [12, 1, 1, 1, 5, 1, 1], [12, 1, 1, 1, -2, 1], [9, 1, 1, 1, 1, "max"]]
FUTURE = [1, 1, 1, 4, 1, -1, 1, 1]


def load_both_ways(path):
    """The file loaded by mlxkv's loader and by mlx-lm's (which instantiates by name: ours, substituted)."""
    return our_load(path), mlx_cache.load_prompt_cache(path)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("history", range(len(SAVED_HISTORIES)))
def test_saved_cache_continues_exactly(layout, history, tmp_path, ours_in_mlx_lm):
    """Save with mlx-lm's save_prompt_cache, load with both loaders: same state, and every later update (a
    rotating window included, whatever its ring order) returns arrays equal to the saved cache's."""
    caches = [LAYOUTS[layout]() for _ in range(3)]
    feed(caches, SAVED_HISTORIES[history])
    path = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(path, caches[:1], {"layout": layout})
    (a,), (b,) = load_both_ways(path)
    _, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert meta == {"layout": layout}
    for loaded in (a, b):
        assert type(loaded) is type(caches[0]) and loaded.offset == caches[0].offset
        assert_equal_trees(loaded.state, caches[0].state)
    for i, n in enumerate(FUTURE):
        if n < 0 and caches[0].rewindable() < -n:
            continue
        fetched = feed([caches[1], a, b], [n], seed=100 + i)
        if n > 0:
            assert_equal_trees(fetched[1], fetched[0])
            assert_equal_trees(fetched[2], fetched[0])


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("max_rewind", [0, 3])
@pytest.mark.parametrize("history", range(len(SAVED_HISTORIES) - 1))  # (mlx-lm cannot load a trimmed-to-limit one)
def test_mlx_lm_continues_our_rotating_file(keep, max_rewind, history, tmp_path):
    """mlx-lm's own loader reads our rotating file into its class, which then attends as ours does; with no
    undo rows the file is mlx-lm's own ring layout and mlx-lm returns exactly our rows."""
    cache = RotatingKVCache(8, keep=keep, max_rewind=max_rewind, step=4)
    feed([cache], SAVED_HISTORIES[history])
    path = str(tmp_path / "rot.safetensors")
    mlx_cache.save_prompt_cache(path, [cache])
    (theirs,) = mlx_cache.load_prompt_cache(path)
    assert type(theirs) is mlx_cache.RotatingKVCache
    q = mx.random.normal((1, 2, 1, D), key=mx.random.key(5))
    for i in range(12):
        k, v = rows(1, seed=200 + i)
        masks = cache.make_mask(1), theirs.make_mask(1)
        (ka, va), (kb, vb) = cache.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
        out = [mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.3, mask=m)
               for kk, vv, m in ((ka, va, masks[0]), (kb, vb, masks[1]))]
        assert mx.allclose(*out, atol=1e-6).item()
        if max_rewind == 0:
            assert_equal_trees((ka, va), (kb, vb))


def test_mixed_and_cache_list_files(tmp_path, ours_in_mlx_lm):
    """Recurrent state next to our layouts, flat and inside a CacheList, through mlx-lm's functions."""
    def make():
        arrays = mlx_cache.ArraysCache(size=2)
        arrays[0], arrays[1] = rows(1, seed=1)
        return [arrays, KVCache(), RotatingKVCache(8), ChunkedKVCache(256)]

    for wrap in (False, True):
        caches = make()
        feed(caches[1:], [7])
        saved = [mlx_cache.CacheList(*caches)] if wrap else caches
        path = str(tmp_path / f"mixed{wrap}.safetensors")
        mlx_cache.save_prompt_cache(path, saved)
        for loaded in load_both_ways(path):
            members = loaded[0].caches if wrap else loaded
            assert [type(c) for c in members] == [type(c) for c in caches]
            assert_equal_trees(members[0].state, caches[0].state)
            fresh = make()
            feed(fresh[1:], [7])
            assert_equal_trees(feed(list(members[1:]), [1], seed=3), feed(fresh[1:], [1], seed=3))


# -- trimming and copying -----------------------------------------------------------------------------------

def test_trim_prompt_cache_on_our_layouts():
    """mlx-lm's test_trim_cache, with our layouts (and one deliberate difference, below)."""
    for make in (KVCache, lambda: QuantizedKVCache(group_size=32)):
        caches = [make(), make()]
        feed(caches, [10])
        assert mlx_cache.trim_prompt_cache(caches, 7) == 7
        assert mlx_cache.trim_prompt_cache(caches, 4) == 3  # more than remain: everything
    recurrent = mlx_cache.ArraysCache(size=2)
    recurrent[0] = mx.zeros((5, 5))
    mixed = [recurrent, KVCache()]
    feed(mixed[1:], [10])
    assert not mlx_cache.can_trim_prompt_cache(mixed) and mlx_cache.trim_prompt_cache(mixed, 1) == 0
    rotating = [RotatingKVCache(max_size=6), RotatingKVCache(max_size=6)]
    feed(rotating, [5])
    assert mlx_cache.trim_prompt_cache(rotating, 4) == 4


def test_full_rotating_window_trims_exactly_where_mlx_lm_refuses():
    """Deliberate difference: past its window mlx-lm's RotatingKVCache is not trimmable; ours trims exactly up
    to ``max_rewind + 1`` tokens (it then returns what a cache that never saw them returns) and raises beyond."""
    theirs = mlx_cache.RotatingKVCache(max_size=6)
    cache, replay = RotatingKVCache(6, max_rewind=4, step=4), RotatingKVCache(6, max_rewind=4, step=4)
    feed([theirs], [20])
    feed([cache], [12, 1, 1, 1, 1, 1, 1, 1, 1])
    feed([replay], [12, 1, 1, 1, 1])
    assert not mlx_cache.can_trim_prompt_cache([theirs]) and mlx_cache.trim_prompt_cache([theirs], 4) == 0
    assert mlx_cache.can_trim_prompt_cache([cache]) and mlx_cache.trim_prompt_cache([cache], 4) == 4
    assert cache.offset == replay.offset
    for seed, n in enumerate([1, 1, 3, 1]):
        assert_equal_trees(feed([cache], [n], seed=7 + seed), feed([replay], [n], seed=7 + seed))
    with pytest.raises(RewindError):
        cache.trim(cache.rewindable() + 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepcopy_is_independent(layout):
    a, b = LAYOUTS[layout](), LAYOUTS[layout]()
    feed([a, b], [9, 1, 1])
    c = copy.deepcopy(a)
    feed([a], [3, 1], seed=5)  # the original moves on; the copy must not
    assert_equal_trees(c.state, b.state)
    assert_equal_trees(feed([c], [1], seed=6), feed([b], [1], seed=6))


# -- batching: merge / extract ------------------------------------------------------------------------------

def test_kv_merge_matches_mlx_lm_and_extracts_ours():
    lengths = [5, 0, 12]
    a = [KVCache() for _ in lengths]
    b = [mlx_cache.KVCache() for _ in lengths]
    for i, n in enumerate(lengths):
        feed([a[i], b[i]], [n] if n else [], seed=i)
    batch, ref = KVCache.merge(a), mlx_cache.KVCache.merge(b)
    assert isinstance(batch, BatchKVCache) and isinstance(batch, mlx_cache.BatchKVCache)
    assert_equal_trees(batch.state, ref.state)
    k = mx.random.normal((3, 2, 1, D), key=mx.random.key(3))  # (B, n_kv, 1, D)
    assert_equal_trees(batch.update_and_fetch(k, -k), ref.update_and_fetch(k, -k))
    for i, c in enumerate(a):
        got = batch.extract(i)
        assert type(got) is KVCache and got.offset == c.offset + 1
        c.update_and_fetch(k[i: i + 1], -k[i: i + 1])
        assert_equal_trees(got.state, c.state)


@pytest.mark.parametrize("keep,history", [(0, [3]), (0, [20, 1, 1, 1]), (0, [3] + [1] * 12), (2, [12, 1, 1]),
                                          (2, [20]), (2, [3] + [1] * 12)])
def test_rotating_merge_matches_mlx_lm_and_extracts_ours(keep, history):
    """The batch holds mlx-lm's rows (with sinks: right after a multi-token update the last max_size tokens,
    else sinks and window); extract gives our layout back with the same window."""
    a = [RotatingKVCache(8, keep=keep), RotatingKVCache(8, keep=keep)]
    b = [mlx_cache.RotatingKVCache(8, keep=keep), mlx_cache.RotatingKVCache(8, keep=keep)]
    feed([a[0], b[0]], history)
    feed([a[1], b[1]], [5], seed=1)
    ref = mlx_cache.RotatingKVCache.merge(b)
    for batch in (RotatingKVCache.merge(a), mlx_cache.BatchRotatingKVCache.merge(a)):  # ours, and mlx-lm's on ours
        assert isinstance(batch, mlx_cache.BatchRotatingKVCache)
        assert_equal_trees(batch.state, ref.state)
    batch = RotatingKVCache.merge(a)
    assert isinstance(batch, BatchRotatingKVCache)
    k = mx.random.normal((2, 2, 1, D), key=mx.random.key(4))  # (B, n_kv, 1, D)
    batch.update_and_fetch(k, -k)
    ref.update_and_fetch(k, -k)
    for i in range(2):
        got, want = batch.extract(i), ref.extract(i)
        assert type(got) is RotatingKVCache and got.offset == want.offset
        assert_equal_trees(got.state[:2], want.state[:2])  # the window, in temporal order


def test_merging_a_ring_trimmed_to_its_limit():
    """After a trim to the rewind limit the oldest window row is gone: the batch gets one row fewer (left
    padding masks the gap) instead of the overwritten row."""
    cache = RotatingKVCache(8, max_rewind=3, step=4)
    feed([cache], [12, 1, 1, 1, 1, "max"])
    assert cache.size() == 7 and cache.rewindable() == 0
    batch = RotatingKVCache.merge([cache, RotatingKVCache(8)])
    assert batch.keys.shape[2] == 7 and batch.left_padding.tolist() == [0, 7]
    k = cache.state[0]  # (1, n_kv, rows, D): every intact token, in temporal order
    assert mx.array_equal(batch.keys[:1], k[..., -7:, :]).item()


def test_cache_list_merge_and_extract():
    """mlx-lm's test_cache_list, with our KVCache inside."""
    lists = []
    for n in (5, 7):
        lst = mlx_cache.CacheList(mlx_cache.ArraysCache(size=1), KVCache())
        lst[0][0] = mx.random.normal((1, 2, 4, 4), key=mx.random.key(n))
        feed([lst[1]], [n], seed=n)
        lists.append(lst)
    assert mlx_cache.CacheList(KVCache(), KVCache()).is_trimmable()
    merged = mlx_cache.CacheList.merge(lists)
    for i, lst in enumerate(lists):
        got = merged.extract(i)
        assert mx.array_equal(got[0][0], lst[0][0]).item() and type(got[1]) is KVCache
        assert_equal_trees(got[1].state, lst[1].state)


def test_quantized_twins_answer_hasattr_like_mlx_lm():
    """mlx-lm decides with hasattr: generate quantizes caches with ``to_quantized``, the server batches caches
    with ``merge``; its QuantizedKVCache has neither, and neither have ours."""
    for c in (QuantizedKVCache(), QuantizedRotatingKVCache(8), QuantizedChunkedKVCache(8)):
        assert not hasattr(c, "to_quantized") and not hasattr(c, "merge") and hasattr(c, "bits")
    q = QuantizedKVCache(32, 4)  # mlx-lm's positional order: group_size, bits
    assert (q.group_size, q.bits) == (32, 4)
    assert not hasattr(mlx_cache.QuantizedKVCache(), "to_quantized")
    assert all(hasattr(c, "merge") for c in (KVCache(), RotatingKVCache(8)))
    assert all(hasattr(c, "to_quantized") and not hasattr(c, "bits")
               for c in (KVCache(), RotatingKVCache(8), ChunkedKVCache(8)))


@pytest.fixture(scope="module")
def llama32():
    """The test llama with head_dim 32 (quantizable in groups of 32), mlxkv's attention hook installed."""
    config = get_config("llama")
    config["hidden_size"] = 128
    model, _ = build_from_config(config)
    install_attention_hook(model)
    return model


PROMPTS = [[(i * 37 + 11 * j) % 1000 + 3 for i in range(n)] for j, n in enumerate((9, 23, 4))]


@pytest.mark.parametrize("max_kv_size", [None, 12])
def test_batch_generate_with_our_prompt_caches(llama32, max_kv_size):
    """mlx-lm's batch_generate merges our prompt caches, decodes, and hands our layouts back: same tokens as
    with mlx-lm's caches. (Prompts go past the window one token at a time: a longer multi-token update with
    sinks is where mlx-lm's masks deliberately differ.)"""
    tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")

    def run(make):
        caches = []
        for p in PROMPTS:
            c = make()
            llama32(mx.array([p[:8]]), cache=c)
            for t in p[8:-1]:
                llama32(mx.array([[t]]), cache=c)
            caches.append(c)
        return batch_generate(llama32, tokenizer, [p[-1:] for p in PROMPTS], prompt_caches=caches, max_tokens=6,
                              return_prompt_caches=True, return_token_ids=True)

    def theirs():  # what mlx-lm's make_prompt_cache builds for max_kv_size (llama's make_cache ignores it)
        if max_kv_size is None:
            return mlx_cache.make_prompt_cache(llama32)
        return [mlx_cache.RotatingKVCache(max_size=max_kv_size, keep=4) for _ in llama32.layers]

    got = run(lambda: make_caches(llama32, max_kv_size=max_kv_size))
    want = run(theirs)
    assert got.token_ids == want.token_ids and len(set(sum(got.token_ids, []))) > 1
    layout = KVCache if max_kv_size is None else RotatingKVCache
    assert all(type(c) is layout for caches in got.caches for c in caches)
    for mine, theirs in zip(got.caches, want.caches):
        for x, y in zip(mine, theirs):
            assert x.offset == y.offset
            assert mx.allclose(x.state[0], y.state[0][..., -x.state[0].shape[2]:, :], atol=1e-5).item()


# -- generation through mlx-lm, to_quantized -----------------------------------------------------------------

def greedy(model, prompt, caches, n, **kw):
    """``n`` (token, logits) pairs of mlx-lm's generate_step; the caches then hold the prompt and the first
    ``n - 1`` tokens plus the last one (generate_step feeds each token before yielding it)."""
    steps = zip(range(n), generate_step(mx.array(prompt), model, prompt_cache=caches, **kw))
    return [(tok, logits) for _, (tok, logits) in steps]


def test_generate_step_and_trim_with_our_caches(llama32):
    """mlx-lm's generate_step on make_caches gives mlx-lm's tokens and logits, also when resumed; after a
    trim_prompt_cache of the resumed tokens the same continuation comes again."""
    prompt = PROMPTS[1]
    want = greedy(llama32, prompt, mlx_cache.make_prompt_cache(llama32), 5)
    caches = make_caches(llama32)
    got = greedy(llama32, prompt, caches, 3)  # the caches hold the prompt and tokens 0..2
    resumed = greedy(llama32, [want[3][0]], caches, 2)  # feeds tokens 3, 4, 5; yields tokens 4, 5
    got.append(resumed[0])
    assert [t for t, _ in got] == [t for t, _ in want[:3] + want[4:]]
    assert all(mx.allclose(a, b, atol=1e-5).item() for (_, a), (_, b) in zip(got, want[:3] + want[4:]))
    assert mlx_cache.can_trim_prompt_cache(caches) and mlx_cache.trim_prompt_cache(caches, 3) == 3
    again = greedy(llama32, [want[3][0]], caches, 2)
    assert [t for t, _ in again] == [t for t, _ in resumed]
    assert all(mx.allclose(a, b, atol=1e-5).item() for (_, a), (_, b) in zip(again, resumed))


def test_to_quantized_continues_close_to_mlx_lm(llama32):
    """Generate, convert with to_quantized(32, 8), decode on (fed the dense run's tokens): our quantized twin
    gives mlx-lm's quantized logits, both close to the dense ones (8 bits on this sharp random model: within 2%
    of the logit range; mlx-lm's own test asks 4% relative on a trained model)."""
    prompt = PROMPTS[1]
    tokens = [t for t, _ in greedy(llama32, prompt, mlx_cache.make_prompt_cache(llama32), 3)]
    dense_caches = mlx_cache.make_prompt_cache(llama32)
    greedy(llama32, prompt, dense_caches, 2)  # the caches hold the prompt and tokens 0, 1
    runs, kinds = [], []
    for caches in (make_caches(llama32), mlx_cache.make_prompt_cache(llama32)):
        greedy(llama32, prompt, caches, 2)
        caches[:] = [c.to_quantized(group_size=32, bits=8) for c in caches]
        kinds.append({(type(c).__module__.split(".")[0], type(c).__name__, c.offset, c.bits) for c in caches})
        runs.append(caches)
    assert kinds == [{("mlxkv", "QuantizedKVCache", len(prompt) + 2, 8)},
                     {("mlx_lm", "QuantizedKVCache", len(prompt) + 2, 8)}]
    token = mx.array([[tokens[2]]])
    for _ in range(4):
        mine, theirs, ref = (llama32(token, cache=c)[0, -1] for c in (*runs, dense_caches))  # (vocab,)
        assert mx.allclose(mine, theirs, atol=1e-5).item()
        assert (mx.abs(mine - ref).max() / (ref.max() - ref.min())).item() < 0.02
        token = mx.argmax(ref).reshape(1, 1)


def test_generate_kv_bits_quantizes_our_caches(llama32):
    """mlx-lm's generate_step with kv_bits calls to_quantized on every cache that has it."""
    caches = make_caches(llama32)
    greedy(llama32, PROMPTS[0], caches, 3, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    assert all(type(c) is QuantizedKVCache and c.group_size == 32 for c in caches)


@pytest.mark.parametrize("layout", ["standard", "rotating-ring-wraps", "rotating-sinks-ring-wraps", "chunked"])
def test_to_quantized_keeps_every_layout_position(layout):
    """Every layout has a twin: same offset, window and rewind bookkeeping, rows quantized one by one (mlx-lm's
    RotatingKVCache raises NotImplementedError here; its ChunkedKVCache has no to_quantized)."""
    dense = LAYOUTS[layout]()
    feed([dense], [9, 1, 1, 1, 1, 3, 1, 1])
    twin = dense.to_quantized(group_size=32, bits=4)
    assert isinstance(twin, type(dense)) and twin.bits == 4 and twin.group_size == 32
    assert (twin.offset, twin.size(), twin.rewindable()) == (dense.offset, dense.size(), dense.rewindable())
    for i, n in enumerate([1, 1, 4, -2, 1]):
        fetched = feed([dense, twin], [n], seed=50 + i)
        if n < 0:
            continue
        (kd, _), (kq, _) = fetched
        deq = mx.dequantize(*kq, group_size=32, bits=4)  # (B, n_kv, K, D)
        exact = mx.dequantize(*mx.quantize(kd, group_size=32, bits=4), group_size=32, bits=4)
        assert deq.shape == kd.shape and mx.array_equal(deq, exact).item()
