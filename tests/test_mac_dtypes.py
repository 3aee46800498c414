"""The Mac-dtype lane: the cache paths of the toy architectures in bfloat16 and float16, the dtypes a Mac's GPU runs,
kept on the CPU by ``MLXKV_CPU_KEEP_DTYPE=1`` (models load through ``mlxkv.models.load``, CPU ops included).

Each path is compared with its reference in the same dtype: paged pages with dense layouts, quantized pages with
dense quantized caches, a tier restore with never-evicted pages, speculative decoding (trim) with plain greedy.

Tolerances. Where the path and the reference run the same operations on the same rows, the check is bit-equal logits
and equal greedy tokens: the pages under a gather-then-SDPA oracle in the dtype, quantized pages of full and chunked
layers (both sides run ``quantized_attend`` on the same planes in the same order), a trimmed cache regenerating, the
tier's restored pages. Where they run other operations, the logits are close within :data:`TOL` of the logit scale
and a greedy token may differ from the reference's only where the reference's own logits for the two tie within it.
The other operations: paged attention accumulates in float32 and rounds once where dense SDPA rounds in the dtype; the
dense sliding layout hands attention its ring in another order; a prefix hit or a verify forward runs other row
counts. These GAIN=2 random models amplify such roundings on logits to (measured, 16-token runs, every
architecture) up to 17 units of the dtype's epsilon of the logit scale for bfloat16 (4-bit pages of gemma3's sliding
layer) and 13 for float16 (llama4 paged vs dense): the tolerance is 32 epsilons, 0.125 for bfloat16 (eps 2^-8) and
0.0156 for float16 (eps 2^-11). A wrong row, block or trimmed position moves logits by a large part of their scale.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from testkit.archs import build_from_config, get_config
from testkit.cache_runs import run
from testkit.kernel_oracle import dense_paged_attention
from testkit.models import write_model
from testkit.pool_runs import prefill_and_release
from testkit.speculative import ScriptedDrafter

import mlxkv.kv.paged.sequence_attention as layer_cache_module
from mlxkv import env
from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculative import SpeculativeEngine
from mlxkv.kv.layouts import make_caches
from mlxkv.kv.paged import PagedBackend
from mlxkv.kv.store import CachePool
from mlxkv.models import load

pytestmark = pytest.mark.dtype_lane

DTYPES = [mx.bfloat16, mx.float16]
NAMES = ["bfloat16", "float16"]
#: Logit tolerance relative to the logit scale, per dtype: 32 machine epsilons (measured up to 17; see the module doc).
TOL = {mx.bfloat16: 32 * 2.0**-8, mx.float16: 32 * 2.0**-11}
GROUP = 32  # the KV quantization group: head_dim is 32 in every model below
#: The test architectures with head_dim 32 (quantization groups need >= 32) and without MoE feed-forwards (MLX's
#: CPU GatherMM is float32-only): llama4 keeps its chunked layers, deepseek_v3 its latent attention.
CONFIGS = {
    "llama": {"hidden_size": 128},
    "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 32},
    "llama4": {"head_dim": 32, "interleave_moe_layer_step": 8},
    "qwen3_next": {"head_dim": 32},
    "deepseek_v3": {"first_k_dense_replace": 2},
}
LAYOUTS = ["llama", "gemma3_text", "llama4"]  # full, sliding (window 8), chunked (16)
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]  # past gemma3's window 8, across llama4's 16-token chunks
STEPS = 16
K = 4  # draft tokens per speculative round


@pytest.fixture(autouse=True)
def keep_dtype(monkeypatch):
    monkeypatch.setenv("MLXKV_CPU_KEEP_DTYPE", "1")
    env.reload()


@pytest.fixture(scope="session")
def half_model(tmp_path_factory):
    """Factory ``half_model(arch, dtype)``: the toy model written in ``dtype`` and loaded by ``mlxkv.models.load``
    under ``MLXKV_CPU_KEEP_DTYPE=1``; built once per session."""
    root = tmp_path_factory.mktemp("half_models")

    @cache
    def get(arch: str, dtype: mx.Dtype):
        config = get_config(arch)
        config.get("text_config", config).update(CONFIGS[arch])
        model, config = build_from_config(config)
        model.set_dtype(dtype)
        name = str(dtype).split(".")[-1]
        config["torch_dtype"] = name
        return load(str(write_model(model, config, root / f"{arch}-{name}")), progress=False).model

    return get


def tol(dtype, reference: mx.array) -> float:
    return TOL[dtype] * max(1.0, mx.abs(reference).max().item())


def step(model, caches, tokens) -> mx.array:
    out = model(mx.array(tokens, dtype=mx.uint32)[None], cache=caches)[0, -1]  # (vocab,)
    mx.eval(out)
    return out


def same_greedy_or_tie(got: mx.array, reference: mx.array, dtype) -> bool:
    """The greedy token of ``got`` is the reference's, or the reference's logits tie on the two within TOL."""
    a, b = int(mx.argmax(got).item()), int(mx.argmax(reference).item())
    return a == b or (reference[b] - reference[a]).item() <= tol(dtype, reference)


def paged_pool(model, bits=None, num_blocks=160, **kw) -> CachePool:
    config = KvCacheConfig(backend="paged", block_size=4, kv_bits=bits, kv_group_size=GROUP, **kw)
    return CachePool(model, backend="paged", num_blocks=num_blocks, kv_config=config)


def paged_vs_dense(model, pool, dense, dtype, exact):
    """Prefill PROMPT in uneven chunks and decode STEPS teacher-forced tokens on the pool's sequence and the dense
    caches; every step's logits equal (``exact``) or close, greedy tokens equal or tied."""
    seq = pool.open(prompt=PROMPT)
    for i in range(0, len(PROMPT), 13):  # writes straddle blocks, windows and chunks
        lp, ld = step(model, seq.caches, PROMPT[i:i + 13]), step(model, dense, PROMPT[i:i + 13])
    seq.commit()
    fed = []
    for _ in range(STEPS + 1):
        assert lp.dtype == ld.dtype == dtype
        if exact:
            assert mx.array_equal(lp, ld).item(), mx.abs(lp - ld).max().item()
        else:
            assert mx.abs(lp - ld).max().item() <= tol(dtype, ld), mx.abs(lp - ld).max().item()
            assert same_greedy_or_tie(lp, ld, dtype)
        if len(fed) == STEPS:
            break
        fed.append(token := int(mx.argmax(ld).item()))
        seq.feed([token])
        lp, ld = step(model, seq.caches, [token]), step(model, dense, [token])
        seq.commit()
    assert len(set(fed)) > 1, "degenerate test model"
    pool.release(seq.id)
    pool.check_invariants()


