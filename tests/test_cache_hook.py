"""The attention hook: the cache decides attention for every architecture; mlx-lm caches keep working."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import base as mlx_base
from mlx_lm.models import cache as mlx_cache
from testkit.archs import ARCH_NAMES, build_model

from mlxkv.kv.layouts import LayerCache, install_attention_hook, make_caches
from mlxkv.kv.layouts.attention_hook import (
    dispatch_attention,
    model_modules,
    uninstall_attention_hook,
)

PROMPT = mx.array([[(i * 37 + 11) % 1000 + 3 for i in range(20)]])
ATTENTION_LAYERS = {"llama": 2, "qwen3": 2, "gemma3_text": 2, "llama4": 4, "deepseek_v3": 2, "qwen3_next": 1}


@pytest.fixture
def hooked(request):
    models = []

    def build(arch):
        model, _ = build_model(arch)
        models.append(model)
        return model

    yield build
    for model in models:  # leave the modules as other tests expect: patched by whoever needs it
        install_attention_hook(model)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_every_attention_layer_goes_through_the_cache(arch, hooked, monkeypatch):
    model = hooked(arch)
    patched = install_attention_hook(model)
    assert "mlx_lm.models.base" in patched and type(model).__module__ in patched
    assert install_attention_hook(model) == patched  # idempotent
    for name in patched:
        assert sys.modules[name].scaled_dot_product_attention is dispatch_attention
    calls = []
    original = LayerCache.attend

    def spy(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LayerCache, "attend", spy)
    caches = make_caches(model)
    mx.eval(model(PROMPT, cache=caches))
    assert len(calls) == ATTENTION_LAYERS[arch]
    mx.eval(model(PROMPT[:, :1], cache=caches))
    assert len(calls) == 2 * ATTENTION_LAYERS[arch]


def test_modules_of_a_model_include_its_submodules(hooked):
    """Classes from other mlx-lm modules (switch layers, MLA helpers) are found, and patched where they
    call attention through the imported name."""
    assert {"mlx_lm.models.llama4", "mlx_lm.models.switch_layers"} <= set(model_modules(hooked("llama4")))
    assert {"mlx_lm.models.deepseek_v3", "mlx_lm.models.mla"} <= set(model_modules(hooked("deepseek_v3")))


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_mlx_lm_caches_and_unhooked_models_are_unchanged(arch, hooked):
    """The dispatcher falls back to mlx-lm's function: identical logits with and without the hook. Our dense
    caches also run on an unhooked model (mlx-lm's own attention), with the same logits."""
    model = hooked(arch)
    uninstall_attention_hook(model)
    assert mlx_base.scaled_dot_product_attention is not dispatch_attention
    plain = model(PROMPT, cache=mlx_cache.make_prompt_cache(model))
    ours_unhooked = model(PROMPT, cache=make_caches(model))
    install_attention_hook(model)
    hooked_logits = model(PROMPT, cache=mlx_cache.make_prompt_cache(model))
    ours = model(PROMPT, cache=make_caches(model))
    assert mx.array_equal(plain, hooked_logits).item()
    assert mx.abs(ours - plain).max().item() <= 1e-5
    assert mx.abs(ours_unhooked - plain).max().item() <= 1e-5


def test_no_cache_forward_still_works(hooked):
    model = hooked("llama")
    install_attention_hook(model)
    assert model(PROMPT).shape == (1, 20, 1024)
