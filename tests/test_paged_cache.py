"""Paged layer caches vs the dense layouts: equal logits (float32 <= 1e-5) and greedy tokens for every test
architecture, with decode attention running through paged_attention on the page arrays."""

import mlx.core as mx
import pytest
from testkit.archs import ARCHITECTURES, build_model

import mlxkv.kv.paged.sequence_attention as layer_cache_module
from mlxkv.config import KvCacheConfig
from mlxkv.kv.layouts import install_attention_hook, make_caches
from mlxkv.kv.paged import PagedLayerCache, PagedPoolExhausted
from mlxkv.kv.store import CachePool, CacheRequest

pytestmark = pytest.mark.float_order

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]  # past gemma3's window 8, across llama4's 16-token chunks
DECODE_STEPS = 40
# Logit error bound, relative to the logits' scale: the reference kernel's split-K online softmax rounds
# differently from one-pass SDPA (~1e-6 on the attention output, kernels/layout.py), and these GAIN=2 random
# models amplify that to ~1e-5 on logits of magnitude ~10 (measured max 1.9e-5 absolute, gemma3_text).
# The storage itself is exact: with the gather oracle in place of the kernel, logits are bit-equal
# (test_pages_hold_exactly_the_dense_rows).
TOL = 1e-5


def close(paged, dense):
    return mx.abs(paged - dense).max().item() <= TOL * max(1.0, mx.abs(dense).max().item())


def paged_pool(model, block_size=4, num_blocks=160, **kw):
    return CachePool(model, backend="paged", num_blocks=num_blocks,
                     kv_config=KvCacheConfig(backend="paged", block_size=block_size, **kw))


def run_chunks(model, caches, tokens, chunk):
    """Prefill ``tokens`` in forwards of ``chunk`` tokens; the last forward's last logits (vocab,)."""
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[i:i + chunk], dtype=mx.uint32)[None], cache=caches)
        mx.eval(logits)
    return logits[0, -1]


@pytest.fixture
def count_paged_calls(monkeypatch):
    calls = []
    real = layer_cache_module.paged_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("window") or kwargs.get("chunk_size") or "full")
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_cache_module, "paged_attention", counting)
    return calls


