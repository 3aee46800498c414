"""Prefill: chunked and padded prefill give the unpadded, unchunked logits; which architectures pad; flags."""

from functools import cache

import mlx.core as mx
import pytest

from mlxkv.env import reload as reload_flags
from mlx_lm.models import cache as mlx_cache
from testkit.archs import ARCH_NAMES, build_model

from mlxkv.engine.prefill import (
    PAD_TILE,
    PADDED_PREFILL_DEFAULT,
    padded_prefill_enabled,
    prefill,
    supports_padded_prefill,
)
from mlxkv.kv.layouts import install_attention_hook, make_caches

pytestmark = pytest.mark.float_order

PROMPT = mx.array([(i * 37 + 11) % 1000 + 3 for i in range(45)])  # 45: padded to 64 (19 pad tokens)


@cache
def model_for(arch):
    model, _ = build_model(arch)
    install_attention_hook(model)
    return model


def decode(model, caches, logits, n=6):
    out = [logits]
    for _ in range(n):
        logits = model(mx.argmax(logits).reshape(1, 1), cache=caches)[0, -1]
        out.append(logits)
    mx.eval(out)
    return out


def clear_flags(monkeypatch):
    monkeypatch.delenv("MLXKV_FORCE_PADDED_PREFILL", raising=False)
    monkeypatch.delenv("MLXKV_NO_PADDED_PREFILL", raising=False)
    reload_flags()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_which_architectures_pad(arch):
    model = model_for(arch)
    expected = arch not in ("llama4", "qwen3_next")  # chunked attention; recurrent hybrid
    assert supports_padded_prefill(model, make_caches(model)) == expected
    assert supports_padded_prefill(model, make_caches(model, max_kv_size=64)) == expected
    if expected:
        assert supports_padded_prefill(model, mlx_cache.make_prompt_cache(model)) == (arch != "gemma3_text")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3", "llama4", "qwen3_next"])
def test_padded_equals_unpadded(arch, monkeypatch):
    model = model_for(arch)
    clear_flags(monkeypatch)
    monkeypatch.setenv("MLXKV_NO_PADDED_PREFILL", "1")
    reload_flags()
    plain_caches = make_caches(model)
    plain_logits = prefill(model, plain_caches, PROMPT)
    plain_offsets = [getattr(c, "offset", None) for c in plain_caches]
    plain = decode(model, plain_caches, plain_logits)
    monkeypatch.setenv("MLXKV_NO_PADDED_PREFILL", "0")
    monkeypatch.setenv("MLXKV_FORCE_PADDED_PREFILL", "1")
    reload_flags()
    caches = make_caches(model)
    pads = padded_prefill_enabled(model, caches)
    assert pads == supports_padded_prefill(model, caches)
    padded_logits = prefill(model, caches, PROMPT)
    assert [getattr(c, "offset", None) for c in caches] == plain_offsets
    padded = decode(model, caches, padded_logits)
    assert [mx.argmax(a).item() for a in padded] == [mx.argmax(b).item() for b in plain]  # same greedy tokens
    if not pads:  # the same forwards run: bit-exact
        assert all(mx.array_equal(a, b).item() for a, b in zip(padded, plain))
        return
    # The padded forward multiplies 64 rows where the plain one multiplies 45, and a BLAS may block (so sum) a
    # dot product differently by row count: float32 rounding of n reordered terms is at most n * eps (1.2e-7)
    # relative, with the test models' longest sums 128 terms: 1e-5 of the logit magnitude.
    scale = max(1.0, max(mx.abs(b).max().item() for b in plain))
    assert max(mx.abs(a - b).max().item() for a, b in zip(padded, plain)) <= 1e-5 * scale


def test_padding_really_happens(monkeypatch):
    """Under FORCE the forward sees a tile multiple; the pad never shows in the caches."""
    model = model_for("gemma3_text")
    clear_flags(monkeypatch)
    monkeypatch.setenv("MLXKV_FORCE_PADDED_PREFILL", "yes")
    reload_flags()
    lengths = []
    original = type(model).__call__

    class Spy(type(model)):
        def __call__(self, inputs, *args, **kwargs):
            lengths.append(inputs.shape[1])
            return original(self, inputs, *args, **kwargs)

    model.__class__ = Spy
    try:
        prefill(model, make_caches(model), PROMPT, step_size=32)
    finally:
        model.__class__ = Spy.__bases__[0]
    assert lengths == [32, PAD_TILE, 1]  # 44 body tokens = 32 + 12 (padded to 32), then the last token alone


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "llama4", "qwen3_next"])
def test_chunked_prefill_equals_one_forward(arch):
    model = model_for(arch)
    whole = prefill(model, make_caches(model), PROMPT, step_size=4096)
    chunked = prefill(model, make_caches(model), PROMPT, step_size=7)
    assert mx.allclose(whole, chunked, atol=1e-4).item()


def test_flag_precedence(monkeypatch):
    model = model_for("llama")
    caches = make_caches(model)
    cases = [  # (FORCE, NO) -> enabled
        (None, None, PADDED_PREFILL_DEFAULT),
        ("1", None, True),
        (None, "1", False),
        ("1", "1", False),  # NO wins over FORCE
        ("1", "0", True),
        ("0", None, False),
    ]
    for force, no, expected in cases:
        clear_flags(monkeypatch)
        if force is not None:
            monkeypatch.setenv("MLXKV_FORCE_PADDED_PREFILL", force)
            reload_flags()
        if no is not None:
            monkeypatch.setenv("MLXKV_NO_PADDED_PREFILL", no)
            reload_flags()
        assert padded_prefill_enabled(model, caches) is expected, (force, no)
    clear_flags(monkeypatch)
    monkeypatch.setenv("MLXKV_FORCE_PADDED_PREFILL", "1")
    reload_flags()
    assert not padded_prefill_enabled(model_for("llama4"), make_caches(model_for("llama4")))  # never unsupported
    monkeypatch.setenv("MLXKV_FORCE_PADDED_PREFILL", "maybe")
    with pytest.raises(ValueError, match="MLXKV_FORCE_PADDED_PREFILL"):
        reload_flags()


def test_prefill_errors():
    model = model_for("llama")
    with pytest.raises(ValueError, match="non-empty"):
        prefill(model, make_caches(model), mx.array([], dtype=mx.uint32))
    with pytest.raises(ValueError, match="step_size"):
        prefill(model, make_caches(model), PROMPT, step_size=0)
