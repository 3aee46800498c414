"""Quantized paged KV pages (``kv_bits`` on the paged backend): the same quantization as the dense quantized layouts,
so paged-quantized equals dense-quantized; prefix hits, fork, preemption and the secondary tier on quantized pages.

Tolerance: a row is quantized on its own along head_dim, deterministically, so the pages hold bit for bit the
planes a dense quantized cache holds (checked directly below), and both sides attend them with the same
``quantized_attend`` (``mx.quantized_matmul``). Full and chunked layers return the rows in the same order, so their
logits are equal; the dense sliding layout returns its ring in another order, which reorders float32 sums:
~1e-6 relative on the attention output, amplified by these random GAIN=2 models to ~1.5e-5 on logits of ~12
(measured), hence ``1e-5`` of the logit scale. The greedy tokens are the same.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import pytest
from testkit.archs import build_from_config, get_config

from mlxkv.config import KvCacheConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.prefill import prefill
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.layouts import install_attention_hook, make_caches
from mlxkv.kv.paged import PagedBackend
from mlxkv.kv.paged.quantized_pages import QuantizedPagedStorage
from mlxkv.kv.store import CachePool
from mlxkv.kv.tier import DiskStore, HostMemoryStore, SecondaryTier, fingerprint_model
from mlxkv.kv.tier.bridge import TierBridge

GROUP = 32
#: The tiny test models' head_dim is 16; quantization groups need >= 32 (as tests/test_cache_quantized.py).
WIDER = {"llama": {"hidden_size": 128}, "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 32},
         "llama4": {"head_dim": 32}}
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]  # past gemma3's window 8, across llama4's 16-token chunks
TOL = 1e-5


@cache
def model_for(arch: str):
    config = get_config(arch)
    config.get("text_config", config).update(WIDER[arch])
    model = build_from_config(config)[0]
    install_attention_hook(model)
    return model


def kv(bits: int | None = 8, block_size: int = 4, **kw) -> KvCacheConfig:
    return KvCacheConfig(backend="paged", block_size=block_size, kv_bits=bits, kv_group_size=GROUP, **kw)


def paged_pool(model, bits=8, num_blocks=160, max_sequences=4, **kw) -> CachePool:
    """A quantized paged pool of ``num_blocks`` blocks, preallocated (the kernels see the whole pool's geometry)."""
    kw.setdefault("preallocate", True)
    return CachePool(model, backend="paged", num_blocks=num_blocks, max_sequences=max_sequences, kv_config=kv(bits, **kw))


def close(a: mx.array, b: mx.array) -> bool:
    return mx.abs(a - b).max().item() <= TOL * max(1.0, mx.abs(b).max().item())


def step(model, caches, tokens) -> mx.array:
    out = model(mx.array(tokens, dtype=mx.uint32)[None], cache=caches)[0, -1]  # (vocab,)
    mx.eval(out)
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", sorted(WIDER))
def test_paged_quantized_equals_dense_quantized(arch, bits):
    model = model_for(arch)
    pool = paged_pool(model, bits)
    seq = pool.open(prompt=PROMPT)
    dense = make_caches(model, kv_bits=bits, kv_group_size=GROUP)
    for i in range(0, len(PROMPT), 13):  # uneven chunks: writes straddle blocks, windows and chunks
        lp, ld = step(model, seq.caches, PROMPT[i:i + 13]), step(model, dense, PROMPT[i:i + 13])
    seq.commit()
    assert close(lp, ld)
    paged_tokens, dense_tokens = [], []
    for _ in range(24):
        paged_tokens.append(int(mx.argmax(lp).item()))
        dense_tokens.append(token := int(mx.argmax(ld).item()))
        seq.feed([token])
        lp, ld = step(model, seq.caches, [token]), step(model, dense, [token])
        seq.commit()
        assert close(lp, ld), mx.abs(lp - ld).max().item()
    assert paged_tokens == dense_tokens and len(set(dense_tokens)) > 1
    if arch == "llama":  # every row in order on both sides: the stored planes are the dense cache's bit for bit
        for paged, dense_cache in zip(seq.caches, dense, strict=True):
            for got, want in zip(paged.state, dense_cache.state[:2], strict=True):
                assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
    pool.release(seq.id)
    pool.check_invariants()


def test_block_bytes_count_the_quantized_planes():
    """The budget's bytes per block are the pages' real bytes: 8-bit rows of head_dim 32 in groups of 32 take
    32 + 4 + 4 bytes (packed, float32 scale and bias) instead of 128; 4-bit 16 + 8."""
    model = model_for("llama")
    per_block = {bits: PagedBackend(model, kv(bits), num_blocks=8).bytes_per_block for bits in (None, 8, 4)}
    assert per_block[None] / per_block[8] == pytest.approx(128 / 40)
    assert per_block[None] / per_block[4] == pytest.approx(128 / 24)
    be = PagedBackend(model, kv(8, preallocate=True), num_blocks=8)
    caches, _ = be.open(PROMPT[:5])
    step(model, caches, PROMPT[:5])
    assert isinstance(be.storage, QuantizedPagedStorage)
    assert be.storage.nbytes() == 8 * be.bytes_per_block  # every layer written: the pool is exactly the budget's
    # a budget of N unquantized blocks holds 3.2x the blocks at 8 bits
    budget = 64 * per_block[None]
    sizes = {b: PagedBackend(model, kv(b, kv_cache_budget=budget)).num_blocks for b in (None, 8)}
    assert sizes[8] >= 3 * sizes[None]


def test_group_size_must_divide_head_dim():
    with pytest.raises(ValueError, match=r"^--kv-bits: the model's head_dim 32 .* group size 64; use --kv-group-size 32$"):
        PagedBackend(model_for("llama"), KvCacheConfig(backend="paged", kv_bits=8, kv_group_size=64), num_blocks=8)


def test_mla_models_refuse_quantized_pages():
    from testkit.archs import build_model

    with pytest.raises(ValueError, match="kv_bits is not supported for multi-head latent attention"):
        PagedBackend(build_model("deepseek_v3")[0], kv(8), num_blocks=8)


def dense_quantized_tokens(model, prompt, n, bits=8):
    pool = CachePool(model, kv_bits=bits, kv_group_size=GROUP)
    return list(DirectEngine(model, None, pool=pool).generate_tokens(prompt, SamplingParams(max_tokens=n)))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_prefix_hit_and_fork_on_quantized_pages(arch):
    """A rerun hits the cached quantized blocks; best-of-4 children share them, the partial tail block is copied
    (planes as stored) on a child's first write, and every child continues exactly as dense-quantized."""
    model = model_for(arch)
    expected = dense_quantized_tokens(model, PROMPT, 8)
    pool = paged_pool(model, 8, max_sequences=5)
    engine = DirectEngine(model, None, pool=pool)
    assert list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=8))) == expected
    parent = pool.open(prompt=PROMPT)
    assert parent.num_cached == 44  # every full block of the prompt but the last token's
    logits = prefill(model, parent.caches, mx.array(PROMPT[parent.num_cached:], dtype=mx.uint32))
    parent.commit()
    first = int(mx.argmax(logits).item())
    children = pool.fork(parent.id, 4)
    pool.release(parent.id)
    for child in children:
        tokens, y = [], first
        for _ in range(8):
            tokens.append(y)
            child.feed([y])
            y = int(mx.argmax(step(model, child.caches, [y])).item())
            child.commit()
        assert tokens == expected
    for child in children:
        pool.release(child.id)
    pool.check_invariants()


