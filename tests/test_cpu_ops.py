"""The CPU fast paths (table RoPE, compiled RMSNorm) are bit-equal to MLX's own modules and change no token."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn

from mlxkv.cpu_ops import CompiledRMSNorm, TableRoPE, install_cpu_ops

pytestmark = pytest.mark.float_order


@pytest.fixture()
def demo_model():
    """The embedded demo model as mlx-lm builds it (MLX's own RoPE and RMSNorm modules), fresh per test."""
    from mlx_lm.utils import load

    from mlxkv.models import demo_model_path
    return load(str(demo_model_path()))


def _random(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("base,scale", [(10000.0, 1.0), (100000.0, 0.25)])
def test_table_rope_equals_mlx_rope_bit_for_bit(traditional, base, scale):
    reference = nn.RoPE(64, traditional=traditional, base=base, scale=scale)
    table = TableRoPE(64, traditional=traditional, base=base, scale=scale, positions=512)
    x = _random((2, 3, 7, 64), 1)  # (B, H, L, D)
    for offset in (0, 1, 37, 505):
        assert mx.array_equal(table(x, offset), reference(x, offset)).item(), offset
    offsets = mx.array([0, 301], dtype=mx.int32)  # batched decode: one offset per row
    assert mx.array_equal(table(x, offsets), reference(x, offsets)).item()
    half = x.astype(mx.float16)
    assert table(half, 9).dtype == mx.float16
    assert mx.array_equal(table(half, 9), reference(half, 9)).item()


def test_table_rope_grows_past_its_table():
    reference, table = nn.RoPE(32), TableRoPE(32, positions=16)
    x = _random((1, 2, 4, 32), 2)
    assert mx.array_equal(table(x, 40), reference(x, 40)).item()
    assert table._positions >= 44


def test_table_rope_leaves_partial_rotation_to_mlx():
    reference, table = nn.RoPE(16), TableRoPE(16, positions=64)
    x = _random((1, 2, 3, 32), 3)  # only the first 16 of 32 dims rotate
    assert mx.array_equal(table(x, 5), reference(x, 5)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_compiled_rms_norm_equals_mlx_rms_norm(dtype):
    reference = nn.RMSNorm(48, eps=1e-5)
    reference.update({"weight": _random((48,), 4).astype(dtype)})
    compiled = CompiledRMSNorm(48, eps=1e-5)
    compiled.update({"weight": reference["weight"]})
    for shape in [(1, 1, 48), (2, 9, 48)]:  # decode and prefill shapes through one shapeless compile
        x = _random(shape, 5).astype(dtype)
        assert mx.array_equal(compiled(x), reference(x)).item(), shape


def test_install_swaps_modules_and_keeps_tokens(demo_model):
    from mlx_lm.models.cache import make_prompt_cache
    model, tokenizer = demo_model

    def greedy(steps=12):
        cache = make_prompt_cache(model)
        tokens = mx.array([tokenizer.encode("the cache keeps every token it has seen")])
        out, logits_seen = [], []
        for _ in range(steps):
            logits = model(tokens, cache=cache)[:, -1]
            logits_seen.append(logits)
            tokens = mx.argmax(logits, axis=-1, keepdims=True)
            out.append(tokens.item())
        return out, mx.stack(logits_seen)

    before_tokens, before_logits = greedy()
    swapped = install_cpu_ops(model, 2048)
    kinds = {type(m) for name, m in model.named_modules() if name in swapped}
    assert kinds == {TableRoPE, CompiledRMSNorm}, "the demo model has RoPE and RMSNorm modules to swap"
    after_tokens, after_logits = greedy()
    assert after_tokens == before_tokens
    assert mx.array_equal(after_logits, before_logits).item()


def test_install_is_a_no_op_off_the_cpu(monkeypatch, demo_model):
    model, _ = demo_model
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert install_cpu_ops(model) == []


def test_install_keeps_mlx_module_when_check_fails(monkeypatch, demo_model, caplog):
    from mlxkv import cpu_ops
    model, _ = demo_model
    monkeypatch.setattr(cpu_ops, "_rope_matches", lambda *a: False)
    swapped = install_cpu_ops(model, 512)
    assert not any(isinstance(m, TableRoPE) for _, m in model.named_modules())
    assert any("differ" in r.message for r in caplog.records)
    assert swapped and all(isinstance(m, CompiledRMSNorm) for name, m in model.named_modules() if name in swapped)


def test_mlxkv_load_installs_them_on_the_cpu():
    from mlxkv.models import load

    loaded = load(None, progress=False)
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    assert TableRoPE in kinds and CompiledRMSNorm in kinds
    assert nn.RoPE not in kinds and nn.RMSNorm not in kinds


def test_flag_off_keeps_mlx_modules(monkeypatch, demo_model):
    from mlxkv.env import reload

    monkeypatch.setenv("MLXKV_CPU_OPS", "0")
    reload()
    model, _ = demo_model
    assert install_cpu_ops(model) == []
    assert not any(isinstance(m, (TableRoPE, CompiledRMSNorm)) for _, m in model.named_modules())


# -- causal attention by query blocks ------------------------------------------------------------------------


@pytest.mark.parametrize("length,prefix", [(128, 0), (200, 0), (150, 77), (257, 300)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_blocked_causal_attention_matches_mlx_sdpa(length, prefix, with_sinks):
    from mlxkv.cpu_ops import causal_attention

    q = _random((1, 6, length, 32), 10)  # 6 query heads over 2 KV heads
    k, v = _random((1, 2, prefix + length, 32), 11), _random((1, 2, prefix + length, 32), 12)
    sinks = _random((6,), 13) if with_sinks else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal", sinks=sinks)
    got = causal_attention(q, k, v, 0.2, sinks)
    assert got.shape == want.shape
    # the same softmax over the same visible keys; only the sums' rounding differs (float32 outputs of size ~1)
    assert mx.abs(got - want).max().item() < 1e-5


def test_blocked_causal_attention_is_used_for_long_chunks_on_the_cpu_only(monkeypatch):
    from mlxkv import cpu_ops
    from mlxkv.env import reload
    from mlxkv.kv.layouts.dense_attention import attend

    calls = []
    monkeypatch.setattr(cpu_ops, "causal_attention", lambda *a: calls.append(a[0].shape[2]) or a[0])
    monkeypatch.setattr("mlxkv.kv.layouts.dense_attention.causal_attention", cpu_ops.causal_attention)
    k = v = _random((1, 2, 200, 16), 14)
    attend(_random((1, 2, 200, 16), 15), k, v, 0.25, "causal")
    attend(_random((1, 2, 2 * cpu_ops.CAUSAL_BLOCK - 1, 16), 16), k, v, 0.25, "causal")  # one block: MLX's call
    attend(_random((1, 2, 200, 16), 17), k, v, 0.25, None)  # not causal
    assert calls == [200]
    monkeypatch.setenv("MLXKV_CPU_OPS", "0")
    reload()
    attend(_random((1, 2, 200, 16), 18), k, v, 0.25, "causal")
    assert calls == [200]
    monkeypatch.delenv("MLXKV_CPU_OPS")
    reload()
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    attend(_random((1, 2, 200, 16), 19), k, v, 0.25, "causal")
    assert calls == [200]
