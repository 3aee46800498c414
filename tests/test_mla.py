"""Absorbed MLA on tiny random DeepSeek V2/V3 models: logits and greedy tokens vs mlx-lm as built."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxkv.env import reload as reload_flags
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from testkit.deepseek import ARCHS, build_deepseek

from mlxkv.mla import (
    MLAAttention,
    apply_mla,
    make_mla_caches,
    prefer_absorbed,
    set_mla_mode,
)

TOL = 1e-4  # float32 max abs logit difference
PROMPT = [5, 9, 100, 200, 300, 17, 18, 19, 20, 21, 400, 500, 600, 700, 800, 900, 33, 34, 35, 36, 77, 88]


@pytest.fixture
def absorbed_env(monkeypatch):
    monkeypatch.setenv("MLXKV_MLA_ABSORBED", "1")
    monkeypatch.delenv("MLXKV_MLA_SPLIT_KV", raising=False)
    reload_flags()
    return monkeypatch


def absorbed_model(arch, split_chunk=None, monkeypatch=None, seed=0):
    model, config = build_deepseek(arch, seed)
    if split_chunk is not None:
        monkeypatch.setenv("MLXKV_MLA_SPLIT_KV", "1")
        reload_flags()
        assert apply_mla(model, split_chunk=split_chunk) == list(range(len(model.layers)))
    else:
        assert apply_mla(model) == list(range(len(model.layers)))
    return model, config


def run_script(model, caches):
    """Prefill, three decode steps, a 5-token continuation, one more decode: logits of each call."""
    calls = [PROMPT, [7], [8], [9], [11, 12, 13, 14, 15], [16]]
    out = []
    for tokens in calls:
        logits = model(mx.array([tokens]), cache=caches)
        mx.eval(logits)
        out.append(logits)
    return out


def greedy(model, caches, n=24):
    logits = model(mx.array([PROMPT]), cache=caches)
    tokens = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)
    return tokens


# -- flags ------------------------------------------------------------------------------------------
def test_flags_off_leave_the_model_as_mlx_lm_built_it(monkeypatch):
    monkeypatch.delenv("MLXKV_MLA_ABSORBED", raising=False)
    monkeypatch.delenv("MLXKV_MLA_SPLIT_KV", raising=False)
    reload_flags()
    model, _ = build_deepseek("deepseek_v2")
    before = [type(layer.self_attn) for layer in model.layers]
    assert apply_mla(model) == []
    assert [type(layer.self_attn) for layer in model.layers] == before
    with pytest.raises(ValueError, match="MLXKV_MLA_ABSORBED=1"):
        make_mla_caches(model)


def test_split_flag_without_absorbed_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MLXKV_MLA_ABSORBED", raising=False)
    monkeypatch.setenv("MLXKV_MLA_SPLIT_KV", "1")
    with pytest.raises(ValueError, match="MLXKV_MLA_SPLIT_KV=1 requires MLXKV_MLA_ABSORBED=1"):
        reload_flags()


def test_bad_mode_names_the_valid_ones(absorbed_env):
    model, _ = absorbed_model("deepseek_v3")
    with pytest.raises(ValueError, match="auto, absorbed, materialised"):
        set_mla_mode(model, "fast")


@pytest.mark.parametrize("arch", ARCHS)
def test_swap_reuses_the_weights_and_keeps_parameter_names(absorbed_env, arch):
    model, _ = build_deepseek(arch)
    before = dict(tree_flatten(model.parameters()))
    apply_mla(model)
    apply_mla(model)  # idempotent
    after = dict(tree_flatten(model.parameters()))
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in model.layers)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)  # the same arrays: nothing copied


# -- exactness ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["absorbed", "materialised", "auto", "split"])
def test_logits_match_mlx_lm(absorbed_env, arch, mode):
    ref, _ = build_deepseek(arch)
    expected = run_script(ref, make_prompt_cache(ref))
    model, _ = absorbed_model(arch, split_chunk=3 if mode == "split" else None, monkeypatch=absorbed_env)
    set_mla_mode(model, "absorbed" if mode == "split" else mode)
    got = run_script(model, make_mla_caches(model))
    for step, (a, b) in enumerate(zip(expected, got)):
        diff = mx.abs(a - b).max().item()
        assert diff <= TOL, f"{arch} {mode}: call {step} differs by {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_absorbed_and_materialised_agree_and_split_matches_unsplit(absorbed_env, arch):
    model, _ = absorbed_model(arch)
    results = {}
    for mode in ("materialised", "absorbed"):
        set_mla_mode(model, mode)
        results[mode] = run_script(model, make_mla_caches(model))
    for layer in model.layers:
        layer.self_attn.split_kv, layer.self_attn.split_chunk = True, 5
    results["split"] = run_script(model, make_mla_caches(model))
    for a, b, c in zip(results["materialised"], results["absorbed"], results["split"]):
        assert mx.abs(a - b).max().item() <= TOL
        assert mx.abs(b - c).max().item() <= TOL  # the kernel itself is checked at 1e-6 in test_mla_cache


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_absorbs_decode_and_continuations_but_not_a_cold_prefill(absorbed_env, arch):
    model, config = absorbed_model(arch)
    attn = model.layers[0].self_attn
    caches = make_mla_caches(model)
    model(mx.array([PROMPT]), cache=caches)
    assert (attn.materialised_calls, attn.absorbed_calls) == (1, 0)
    model(mx.array([[7]]), cache=caches)
    model(mx.array([[11, 12, 13, 14]]), cache=caches)  # 4 queries after 23 keys: absorbing is cheaper here
    assert (attn.materialised_calls, attn.absorbed_calls) == (1, 2)
    dims = {k: config[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    assert prefer_absorbed(4, len(PROMPT) + 5, **dims) and not prefer_absorbed(len(PROMPT), len(PROMPT), **dims)


def test_cost_model_on_deepseek_v3_dimensions():
    dims = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert prefer_absorbed(1, 4096, **dims)  # decode
    assert prefer_absorbed(8, 4096, **dims)  # speculative verification
    assert prefer_absorbed(128, 4096 + 128, **dims)  # a small prefill chunk after a long cache
    assert not prefer_absorbed(4096, 4096, **dims)  # cold prefill
    assert not prefer_absorbed(512, 4096 + 512, **dims)  # past the ~170-query crossover: expanding is cheaper
    assert not prefer_absorbed(1, 1, **dims)  # the very first token: nothing to amortise the absorption


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("split", [False, True])
def test_greedy_tokens_equal_mlx_lm(absorbed_env, arch, split):
    ref, _ = build_deepseek(arch)
    expected = greedy(ref, make_prompt_cache(ref))
    model, _ = absorbed_model(arch, split_chunk=4 if split else None, monkeypatch=absorbed_env)
    got = greedy(model, make_mla_caches(model))
    assert got == expected
    assert len(set(expected)) > 5  # a non-trivial sequence


def test_mlx_lm_v3_attention_runs_unchanged_on_latent_caches():
    """mlx-lm's V3 already caches (latent, rope key): our cache speaks that protocol exactly."""
    from mlxkv.mla import LatentCache

    ref, _ = build_deepseek("deepseek_v3")
    expected = run_script(ref, make_prompt_cache(ref))
    got = run_script(ref, [LatentCache(step=8) for _ in ref.layers])
    assert all(mx.array_equal(a, b) for a, b in zip(expected, got))


def test_quantized_kv_b_proj_absorbs_through_quantized_matmuls(absorbed_env):
    def only_kv_b(path, module):
        return path.endswith("kv_b_proj")

    ref, _ = build_deepseek("deepseek_v2")
    nn.quantize(ref, group_size=32, bits=8, class_predicate=only_kv_b)
    expected = run_script(ref, make_prompt_cache(ref))
    model, _ = build_deepseek("deepseek_v2")
    nn.quantize(model, group_size=32, bits=8, class_predicate=only_kv_b)
    apply_mla(model)
    set_mla_mode(model, "absorbed")
    got = run_script(model, make_mla_caches(model))
    for a, b in zip(expected, got):
        assert mx.abs(a - b).max().item() <= TOL