def test_batched_engine_with_preemption_equals_sequential():
    """Continuous batching over quantized pages (batched decode views, mx.quantized_matmul over the padded rows)
    with a pool too small for all: requests are preempted and resumed, and every one equals dense-quantized."""
    model = model_for("llama")
    prompts = [[(7 * i + 11 * j) % 900 + 10 for i in range(n)] for j, n in enumerate((3, 14, 29, 40))]
    expected = [dense_quantized_tokens(model, p, 12) for p in prompts]
    pool = paged_pool(model, 8, num_blocks=28, max_sequences=4)
    engine = BatchEngine(model, None, config=EngineConfig(max_sequences=4, prefill_chunk_size=8), pool=pool,
                         context_length=4096).start()
    try:
        handles = [engine.submit(GenerationRequest(p, SamplingParams(max_tokens=12))) for p in prompts]
        got = []
        for h in handles:
            events = list(h)
            assert events[-1].kind == "done", events[-1]
            got.append([e.token for e in events if e.kind == "token"])
        stats = engine.stats()
    finally:
        engine.stop()
    assert got == expected
    assert stats["batched_steps_total"] > 0 and stats["preemptions"] > 0
    assert stats["kv_blocks"]["kv_bits"] == 8 and stats["kv_blocks"]["kv_group_size"] == GROUP
    pool.check_invariants()