@pytest.mark.parametrize("path", ["kernel", "views"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_paged_logits_equal_dense_over_prefill_and_decode(arch, path, count_paged_calls, monkeypatch):
    # "kernel": every decode step through paged_attention. "views": the CPU default — a fresh pool hands the
    # sequence consecutive blocks, so decode runs dense SDPA on zero-copy views of the pages.
    monkeypatch.setattr(layer_cache_module, "reference_on_views", lambda: path == "views")
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    dense = make_caches(model)
    assert seq.num_cached == 0
    lp = run_chunks(model, seq.caches, PROMPT, 13)  # uneven chunks: writes straddle blocks, windows, chunks
    ld = run_chunks(model, dense, PROMPT, 13)
    seq.commit()
    assert close(lp, ld), mx.abs(lp - ld).max().item()
    paged_tokens, dense_tokens = [], []
    for _ in range(DECODE_STEPS):
        tp, td = int(mx.argmax(lp).item()), int(mx.argmax(ld).item())
        paged_tokens.append(tp)
        dense_tokens.append(td)
        seq.feed([td])  # both sides read the dense greedy token so logits stay comparable step by step
        lp = model(mx.array([[td]], dtype=mx.uint32), cache=seq.caches)[0, -1]
        ld = model(mx.array([[td]], dtype=mx.uint32), cache=dense)[0, -1]
        mx.eval(lp, ld)
        seq.commit()
        assert close(lp, ld), mx.abs(lp - ld).max().item()
    assert paged_tokens == dense_tokens and len(set(dense_tokens)) > 1
    paged_layers = sum(isinstance(c, PagedLayerCache) for c in seq.caches)
    single_group = len(pool.paged.manager.specs) == 1  # hybrid models interleave their groups' blocks
    if arch == "deepseek_v3" or (path == "views" and single_group):  # MLA hands attention the latent
        assert count_paged_calls == []
    elif path == "kernel":
        assert len(count_paged_calls) == paged_layers * DECODE_STEPS
    if arch == "gemma3_text" and path == "kernel":
        assert 8 in count_paged_calls  # the sliding layer ran the kernel with its window
    if arch == "llama4" and path == "kernel":
        assert 16 in count_paged_calls  # chunked layers ran the kernel with their chunk size
    pool.check_invariants()
    pool.release(seq.id)
    pool.check_invariants()
    assert pool.paged.manager.pool.num_free_blocks == pool.paged.num_blocks - 1  # every block back


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_windowed_groups_release_blocks_leaving_the_window(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    run_chunks(model, seq.caches, PROMPT, 64)
    seq.commit()
    tok = 5
    for _ in range(20):
        seq.feed([tok])
        mx.eval(model(mx.array([[tok]], dtype=mx.uint32), cache=seq.caches))
        seq.commit()
    tables = pool.paged.manager.block_tables(seq.paged.seq_id)
    specs = pool.paged.specs
    n = len(PROMPT) + 20
    for spec, table in zip(specs, tables):
        held = sum(b != 0 for b in table)
        if spec.kind == "full":
            assert held == -(-n // 4)
        else:  # only the blocks the window / current chunk still needs are held
            assert held == len(spec.needed_blocks(n, 4)) < len(table)
    for c in seq.caches:
        if isinstance(c, PagedLayerCache):
            assert c.nbytes == seq.paged.blocks_held(c.group) * pool.paged.layer_block_bytes[c.layer]
    assert pool.memory_usage_bytes() == sum(c.nbytes for c in seq.caches if isinstance(c, PagedLayerCache))
    pool.check_invariants()
    pool.release(seq.id)
    pool.check_invariants()
    assert pool.paged.manager.pool.num_free_blocks == pool.paged.num_blocks - 1


def test_decode_without_feed_is_refused_and_exhaustion_is_reported():
    model, _ = build_model("llama")
    pool = paged_pool(model, num_blocks=8)  # 7 usable blocks x 4 tokens
    seq = pool.open(prompt=PROMPT[:20])
    run_chunks(model, seq.caches, PROMPT[:20], 20)
    seq.commit()
    with pytest.raises(RuntimeError, match="feed"):
        model(mx.array([[5]], dtype=mx.uint32), cache=seq.caches)
    pool.release(seq.id)
    seq = pool.open(prompt=PROMPT[:40], cache_request=CacheRequest(salt="no-hit"))  # 10 blocks needed, 7 exist
    with pytest.raises(PagedPoolExhausted):
        model(mx.array([PROMPT[:40]], dtype=mx.uint32), cache=seq.caches)
    pool.release(seq.id)
    pool.check_invariants()
    assert pool.paged.manager.pool.num_free_blocks == 7


def test_paged_options_are_validated():
    model, _ = build_model("llama")
    with pytest.raises(ValueError, match="backend"):
        CachePool(model, backend="nope")
    with pytest.raises(ValueError, match="head_dim 16 is not divisible by the KV quantization group size 64"):
        paged_pool(model, kv_bits=4)  # quantized pages need a group size dividing head_dim
    with pytest.raises(ValueError, match="prompt"):
        paged_pool(model).open()


@pytest.mark.parametrize("arch", ["llama", "llama4", "qwen3_next"])
def test_pages_hold_exactly_the_dense_rows(arch, monkeypatch):
    """With gather-then-SDPA (the kernels' oracle) in place of the kernel, paged logits equal dense bit for bit:
    every row landed in its slot and block tables/windows/chunks select exactly the dense rows. (Rotating
    layers are left out: the dense ring returns its window in mlx-lm's ring order, so sums round differently.)"""
    from testkit.kernel_oracle import dense_paged_attention

    def oracle(q, k, v, bt, cl, *, scale=None, window=None, chunk_size=None, sinks=None, **_):
        return dense_paged_attention(q, k, v, bt, cl, scale=scale, window=window, chunk_size=chunk_size, sinks=sinks)

    monkeypatch.setattr(layer_cache_module, "paged_attention", oracle)
    monkeypatch.setattr(layer_cache_module, "reference_on_views", lambda: False)  # every decode step: the oracle
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    dense = make_caches(model)
    lp, ld = run_chunks(model, seq.caches, PROMPT, 7), run_chunks(model, dense, PROMPT, 7)
    seq.commit()
    assert mx.array_equal(lp, ld).item()
    for step in range(25):
        tok = int(mx.argmax(ld).item())
        seq.feed([tok])
        lp = model(mx.array([[tok]], dtype=mx.uint32), cache=seq.caches)[0, -1]
        ld = model(mx.array([[tok]], dtype=mx.uint32), cache=dense)[0, -1]
        seq.commit()
        assert mx.array_equal(lp, ld).item(), step
    pool.release(seq.id)
    pool.check_invariants()


def test_decode_writes_in_place_and_gathers_nothing():
    """A decode step allocates far less than one page array: kv_write donates the sole-owned pages (no pool
    copy) and the lazily fetched K/V, unused by the paged kernel, is never materialised."""
    model, _ = build_model("llama")
    install_attention_hook(model)
    pool = paged_pool(model, block_size=16, num_blocks=4096, preallocate=True)  # 8 MiB per page array
    seq = pool.open(prompt=PROMPT)
    run_chunks(model, seq.caches, PROMPT, 64)
    seq.commit()
    page_bytes = pool.paged.storage.k_rows[0].nbytes
    for tok in (5, 6, 7, 8):
        seq.feed([tok])
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(model(mx.array([[tok]], dtype=mx.uint32), cache=seq.caches))
        seq.commit()
        assert mx.get_peak_memory() - base < page_bytes // 100
    pool.release(seq.id)
    pool.check_invariants()


@pytest.mark.parametrize("block_size", [1, 32])
@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_blocks_smaller_and_larger_than_window_or_chunk(arch, block_size):
    """Block size 1 and 32 around gemma3's window 8 and llama4's chunk 16: still equal to dense, and a rerun
    hits the prefix cache with equal logits."""
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = paged_pool(model, block_size=block_size, num_blocks=400)
    seq = pool.open(prompt=PROMPT)
    dense = make_caches(model)
    lp, ld = run_chunks(model, seq.caches, PROMPT, 13), run_chunks(model, dense, PROMPT, 13)
    seq.commit()
    assert close(lp, ld)
    for _ in range(20):
        tok = int(mx.argmax(ld).item())
        seq.feed([tok])
        lp = model(mx.array([[tok]], dtype=mx.uint32), cache=seq.caches)[0, -1]
        ld = model(mx.array([[tok]], dtype=mx.uint32), cache=dense)[0, -1]
        seq.commit()
        assert close(lp, ld)
    pool.release(seq.id)
    again = pool.open(prompt=PROMPT)
    assert again.num_cached >= 32
    logits = model(mx.array(PROMPT[again.num_cached:], dtype=mx.uint32)[None], cache=again.caches)[0, -1]
    assert close(logits, model(mx.array(PROMPT, dtype=mx.uint32)[None], cache=make_caches(model))[0, -1])
    pool.check_invariants()
    pool.release(again.id)
    pool.check_invariants()
    assert pool.paged.manager.pool.num_free_blocks == pool.paged.num_blocks - 1
