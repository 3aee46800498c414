"""LatentCache (protocol, trim, state, bytes per token) and the latent attention kernel (split-KV)."""

import math

import mlx.core as mx
import pytest

from mlxkv.env import reload as reload_flags
from mlx_lm.models.cache import KVCache, make_prompt_cache
from testkit.deepseek import ARCHS, build_deepseek

from mlxkv.kv.store import CachePool
from mlxkv.mla import (
    LatentCache,
    apply_mla,
    latent_attention,
    make_mla_caches,
    set_mla_mode,
)

TOL = 1e-4


def rows(n, start=0, R=6, dr=2):
    """Distinct latent / rope rows: value = token index + column / 100."""
    t = mx.arange(start, start + n, dtype=mx.float32)[:, None]  # (n, 1)
    lat = t + mx.arange(R, dtype=mx.float32)[None] / 100  # (n, R)
    pe = -t - mx.arange(dr, dtype=mx.float32)[None] / 100  # (n, dr)
    return lat[None, None], pe[None, None]  # (1, 1, n, R), (1, 1, n, dr)


# -- protocol -------------------------------------------------------------------------------------------
def test_update_and_fetch_grows_by_step_and_keeps_every_row():
    cache = LatentCache(step=4)
    assert cache.empty() and cache.nbytes == 0 and cache.offset == 0
    cache.update_and_fetch(*rows(3))
    lat, pe = cache.update_and_fetch(*rows(3, start=3))
    assert cache.capacity == 8 and cache.offset == cache.size() == 6
    want_lat, want_pe = rows(6)
    assert mx.array_equal(lat, want_lat) and mx.array_equal(pe, want_pe)
    assert cache.nbytes == 8 * (6 + 2) * 4


def test_trim_is_exact_and_reports_the_count():
    cache = LatentCache(step=4)
    cache.update_and_fetch(*rows(5))
    assert cache.is_trimmable()
    assert cache.trim(2) == 2 and cache.offset == 3
    lat, pe = cache.update_and_fetch(*rows(2, start=100))  # overwrite the trimmed rows
    want = [mx.concatenate([a, b], axis=2) for a, b in zip(rows(3), rows(2, start=100))]
    assert mx.array_equal(lat, want[0]) and mx.array_equal(pe, want[1])
    assert cache.trim(0) == 0
    assert cache.trim(99) == 5 and cache.offset == 0


@pytest.mark.parametrize("n,return_array", [(1, False), (3, False), (3, True), (1, True)])
def test_make_mask_matches_mlx_lm(n, return_array):
    ours, theirs = LatentCache(), KVCache()
    ours.update_and_fetch(*rows(4))
    theirs.update_and_fetch(*rows(4))
    kw = dict(return_array=return_array, window_size=None)  # how mlx-lm's models call it
    a, b = ours.make_mask(n, **kw), theirs.make_mask(n, **kw)
    assert type(a) is type(b)
    if isinstance(a, mx.array):
        assert mx.array_equal(a, b)
    else:
        assert a == b


def test_state_round_trip():
    cache = LatentCache(step=4)
    cache.update_and_fetch(*rows(5))
    lat, pe, offset = cache.state
    assert offset == 5 and lat.shape == (1, 1, 5, 6) and pe.shape == (1, 1, 5, 2)
    back = LatentCache.from_state(cache.state, cache.meta_state)
    assert back.offset == 5 and back.step == 4
    assert all(mx.array_equal(a, b) for a, b in zip(back.state[:2], cache.state[:2]))
    lat2, _ = back.update_and_fetch(*rows(1, start=5))
    assert mx.array_equal(lat2, rows(6)[0])
    assert LatentCache.from_state(LatentCache().state).empty()


# -- the kernel ----------------------------------------------------------------------------------------
def naive_attention(q_lat, q_pe, latent, k_pe, scale, mask):
    """Per-head reference: concatenated [latent; rope] keys, latent values, explicit masked softmax."""
    q = mx.concatenate([q_lat, q_pe], axis=-1)  # (B, H, L, R+dr)
    k = mx.concatenate([latent, k_pe], axis=-1)  # (B, 1, S, R+dr)
    s = (q @ k.swapaxes(-1, -2)) * scale  # (B, H, L, S)
    if mask is not None:
        s = mx.where(mask, s, -math.inf) if mask.dtype == mx.bool_ else s + mask
    return mx.softmax(s, axis=-1, precise=True) @ latent  # (B, H, L, R)


def kernel_inputs(B=2, H=3, L=5, S=17, R=8, dr=4, seed=0):
    k = mx.random.split(mx.random.key(seed), 4)
    return (mx.random.normal((B, H, L, R), key=k[0]), mx.random.normal((B, H, L, dr), key=k[1]),
            mx.random.normal((B, 1, S, R), key=k[2]), mx.random.normal((B, 1, S, dr), key=k[3]))


