"""Consecutive pages as zero-copy dense views: detection, no copy, and the kernel where pages are scattered."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.kv.paged import sequence_attention as layer_cache_module
from mlxkv.kv.paged.page_arrays import MAX_CONCAT_RUNS, PagedStorage, is_view, page_runs


@pytest.mark.parametrize("ids, want", [([3, 4, 5], 3), ([7], 7), ([3, 5, 4], None), ([3, 4, 6], None),
                                       ([0, 1, 2], None), ([], None), ([5, 4], None)])
def test_consecutive(ids, want):
    """Consecutive real pages are one run readable as a view, starting at ``want`` (None: not a view)."""
    runs = page_runs(ids)
    assert (runs[0][0] if is_view(runs) else None) == want


def filled_storage(num_blocks=64, bs=16, heads=2, dim=32, seed=0):
    storage = PagedStorage(num_blocks, bs, num_layers=1)
    rows = num_blocks * bs
    k = mx.random.normal((rows, heads, dim), key=mx.random.key(seed))  # (slots, H, D)
    v = mx.random.normal((rows, heads, dim), key=mx.random.key(seed + 1))
    storage.write(0, mx.arange(rows, dtype=mx.int32), k, v)
    mx.eval(storage.arrays())
    return storage, k, v


@pytest.mark.parametrize(("ids", "limit", "want"), [
    ([4, 5, 6, 9, 10, 2], 8, [(4, 3), (9, 2), (2, 1)]),
    ([4, 5, 6, 9, 10, 2], 2, None),
    ([7], 1, [(7, 1)]),
])
def test_page_runs(ids, limit, want):
    assert page_runs(ids, limit) == want


def test_gather_matches_the_written_rows_for_consecutive_and_scattered_pages():
    storage, k, v = filled_storage()
    scattered = [9, 2, 30, 4, 17, 11, 25, 6, 13, 21]  # 10 runs: past MAX_CONCAT_RUNS, indexed page by page
    assert len(scattered) > MAX_CONCAT_RUNS
    for ids in ([5, 6, 7, 8], [9, 2, 3, 30, 31, 4], scattered):  # one view / runs concatenated / mx.take
        got_k, got_v = storage.gather(0, ids, 3, 50)  # rows 3 .. 52 of the concatenated pages
        slots = mx.array([b * 16 + r for b in ids for r in range(16)][3:53])
        assert got_k.shape == (1, 2, 50, 32)
        assert mx.array_equal(got_k[0], k[slots].transpose(1, 0, 2)).item()
        assert mx.array_equal(got_v[0], v[slots].transpose(1, 0, 2)).item()


def test_consecutive_pages_are_read_without_a_copy():
    storage, _, _ = filled_storage(num_blocks=2048)  # 2 x 8 MB page arrays
    ids = list(range(100, 1100))  # 16,000 rows: 4 MB of K and 4 MB of V if copied
    mx.eval(storage.arrays())
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    k, v = storage.gather(0, ids, 0, len(ids) * 16)
    out = (k.sum(), v.sum())  # reads every row
    mx.eval(out)
    assert mx.get_peak_memory() - base < 1 << 20  # no 4 MB temporary
    scattered = ids[::-1]
    mx.reset_peak_memory()
    k, v = storage.gather(0, scattered, 0, len(ids) * 16)
    mx.eval(k.sum(), v.sum())
    assert mx.get_peak_memory() - base >= 4 << 20  # the gather does copy (the check above can fail)


def test_scattered_pages_decode_through_page_runs_then_the_kernel(monkeypatch):
    """Two sequences growing in turn take alternate blocks: while a table is one run of consecutive pages (a view)
    or at most MAX_VIEW_RUNS runs a decode step attends to each run in place (runs_attention); past that, through
    the kernel. Logits stay equal to a dense cache's."""
    from testkit.archs import build_model

    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.layouts import make_caches
    from mlxkv.kv.layouts.attention_hook import install_attention_hook
    from mlxkv.kv.store import CachePool

    kernel, runs = [], []
    real_kernel, real_runs = layer_cache_module.paged_attention, layer_cache_module.runs_attention
    monkeypatch.setattr(layer_cache_module, "reference_on_views", lambda: True)
    monkeypatch.setattr(layer_cache_module, "paged_attention", lambda *a, **kw: kernel.append(1) or real_kernel(*a, **kw))
    monkeypatch.setattr(layer_cache_module, "runs_attention",
                        lambda *a, **kw: runs.append(len(a[3])) or real_runs(*a, **kw))
    model, _ = build_model("llama")
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=64,
                     kv_config=KvCacheConfig(backend="paged", block_size=4, enable_block_reuse=False))
    a, b = pool.open(prompt=[1, 2, 3]), pool.open(prompt=[4, 5, 6])
    dense = make_caches(model)
    for seq, prompt in ((a, [1, 2, 3]), (b, [4, 5, 6])):
        mx.eval(model(mx.array([prompt], dtype=mx.uint32), cache=seq.caches))
        seq.commit()
    model(mx.array([[1, 2, 3]], dtype=mx.uint32), cache=dense)
    for t in range(24):
        for seq in (a, b):
            seq.feed([7 + t])
            logits = model(mx.array([[7 + t]], dtype=mx.uint32), cache=seq.caches)[0, -1]
            seq.commit()
            if seq is a:
                expected = model(mx.array([[7 + t]], dtype=mx.uint32), cache=dense)[0, -1]
                assert mx.abs(logits - expected).max().item() <= 1e-5 * max(1.0, mx.abs(expected).max().item())
    assert not is_view(page_runs(a.paged.step.host_table(0)))
    assert set(runs) == set(range(1, layer_cache_module.MAX_VIEW_RUNS + 1)) and kernel
    for seq in (a, b):
        pool.release(seq.id)
    pool.check_invariants()