# ---- the secondary tier on quantized pages --------------------------------------------------------------------
OTHER = [(11 * i + 5) % 900 + 10 for i in range(44)]  # 11 blocks of 4: evicts all of a 12-block pool
TIER_PROMPT = PROMPT[:22]  # 5 full usable blocks


def tier_run(be, bridge, tokens):
    bridge.restore(tokens)
    caches, seq = be.open(tokens)
    cached = seq.num_cached
    logits = step(be.model, caches, tokens[cached:])
    seq.commit()
    be.release(seq)
    return logits, cached


def prefix_planes(be, tokens):
    ids = mx.array([b.block_id for b in be.manager.find_prefix_hit(tokens).blocks[0]], dtype=mx.int32)
    planes = [p[:, ids] for layer in range(len(be.storage.k_rows)) if be.storage.allocated(layer)
              for side in be.storage.planes(layer) for p in side]  # (kv_heads, n, bs, w) each
    mx.eval(planes)
    return planes


def same(got, expected) -> bool:
    return len(got) == len(expected) and all(a.dtype == b.dtype and mx.array_equal(a, b).item()
                                             for a, b in zip(got, expected))


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_tier_offloads_and_restores_quantized_planes_bit_for_bit(tmp_path, where):
    model = model_for("llama")
    reference, _ = tier_run(PagedBackend(model, kv(8), num_blocks=64), _no_tier(), TIER_PROMPT)
    be = PagedBackend(model, kv(8), num_blocks=12)
    disk = DiskStore(tmp_path, fingerprint_model(model), 1 << 20, block_size=4) if where == "disk" else None
    memory = HostMemoryStore(1 << 20) if where == "memory" else None
    bridge = TierBridge(be, SecondaryTier(35, memory=memory, disk=disk))
    tier_run(be, bridge, TIER_PROMPT)
    evicted = prefix_planes(be, TIER_PROMPT)
    tier_run(be, bridge, OTHER)
    assert be.manager.find_prefix_hit(TIER_PROMPT).num_full_blocks == 0
    # the tier holds the quantized form: a block's bytes are the quantized block's
    held = bridge.tier.stats()[where]
    assert held["blocks"] >= 5
    if where == "memory":  # (a disk file adds its header)
        assert held["bytes"] == held["blocks"] * be.bytes_per_block
    logits, cached = tier_run(be, bridge, TIER_PROMPT)
    assert cached == 20
    assert same(prefix_planes(be, TIER_PROMPT), evicted)
    assert int(mx.argmax(logits).item()) == int(mx.argmax(reference).item()) and close(logits, reference)
    be.check_invariants()


class _no_tier:
    def restore(self, tokens):
        return 0


def test_disk_tier_of_other_bits_is_never_loaded_and_a_restart_with_the_same_bits_is(tmp_path):
    """Cached quantized blocks written behind (the shutdown flush) come back after a restart, into fresh
    (unallocated) pages, bit for bit; a server started with other bits or unquantized pages finds the folder's files
    under another fingerprint and loads none."""
    model = model_for("llama")

    def backend(bits, group=GROUP):
        cfg = KvCacheConfig(backend="paged", block_size=4, kv_bits=bits, kv_group_size=group,
                            secondary_disk_dir=str(tmp_path), secondary_disk_bytes=1 << 20, hash_algo="sha256")
        return PagedBackend(model, cfg, num_blocks=12)

    be = backend(8)
    tier_run(be, be.tier, TIER_PROMPT)
    evicted = prefix_planes(be, TIER_PROMPT)
    assert be.tier.flush(timeout=30)["written"] >= 5  # write-behind: the cached blocks' quantized form on disk
    for bits in (None, 4):
        other = backend(bits)
        assert tier_run(other, other.tier, TIER_PROMPT)[1] == 0
    restarted = backend(8)
    _, cached = tier_run(restarted, restarted.tier, TIER_PROMPT)
    assert cached == 20
    assert same(prefix_planes(restarted, TIER_PROMPT), evicted)
    assert restarted.tier.tier.disk.fingerprint["digest"] != fingerprint_model(model)["digest"]