@pytest.mark.parametrize("chunk", [None, 1, 3, 7, 16, 17, 64])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "left_padding", "additive"])
def test_latent_attention_split_and_whole_match_the_naive_reference(chunk, mask_kind):
    q_lat, q_pe, latent, k_pe = kernel_inputs()
    B, H, L, S = 2, 3, 5, 17
    causal = mx.arange(S)[None] <= mx.arange(S - L, S)[:, None]  # (L, S)
    if mask_kind == "none":
        mask = arg = None
    elif mask_kind == "causal":
        mask, arg = causal, "causal"
    elif mask_kind == "left_padding":
        # sequence 1 is left-padded by 9 keys: with chunk <= 9 its first chunks are entirely masked
        pad = mx.array([0, 9])[:, None, None, None]  # (B, 1, 1, 1)
        mask = arg = causal[None, None] & (mx.arange(S)[None, None, None] >= pad)  # (B, 1, L, S)
    else:
        mask = arg = mx.where(causal, 0.0, -math.inf) + mx.arange(S, dtype=mx.float32) / 10  # (L, S)
    want = naive_attention(q_lat, q_pe, latent, k_pe, 0.3, mask)
    got = latent_attention(q_lat, q_pe, latent, k_pe, 0.3, arg, chunk=chunk)
    assert got.shape == (B, H, L, 8)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_latent_attention_rejects_a_bad_chunk_or_mask():
    args = kernel_inputs()
    with pytest.raises(ValueError, match=">= 1"):
        latent_attention(*args, 0.3, None, chunk=0)
    with pytest.raises(ValueError, match="'causal'"):
        latent_attention(*args, 0.3, "sliding")


# -- on a model: speculative rounds and memory ------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_trim_after_a_verification_step_is_exact(monkeypatch, arch):
    monkeypatch.setenv("MLXKV_MLA_ABSORBED", "1")
    reload_flags()
    model, _ = build_deepseek(arch)
    apply_mla(model)
    prompt, draft = [5, 9, 100, 200, 300, 17, 18, 19, 20, 21, 400, 500], [30, 31, 32, 33]
    caches = make_mla_caches(model)
    mx.eval(model(mx.array([prompt]), cache=caches))
    verify = model(mx.array([draft]), cache=caches)  # 4 queries after 12 keys: absorbed
    assert model.layers[0].self_attn.absorbed_calls == 1
    assert [c.trim(2) for c in caches] == [2, 2]  # reject the last two drafts
    after = model(mx.array([[40]]), cache=caches)
    assert all(c.offset == len(prompt) + 3 for c in caches)

    ref, _ = build_deepseek(arch)  # mlx-lm as built never saw the rejected drafts
    ref_caches = make_prompt_cache(ref)
    ref(mx.array([prompt]), cache=ref_caches)
    ref_verify = ref(mx.array([draft[:2]]), cache=ref_caches)
    ref_after = ref(mx.array([[40]]), cache=ref_caches)
    assert mx.abs(verify[:, :2] - ref_verify).max().item() <= TOL
    assert mx.abs(after - ref_after).max().item() <= TOL

    # rewinding and replaying the same token reproduces the same logits bit for bit
    for c in caches:
        c.trim(1)
    assert mx.array_equal(model(mx.array([[40]]), cache=caches), after)


def per_token_bytes(config):
    """(latent, materialised per-head K/V) bytes per token per layer for float32, from the config."""
    latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    heads = config["num_attention_heads"]
    expanded = heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]) * 4
    return latent, expanded


@pytest.mark.parametrize("arch", ARCHS)
def test_bytes_per_token_latent_vs_materialised(monkeypatch, arch):
    n = 256  # one growth step, so allocated rows == tokens for both mlx-lm's KVCache and ours
    tokens = (mx.arange(n, dtype=mx.uint32)[None] * 7) % 1000  # (1, n)
    model, config = build_deepseek(arch)
    layers = config["num_hidden_layers"]
    latent, expanded = per_token_bytes(config)
    assert (latent, expanded) == (160, 640)  # the tiny config: (32 + 8) × 4 vs 4 × (16 + 8 + 16) × 4

    mlx_pool = CachePool(model, layout="mlx-lm")  # flags off: mlx-lm as built
    seq = mlx_pool.open(n)
    mx.eval(model(tokens, cache=seq.caches))
    # mlx-lm's V2 caches per-head K/V; its V3 already caches the latent + rope key
    want = expanded if arch == "deepseek_v2" else latent
    assert mlx_pool.memory_usage_bytes() == layers * n * want

    monkeypatch.setenv("MLXKV_MLA_ABSORBED", "1")
    reload_flags()
    apply_mla(model)
    pool = CachePool(model, cache_factory=make_mla_caches)
    seq = pool.open(n)
    mx.eval(model(tokens, cache=seq.caches))
    assert [c.nbytes for c in seq.caches] == [n * latent] * layers
    assert pool.memory_usage_bytes() == layers * n * latent
    set_mla_mode(model, "absorbed")  # the bytes do not depend on which attention path ran
    seq2 = pool.open(n)
    mx.eval(model(tokens, cache=seq2.caches))
    assert pool.memory_usage_bytes() == 2 * layers * n * latent
