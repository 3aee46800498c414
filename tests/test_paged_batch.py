"""Batched paged decode: B sequences of different lengths, one paged_attention call per layer, logits equal
to each sequence decoded alone over dense caches."""

import mlx.core as mx
import pytest
from testkit.archs import build_model

import mlxkv.kv.batching.attention_backends as paged_batch_module
from mlxkv.config import KvCacheConfig
from mlxkv.kv.batching import check_attended, make_batch_views
from mlxkv.kv.batching.paged_views import PagedBatchView
from mlxkv.kv.layouts import install_attention_hook, make_caches
from mlxkv.kv.store import CachePool

pytestmark = pytest.mark.float_order

PROMPTS = [[(7 * i + 3 * k) % 900 + 10 for i in range(n)] for k, n in enumerate((45, 21, 33))]
STEPS = 12


def scale_close(a, b, tol=1e-5):
    return mx.abs(a - b).max().item() <= tol * max(1.0, mx.abs(b).max().item())


def prefill(model, pool, prompts):
    """Open and prefill each prompt in the paged pool (after the previous one committed, so later prompts take its
    cached prefix) and over dense caches; returns the sequences, the dense caches and the first greedy tokens."""
    seqs, dense, tokens = [], [], []
    for p in prompts:
        seq = pool.open(prompt=p)
        seqs.append(seq)
        model(mx.array(p[seq.num_cached:])[None], cache=seq.caches)
        seq.commit()
        dense.append(make_caches(model))
        tokens.append(int(mx.argmax(model(mx.array(p)[None], cache=dense[-1])[0, -1]).item()))
    return seqs, dense, tokens


def decode_batched_vs_dense(model, seqs, dense, tokens, on_step=lambda views: None):
    """STEPS greedy steps: the paged sequences in one batched forward (``on_step`` sees its views), each dense
    cache alone; every row's logits must match. Returns the last step's views."""
    for _ in range(STEPS):
        for seq, t in zip(seqs, tokens):
            seq.feed([t])
        views = make_batch_views([s.caches for s in seqs])
        batched = model(mx.array(tokens)[:, None], cache=views)[:, -1]  # (B, vocab)
        on_step(views)
        for seq in seqs:
            seq.commit()
        singles = [model(mx.array([[t]]), cache=d)[0, -1] for t, d in zip(tokens, dense)]
        for b in range(len(seqs)):
            assert scale_close(batched[b], singles[b]), (b, mx.abs(batched[b] - singles[b]).max().item())
        tokens = [int(mx.argmax(x).item()) for x in singles]
    return views


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next", "deepseek_v3"])
def test_batched_paged_decode_equals_single_dense(arch, monkeypatch):
    calls = []
    real = paged_batch_module.paged_attention
    monkeypatch.setattr(paged_batch_module, "paged_attention",
                        lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=200,
                     kv_config=KvCacheConfig(backend="paged", block_size=4))
    seqs, dense, tokens = prefill(model, pool, PROMPTS)

    def check(views):
        assert any(isinstance(v, PagedBatchView) for v in views)
        check_attended(views)

    views = decode_batched_vs_dense(model, seqs, dense, tokens, on_step=check)
    n_paged_layers = sum(isinstance(v, PagedBatchView) for v in views)
    if arch == "deepseek_v3":
        assert calls == []  # MLA attends its own latent tensors: per-sequence dense attention
    else:
        assert len(calls) == n_paged_layers * STEPS and all(s[0] == len(seqs) for s in calls)  # one call, B rows
    pool.check_invariants()
    for seq in seqs:
        pool.release(seq.id)
    pool.check_invariants()
    assert pool.paged.manager.pool.num_free_blocks == pool.paged.num_blocks - 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_is_attended_once_as_a_view(arch, monkeypatch):
    """Sequences sharing a system prompt through the prefix cache decode in one batch: on the reference path the
    shared pages are attended once (shared_prefix_attention), and logits equal each sequence decoded alone over
    dense caches."""
    calls = []
    real = paged_batch_module.shared_prefix_attention
    monkeypatch.setattr(paged_batch_module, "shared_prefix_attention",
                        lambda *a, **k: calls.append([g.shared_pages for g in a[6]]) or real(*a, **k))
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=200,
                     kv_config=KvCacheConfig(backend="paged", block_size=4))
    system = [(5 * i) % 900 + 10 for i in range(30)]
    prompts = [system + [100 + k, 200 + k, 300 + k][: k + 1] for k in range(3)]
    seqs, dense, tokens = prefill(model, pool, prompts)  # the second and third hit the first one's system prompt
    assert all(s.num_cached >= 28 for s in seqs[1:])  # 7 whole blocks of the system prompt (or more: partial reuse)
    decode_batched_vs_dense(model, seqs, dense, tokens)
    assert len(calls) == STEPS * len(model.layers) and all(c == [7] for c in calls)
    for seq in seqs:
        pool.release(seq.id)
    pool.check_invariants()


def test_long_sequences_in_a_batch_attend_in_place_one_by_one(monkeypatch):
    """Past the gather-size threshold (lowered here), a batch of sequences whose pages lie in few runs attends
    sequence by sequence on views of the pages (runs_attention) instead of gathering; logits equal each
    sequence decoded alone over dense caches."""
    monkeypatch.setattr(paged_batch_module, "PER_SEQUENCE_VIEW_ELEMENTS", 0)
    calls = []
    real = paged_batch_module.runs_attention
    monkeypatch.setattr(paged_batch_module, "runs_attention", lambda *a, **k: calls.append(len(a[3])) or real(*a, **k))
    model, _ = build_model("llama")
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=200,
                     kv_config=KvCacheConfig(backend="paged", block_size=4, enable_block_reuse=False))
    seqs, dense, tokens = prefill(model, pool, PROMPTS)
    decode_batched_vs_dense(model, seqs, dense, tokens)
    assert len(calls) == STEPS * len(model.layers) * len(PROMPTS) and max(calls) >= 2  # growth interleaves blocks
    for seq in seqs:
        pool.release(seq.id)
    pool.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_batch_views_rows_are_each_caches_own_rows(arch):
    """What a batch view's update_and_fetch returns (one gather for all B; the kernel paths never compute it, a
    model that transforms it does) holds, in row b, exactly the rows sequence b's cache would return: every row
    for full attention, the window for sliding layers (a start inside a page: the shifted rows)."""
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=200, kv_config=KvCacheConfig(backend="paged", block_size=4))
    seqs, _, tokens = prefill(model, pool, PROMPTS)
    for seq, t in zip(seqs, tokens):
        seq.feed([t])
    views = make_batch_views([s.caches for s in seqs])
    model(mx.array(tokens)[:, None], cache=views)
    checked = 0
    for view in views:
        if not isinstance(view, PagedBatchView):
            continue
        keys, values = view.fetched.keys, view.fetched.values
        for b, (cache, (start, end)) in enumerate(zip(view.caches, view._fetched)):
            own_k, own_v = cache._fetch(start, end)  # (1, n_kv, end - start, D)
            assert mx.array_equal(keys[b : b + 1, :, : end - start], own_k).item()
            assert mx.array_equal(values[b : b + 1, :, : end - start], own_v).item()
            checked += 1
    shifted = [start % 4 for v in views if isinstance(v, PagedBatchView) for start, _ in v._fetched]
    assert checked and (arch == "llama" or any(shifted))  # sliding windows start inside a page somewhere
    for seq in seqs:
        pool.release(seq.id)