@pytest.mark.parametrize("keep", [True, False])
def test_the_switch_keeps_the_stored_dtype(keep, monkeypatch, tmp_path):
    """Loaded under the switch, a bfloat16 model computes in bfloat16 (weights, K/V, logits); without it, float32."""
    monkeypatch.setenv("MLXKV_CPU_KEEP_DTYPE", "1" if keep else "0")
    env.reload()
    model, config = build_from_config(get_config("llama"))
    model.set_dtype(mx.bfloat16)
    model = load(str(write_model(model, config, tmp_path)), progress=False).model
    want = mx.bfloat16 if keep else mx.float32
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {want}
    caches = make_caches(model)
    assert step(model, caches, PROMPT[:5]).dtype == want and caches[0].state[0].dtype == want
    # a page's bytes are the dtype's: 2 layers x K and V x 2 KV heads x head_dim 16 x 4 rows
    assert PagedBackend(model, KvCacheConfig(backend="paged", block_size=4), num_blocks=8).bytes_per_block \
        == 512 * want.size


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("arch", sorted(set(CONFIGS) - {"gemma3_text"}))
def test_pages_hold_exactly_the_dense_rows(half_model, arch, dtype, monkeypatch):
    """With the gather-then-SDPA oracle in the dtype in place of the kernel, paged logits equal dense bit for bit:
    every half-precision row landed in its slot as written, and the tables select exactly the dense rows. (The
    dense sliding layout returns its ring in another order, which reorders the sums: gemma3 is left out.)"""

    def oracle(q, k, v, bt, cl, *, scale=None, window=None, chunk_size=None, sinks=None, **_):
        return dense_paged_attention(q, k, v, bt, cl, scale=scale, window=window, chunk_size=chunk_size,
                                     sinks=sinks, compute_dtype=None)

    monkeypatch.setattr(layer_cache_module, "paged_attention", oracle)
    monkeypatch.setattr(layer_cache_module, "reference_on_views", lambda: False)
    model = half_model(arch, dtype)
    paged_vs_dense(model, paged_pool(model), make_caches(model), dtype, exact=True)