def test_prefill_after_a_prefix_hit_attends_page_runs_in_place(monkeypatch):
    """A prompt whose first blocks are a prefix-cache hit prefills its suffix into new blocks away from the
    cached ones: the chunk attends to the runs in place (runs_attention, causal) and its logits and the next
    decode step equal a dense cache's over the whole prompt."""
    from testkit.archs import build_model

    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.layouts import make_caches
    from mlxkv.kv.layouts.attention_hook import install_attention_hook
    from mlxkv.kv.store import CachePool

    runs = []
    real_runs = layer_cache_module.runs_attention
    monkeypatch.setattr(layer_cache_module, "reference_on_views", lambda: True)
    monkeypatch.setattr(layer_cache_module, "runs_attention",
                        lambda *a, **kw: runs.append((a[0].shape[2], len(a[3]))) or real_runs(*a, **kw))
    model, _ = build_model("llama")
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=64, kv_config=KvCacheConfig(backend="paged", block_size=4))
    shared = list(range(1, 14))  # 3 whole blocks + 1 token
    first = pool.open(prompt=shared + [20, 21])
    mx.eval(model(mx.array([shared + [20, 21]], dtype=mx.uint32), cache=first.caches))
    first.commit()
    prompt = shared + [30, 31, 32, 33, 34, 35]
    seq = pool.open(prompt=prompt)
    assert seq.num_cached == 12  # the 3 whole shared blocks
    got = model(mx.array([prompt[12:]], dtype=mx.uint32), cache=seq.caches)[0]  # (7, vocab)
    seq.commit()
    assert not is_view(page_runs(seq.paged.step.host_table(0)))  # its own blocks come after `first`'s
    assert runs and all(n_q == 7 and n_runs >= 2 for n_q, n_runs in runs)
    dense = make_caches(model)
    expected = model(mx.array([prompt], dtype=mx.uint32), cache=dense)[0, 12:]  # (7, vocab)
    assert mx.abs(got - expected).max().item() <= 1e-5 * max(1.0, mx.abs(expected).max().item())
    seq.feed([40])
    got = model(mx.array([[40]], dtype=mx.uint32), cache=seq.caches)[0, -1]
    expected = model(mx.array([[40]], dtype=mx.uint32), cache=dense)[0, -1]
    assert mx.abs(got - expected).max().item() <= 1e-5 * max(1.0, mx.abs(expected).max().item())
    for s in (first, seq):
        pool.release(s.id)
    pool.check_invariants()