def test_batched_decode_attends_a_shared_prefix_once_on_quantized_pages(monkeypatch):
    """Three sequences sharing a system prompt through the prefix cache decode in one batch: the shared quantized
    pages are attended once (quantized_shared_prefix_attention, in place), and every row's logits equal that
    sequence decoded alone over a dense quantized cache (the same planes; float32 rounding of the merged softmax)."""
    from mlxkv.kv.batching import attention_backends as paged_views
    from mlxkv.kv.batching import make_batch_views

    calls = []
    real = paged_views.quantized_shared_prefix_attention
    monkeypatch.setattr(paged_views, "quantized_shared_prefix_attention",
                        lambda *a, **k: calls.append([g.shared_pages for g in a[6]]) or real(*a, **k))
    model = model_for("llama")
    pool = paged_pool(model, 8, num_blocks=120)
    system = [(5 * i) % 900 + 10 for i in range(30)]
    seqs, dense, tokens = [], [], []
    for k in range(3):
        prompt = system + [100 + k, 200 + k, 300 + k][: k + 1]
        seq = pool.open(prompt=prompt)
        step(model, seq.caches, prompt[seq.num_cached:])
        seq.commit()
        seqs.append(seq)
        dense.append(make_caches(model, kv_bits=8, kv_group_size=GROUP))
        tokens.append(int(mx.argmax(step(model, dense[-1], prompt)).item()))
    assert all(s.num_cached >= 28 for s in seqs[1:])
    for _ in range(6):
        for seq, t in zip(seqs, tokens, strict=True):
            seq.feed([t])
        batched = model(mx.array(tokens)[:, None], cache=make_batch_views([s.caches for s in seqs]))[:, -1]
        for seq in seqs:
            seq.commit()
        singles = [step(model, d, [t]) for t, d in zip(tokens, dense, strict=True)]
        for b, single in enumerate(singles):
            assert close(batched[b], single), (b, mx.abs(batched[b] - single).max().item())
        tokens = [int(mx.argmax(x).item()) for x in singles]
    assert len(calls) == 6 * len(model.layers) and all(c == [7] for c in calls)
    for seq in seqs:
        pool.release(seq.id)
    pool.check_invariants()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_tier_form_round_trips_the_planes_bit_for_bit(dtype, bits):
    """Blocks in the tier's form (the planes side by side, packed words viewed as the scales' dtype), copied to the
    host and back (as the tier stores them), written into a fresh storage whose layer was never written: the same
    planes, bit for bit; the head_dim is recovered from the width."""
    from mlxkv.kv.tier.format import to_host, to_mx

    src = QuantizedPagedStorage(6, 4, 1, bits=bits, group_size=GROUP)
    rows = mx.random.normal((12, 2, 64), key=mx.random.key(bits)).astype(dtype)  # (T, kv_heads, D)
    src.write(0, mx.arange(4, 16, dtype=mx.int32), rows, -rows)  # blocks 1..3
    ids = mx.array([2, 3], dtype=mx.int32)
    host = [to_host(a) for a in src.tier_rows(0, ids)]  # [(n, bs, H, W) host copy, dtype name] for K and V
    assert [d for _, d in host] == [str(dtype).split(".")[-1]] * 2
    dst = QuantizedPagedStorage(6, 4, 1, bits=bits, group_size=GROUP)
    k, v = (to_mx(a, d).reshape(-1, *a.shape[2:]) for a, d in host)  # (n * bs, H, W)
    dst.write_tier(0, mx.arange(4, 12, dtype=mx.int32), k, v)  # into blocks 1, 2
    for got, want in zip(dst.planes(0), src.planes(0), strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and mx.array_equal(g[:, 1:3], w[:, 2:4]).item()
    assert dst.tier_shapes(0) == src.tier_shapes(0)