@pytest.mark.parametrize("path", ["kernel", "views"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_paged_attention_is_close_to_dense(half_model, arch, dtype, path, monkeypatch):
    monkeypatch.setattr(layer_cache_module, "reference_on_views", lambda: path == "views")
    model = half_model(arch, dtype)
    paged_vs_dense(model, paged_pool(model), make_caches(model), dtype, exact=False)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("arch", LAYOUTS)
def test_quantized_pages_equal_dense_quantized(half_model, arch, dtype, bits):
    """Quantized pages hold the dense quantized cache's planes, scales and biases in the model's dtype: full and
    chunked layers give bit-equal logits, the sliding layer (ring order) close ones."""
    model = half_model(arch, dtype)
    pool = paged_pool(model, bits)
    dense = make_caches(model, kv_bits=bits, kv_group_size=GROUP)
    paged_vs_dense(model, pool, dense, dtype, exact=arch != "gemma3_text")
    storage = pool.paged.storage
    layers = [layer for layer in range(len(storage.k_rows)) if storage.allocated(layer)]
    assert layers and {d for layer in layers for _, _, d in storage.tier_shapes(layer)} == {dtype}


def speculative(model, pool, reference, n=STEPS):
    """Greedy tokens of a SpeculativeEngine whose scripted drafts (from ``reference``) make every round reject a
    different number of tokens, so the target's caches are trimmed by every length from 0 to k."""
    rounds = []
    engine = SpeculativeEngine(model, None, ScriptedDrafter(reference), num_draft_tokens=K, pool=pool,
                               on_round=lambda seq, r: rounds.append(r.accepted))
    tokens = list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=n)))
    assert len(pool) == 0
    assert set(rounds) == set(range(K + 1)), "every rewind length"
    return tokens


