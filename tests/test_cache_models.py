"""mlxkv layouts against mlx-lm's own caches, model by model: same logits (float32, 1e-5) over a chunked
prefill and 64 decode steps — past gemma3's 8-token window, across llama4's 16-token chunks."""

from functools import cache

import mlx.core as mx
import pytest

from mlxkv.env import reload as reload_flags
import testkit.cache_runs as cache_helpers
from mlx_lm.models import cache as mlx_cache
from testkit.archs import ARCH_NAMES, build_model
from testkit.cache_runs import max_diff

from mlxkv.kv.layouts import (
    describe_layout,
    install_attention_hook,
    layer_kind,
    make_caches,
)

PROMPT = [(i * 37 + 11) % 1000 + 3 for i in range(40)]  # 40 tokens: 5 gemma3 windows, 2.5 llama4 chunks
STEPS = 64


@cache
def model_for(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    return model


def run(model, caches, prompt=PROMPT, chunks=(24,), feed=None, steps=STEPS):
    return cache_helpers.run(model, caches, prompt, chunks, feed, steps)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_logits_match_mlx_lm(arch):
    model = model_for(arch)
    ref, fed = run(model, mlx_cache.make_prompt_cache(model))
    ours, _ = run(model, make_caches(model), feed=fed)
    assert max_diff(ours, ref) <= 1e-5
    # our logits pick every token mlx-lm's greedy run picked: free-running greedy gives the same tokens
    assert [mx.argmax(x).item() for x in ours[:-1]] == fed


def test_layouts_follow_the_model():
    kinds = {arch: [layer_kind(c) for c in make_caches(model_for(arch))] for arch in ARCH_NAMES}
    assert kinds["llama"] == ["standard"] * 2
    assert kinds["gemma3_text"] == ["rotating(8)", "standard"]
    assert kinds["llama4"] == ["chunked(16)"] * 3 + ["standard"]
    assert kinds["qwen3_next"] == ["recurrent(ArraysCache)", "standard"]
    assert describe_layout(model_for("llama4")) == "chunked(16) x3, standard x1"
    assert describe_layout(model_for("gemma3_text"), max_kv_size=32) == "rotating(8) x1, rotating(32, keep 4) x1"
    assert describe_layout(model_for("qwen3_next"), max_kv_size=32) == \
        "recurrent(ArraysCache) x1, rotating(32, keep 4) x1"
    assert describe_layout(model_for("llama"), kv_bits=8, kv_group_size=32) == "standard q8 x2"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next"])
def test_max_kv_size_applies_to_every_architecture(arch):
    """mlx-lm ignores max_kv_size for models with make_cache (all three here); we cap every attention layer
    with a rotating cache keeping 4 sinks, as mlx-lm does for models without make_cache. Reference: mlx-lm's
    RotatingKVCache built by hand; the prompt fits the cap, decoding runs far past it."""
    model = model_for(arch)
    cap = 12

    def reference():
        return [mlx_cache.RotatingKVCache(min(c.max_size, cap), c.keep) if isinstance(c, mlx_cache.RotatingKVCache)
                else mlx_cache.RotatingKVCache(cap, keep=4) if isinstance(c, mlx_cache.KVCache) else c
                for c in model.make_cache()]

    prompt = PROMPT[:10]
    ref, fed = run(model, reference(), prompt=prompt, chunks=())
    ours, _ = run(model, make_caches(model, max_kv_size=cap), prompt=prompt, chunks=(), feed=fed)
    assert max_diff(ours, ref) <= 1e-5
    uncapped, _ = run(model, make_caches(model), prompt=prompt, chunks=(), feed=fed)
    assert max_diff(uncapped, ref) > 1e-3  # the cap really changes what is attended


def test_rotating_with_sinks_prefill_in_chunks_equals_token_by_token():
    """Our sink+window rule is the same on every path, so how the prompt is chunked does not matter
    (mlx-lm's multi-token path masks the sinks out progressively; we don't)."""
    model = model_for("llama")
    whole, fed = run(model, make_caches(model, max_kv_size=12), chunks=(), steps=8)
    chunked, _ = run(model, make_caches(model, max_kv_size=12), chunks=(5, 6, 7, 20, 33), feed=fed, steps=8)
    by_token, _ = run(model, make_caches(model, max_kv_size=12), chunks=tuple(range(1, len(PROMPT))), feed=fed,
                      steps=8)
    assert max_diff(whole, chunked) <= 1e-4
    assert max_diff(whole, by_token) <= 1e-4


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_slice_update_path_gives_the_same_logits(arch, monkeypatch):
    """MLXKV_KV_INPLACE_WRITE=0: single-token appends take the general path; same logits up to rounding."""
    model = model_for(arch)
    ref, fed = run(model, make_caches(model), steps=24)
    monkeypatch.setenv("MLXKV_KV_INPLACE_WRITE", "0")
    reload_flags()
    off, _ = run(model, make_caches(model), feed=fed, steps=24)
    assert max_diff(off, ref) <= 1e-4


def test_kv_bits_refused_for_mla():
    with pytest.raises(ValueError, match="latent"):
        make_caches(model_for("deepseek_v3"), kv_bits=8)
    with pytest.raises(ValueError, match="kv_bits"):
        make_caches(model_for("llama"), kv_bits=3)
    with pytest.raises(ValueError, match="max_kv_size"):
        make_caches(model_for("llama"), max_kv_size=4)