@pytest.mark.parametrize("backend", ["dense", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("arch", LAYOUTS)
def test_speculative_rewinds_give_plain_greedy(half_model, arch, dtype, backend):
    """Speculative greedy decoding (verify forwards of k+1 tokens, then trim) gives plain greedy decoding's tokens:
    each one is the greedy pick of plain dense decoding fed the same tokens, or a tie of it within TOL (a verify
    forward attends several rows at once, through other operations than a decode step)."""
    model = half_model(arch, dtype)
    pool = CachePool(model) if backend == "dense" else paged_pool(model)
    params = SamplingParams(max_tokens=STEPS)
    plain = list(DirectEngine(model, None, pool=CachePool(model)).generate_tokens(PROMPT, params))  # the drafts' script
    tokens = speculative(model, pool, plain)
    logits, _ = run(model, make_caches(model), PROMPT, feed=tokens, steps=len(tokens) - 1)  # plain, teacher-forced
    for i, (token, reference) in enumerate(zip(tokens, logits, strict=True)):
        picked = int(mx.argmax(reference).item())
        assert token == picked or (reference[picked] - reference[token]).item() <= tol(dtype, reference), i
    pool.check_invariants()


@pytest.mark.parametrize("k", [1, 7, 19])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("arch", LAYOUTS)
def test_trim_then_regenerate_is_bit_exact(half_model, arch, dtype, k):
    """Decode 24 tokens (gemma3's window wraps, llama4 crosses chunks), trim k, regenerate: the same single-token
    forwards over the same rows, so the same tokens and bit-equal logits."""
    model = half_model(arch, dtype)
    caches = make_caches(model)
    logits, fed = run(model, caches, PROMPT, steps=24)
    for c in caches:
        assert c.trim(k) == k
    again, refed = run(model, caches, fed[24 - k:25 - k], steps=k - 1)  # from the first trimmed token on
    assert refed == fed[25 - k:]
    assert all(mx.array_equal(a, b).item() for a, b in zip(again, logits[25 - k:], strict=True))


# ---- the secondary tier: half-precision pages to host memory or disk and back ----------------------------------
TIER_PROMPT = PROMPT[:42]  # 10 full usable blocks of 4
OTHER = [(11 * i + 5) % 900 + 10 for i in range(44)]  # 11 blocks: evicts all of a 12-block pool


def prefix_rows(pool, tokens) -> list[mx.array]:
    """The prefix hit's blocks of every layer in the tier's form (quantized: the planes side by side)."""
    be = pool.paged
    ids = mx.array([b.block_id for b in be.manager.find_prefix_hit(tokens).blocks[0]], dtype=mx.int32)
    rows = [a for layer in range(len(be.storage.k_rows)) if be.storage.allocated(layer)
            for a in be.storage.tier_rows(layer, ids)]
    mx.eval(rows)
    return rows


def bits_of(a: mx.array) -> mx.array:
    """The array's bits (packed quantized words viewed as a float dtype may read as NaN, which never equals itself)."""
    return a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32)


@pytest.mark.parametrize("bits", [None, 8], ids=["pages", "8bit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
def test_tier_memory_round_trip_is_bit_exact(half_model, dtype, bits):
    """Evicted blocks go to host memory in their own dtype (NumPy has no bfloat16: its bits travel as uint16) and
    come back bit for bit; the hit's logits are the cold run's up to TOL (fewer rows forwarded)."""
    model = half_model("llama", dtype)
    reference, _ = prefill_and_release(paged_pool(model, bits, num_blocks=64), TIER_PROMPT[:22])
    pool = paged_pool(model, bits, num_blocks=12, secondary_memory_bytes=1 << 20)
    prefill_and_release(pool, TIER_PROMPT[:22])
    evicted = prefix_rows(pool, TIER_PROMPT[:22])
    assert {a.dtype for a in evicted} == {dtype}
    prefill_and_release(pool, OTHER)
    assert pool.paged.manager.find_prefix_hit(TIER_PROMPT[:22]).num_full_blocks == 0
    held = pool.block_stats()["tier"]["secondary"]["memory"]
    assert held["blocks"] >= 5 and held["bytes"] == held["blocks"] * pool.paged.bytes_per_block  # not upcast
    logits, cached = prefill_and_release(pool, TIER_PROMPT[:22])
    assert cached == 20
    restored = prefix_rows(pool, TIER_PROMPT[:22])
    assert all(a.dtype == b.dtype and mx.array_equal(bits_of(a), bits_of(b)).item()
               for a, b in zip(restored, evicted, strict=True))
    assert mx.abs(logits - reference).max().item() <= tol(dtype, reference)
    assert same_greedy_or_tie(logits, reference, dtype)


@pytest.mark.parametrize("bits", [None, 8], ids=["pages", "8bit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("arch", LAYOUTS)
def test_tier_disk_restart_restores_the_hit(half_model, arch, dtype, bits, tmp_path):
    """Cached blocks written to the disk tier come back after a restart (full groups all of them, windowed groups
    their window) and give the cold run's logits up to TOL."""
    model = half_model(arch, dtype)
    tier = dict(secondary_disk_dir=str(tmp_path), secondary_disk_bytes=1 << 26)
    first = paged_pool(model, bits, num_blocks=96, **tier)
    reference, cached = prefill_and_release(first, TIER_PROMPT)
    assert cached == 0 and first.flush_tier(10)["lost"] == 0
    logits, cached = prefill_and_release(paged_pool(model, bits, num_blocks=96, **tier), TIER_PROMPT)
    assert cached == 40
    assert mx.abs(logits - reference).max().item() <= tol(dtype, reference)
    assert same_greedy_or_tie(logits, reference, dtype)


def test_half_precision_experts_are_refused_at_load(tmp_path, monkeypatch):
    """MLX's CPU gather_mm is float32 only: a bfloat16 mixture-of-experts model kept in its dtype is refused at load
    with a one-line error instead of failing in its first forward; without the switch it loads and runs as float32."""
    from mlxkv.models import ModelLoadError

    model, config = build_from_config(get_config("llama4"))  # experts on layers 1 and 3
    model.set_dtype(mx.bfloat16)
    folder = str(write_model(model, config, tmp_path))
    with pytest.raises(ModelLoadError, match=r"^MLXKV_CPU_KEEP_DTYPE=1: the model's experts \(.+\) are bfloat16, "
                                             r"which MLX's CPU backend cannot run"):
        load(folder, progress=False)
    monkeypatch.setenv("MLXKV_CPU_KEEP_DTYPE", "0")
    env.reload()
    assert step(load(folder, progress=False).model, None, PROMPT[:3]).dtype == mx.float32
