"""Dispatch: mode selection, the runtime self-check, and its fallback with an injected bad kernel."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

from mlxkv.env import reload as reload_flags

from mlxkv.kernels import (
    KernelDispatch,
    kv_write_reference,
    paged_attention,
    paged_attention_reference,
)
from mlxkv.kernels.dispatch import DEFAULT_DISPATCH, AttentionClass
from mlxkv.kernels.paged_attention_ref import REFERENCE
from mlxkv.kernels.selfcheck import random_paged_case


def case(dtype=mx.float32):
    return random_paged_case(dtype=dtype, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[70, 5, 33], sinks=True, seed=11)


class ScaledKernel:
    """A kernel-shaped object: the reference with its score scale multiplied by ``factor``.

    ``factor=1`` is a correct kernel; anything else is a deliberately wrong one.
    """

    name = "fake-metal"

    def __init__(self, factor=1.0):
        self.factor = factor
        self.calls = 0

    def partials(self, *args, scale, **kwargs):
        self.calls += 1
        return REFERENCE.partials(*args, scale=scale * self.factor, **kwargs)

    def merge(self, *args):
        return REFERENCE.merge(*args)


class Factory:
    def __init__(self, kernel):
        self.kernel, self.keys = kernel, []

    def __call__(self, dtype, head_dim, block_size, kv_heads, gqa):
        self.keys.append((dtype, head_dim, block_size, kv_heads, gqa))
        return self.kernel


def dispatch_with(kernel, mode="auto", metal=True):
    factory = Factory(kernel)
    return KernelDispatch(attention_factory=factory, metal_available=lambda: metal, mode=lambda: mode), factory


def test_cpu_default_picks_the_reference(monkeypatch):
    monkeypatch.delenv("MLXKV_PAGED_KERNEL", raising=False)
    reload_flags()
    c = case()
    assert not mx.metal.is_available()  # this suite runs on the CPU backend
    impl = DEFAULT_DISPATCH.attention_impl(AttentionClass(mx.float32, 64, 16, 2, 4, None, None, True))
    assert impl is REFERENCE
    want = paged_attention_reference(*c.args(), sinks=c.sinks)
    assert mx.array_equal(paged_attention(*c.args(), sinks=c.sinks), want).item()


def test_metal_mode_without_metal_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MLXKV_PAGED_KERNEL", "metal")
    reload_flags()
    c = case()
    with pytest.raises(RuntimeError, match="MLXKV_PAGED_KERNEL=metal but Metal is not available"):
        KernelDispatch().paged_attention(*c.args())


def test_bad_mode_value_is_a_value_error(monkeypatch):
    monkeypatch.setenv("MLXKV_PAGED_KERNEL", "cuda")
    with pytest.raises(ValueError, match="auto, metal, reference"):
        reload_flags()


def test_a_correct_kernel_passes_the_self_check_and_is_used():
    kernel = ScaledKernel(1.0)
    dispatch, factory = dispatch_with(kernel)
    c = case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dispatch.paged_attention(*c.args(), sinks=c.sinks)
    assert factory.keys == [(mx.float32, 64, 16, 2, 4)]
    calls_after_check = kernel.calls
    dispatch.paged_attention(*c.args(), sinks=c.sinks)
    assert kernel.calls == calls_after_check + 1  # used, and checked only once
    assert mx.allclose(out, paged_attention_reference(*c.args(), sinks=c.sinks), atol=1e-6, rtol=1e-6).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_wrong_kernel_warns_once_and_falls_back(dtype):
    kernel = ScaledKernel(1.05)  # 5% off in the score scale
    dispatch, factory = dispatch_with(kernel)
    c = case(dtype)
    want = paged_attention_reference(*c.args(), sinks=c.sinks)
    with pytest.warns(RuntimeWarning, match="disagrees with the reference"):
        out = dispatch.paged_attention(*c.args(), sinks=c.sinks)
    assert mx.array_equal(out, want).item()
    calls = kernel.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for the same shape class
        again = dispatch.paged_attention(*c.args(), sinks=c.sinks)
    assert kernel.calls == calls  # the bad kernel is never used for real
    assert mx.array_equal(again, want).item()
    # A new shape class (here: no sinks) is checked afresh.
    with pytest.warns(RuntimeWarning):
        dispatch.paged_attention(*c.args())
    assert len(factory.keys) == 2


def test_a_wrong_kernel_in_metal_mode_raises():
    dispatch, _ = dispatch_with(ScaledKernel(1.05), mode="metal")
    with pytest.raises(RuntimeError, match="disagrees with the reference"):
        dispatch.paged_attention(*case().args())


def test_a_crashing_kernel_falls_back():
    class Crashing(ScaledKernel):
        def partials(self, *args, **kwargs):
            raise RuntimeError("metal compile error")

    dispatch, _ = dispatch_with(Crashing())
    c = case()
    with pytest.warns(RuntimeWarning, match="inf"):
        out = dispatch.paged_attention(*c.args())
    assert mx.array_equal(out, paged_attention_reference(*c.args())).item()


def test_uncovered_configuration_uses_the_reference():
    dispatch, factory = dispatch_with(None)
    c = case()
    assert mx.array_equal(dispatch.paged_attention(*c.args()), paged_attention_reference(*c.args())).item()
    assert len(factory.keys) == 1
    strict, _ = dispatch_with(None, mode="metal")
    with pytest.raises(RuntimeError, match="no Metal paged-attention kernel"):
        strict.paged_attention(*c.args())


def test_reference_mode_never_asks_the_factory():
    dispatch, factory = dispatch_with(ScaledKernel(2.0), mode="reference")
    c = case()
    assert mx.array_equal(dispatch.paged_attention(*c.args()), paged_attention_reference(*c.args())).item()
    assert factory.keys == []


@pytest.mark.parametrize("mode", ["auto", "metal", "reference"])
def test_kv_write_is_the_scatter_in_every_mode(mode):
    # No Metal KV-write kernel: MLX's scatter is O(rows) on a donated pool, a custom kernel O(pool).
    c = case()
    slots = mx.array([20, 47], dtype=mx.int32)
    rows = mx.random.normal((2, 2, 64))
    want = kv_write_reference(c.k_pages, c.v_pages, slots, rows, rows)
    dispatch = KernelDispatch(metal_available=lambda: True, mode=lambda: mode)
    got = dispatch.kv_write(c.k_pages, c.v_pages, slots, rows, rows)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))


def test_factories_return_none_without_metal():
    from mlxkv.kernels import metal

    assert metal.paged_attention_kernel(mx.float16, 128, 16, 8, 4) is None
    c = case()
    with pytest.raises(RuntimeError, match="no Metal paged-attention kernel"):
        metal.paged_attention_metal(*c.args())
    # What the factory would build on a Mac: one simdgroup count per GQA x head_dim, within limits.
    assert metal.simdgroups_for(4, 128) == 4 and metal.simdgroups_for(16, 256) == 1
    # Small heads take several keys per simdgroup step (>= 4 row elements per lane); head tiles keep
    # per-lane state at <= 8 floats each for q and acc (HT * D / LPK).
    assert [metal.lanes_per_key(d) for d in (32, 64, 96, 128, 256)] == [8, 16, 16, 32, 32]
    assert [metal.heads_per_threadgroup(g, d) for g, d in [(8, 128), (53, 32), (12, 96), (4, 256), (32, 64)]] == [
        2, 1, 1, 1, 2]
    assert metal.supports_attention(mx.bfloat16, 128, 16, 16) and not metal.supports_attention(mx.float16, 80, 16, 4)
    assert not metal.supports_attention(mx.float16, 128, 16, 17) and not metal.supports_attention(mx.float16, 128, 3, 1)


@pytest.mark.parametrize("bad", ["id-past-pool", "negative-id", "context-longer-than-table", "negative-length"])
def test_inconsistent_tables_are_refused_before_launch(bad):
    kernel = ScaledKernel(1.0)
    dispatch, _ = dispatch_with(kernel)
    c = case()
    tables, lens = c.block_tables.tolist(), c.context_lens.tolist()
    num_blocks, max_blocks = c.k_pages.shape[1], len(tables[0])
    if bad == "id-past-pool":
        tables[1][0] = num_blocks
    elif bad == "negative-id":
        tables[2][1] = -1
    elif bad == "context-longer-than-table":
        lens[0] = max_blocks * 16 + 1
    else:
        lens[1] = -4
    args = (c.queries, c.k_pages, c.v_pages, mx.array(tables, dtype=mx.int32), mx.array(lens, dtype=mx.int32))
    with pytest.raises(ValueError, match="block_tables row|context_lens"):
        dispatch.paged_attention(*args)
    assert kernel.calls == 0


def test_tables_are_checked_once_per_step(monkeypatch):
    # The layers of one step pass the same table arrays: one check (one sync), not one per layer.
    from mlxkv.kernels import dispatch as dispatch_module

    checks = []
    real = dispatch_module.check_table_contents
    monkeypatch.setattr(dispatch_module, "check_table_contents", lambda *a: checks.append(1) or real(*a))
    dispatch, _ = dispatch_with(ScaledKernel(1.0), mode="reference")
    c = case()
    for _layer in range(3):
        dispatch.paged_attention(*c.args())
    assert len(checks) == 1
    dispatch.paged_attention(c.queries, c.k_pages, c.v_pages, mx.array(c.block_tables), c.context_lens)
    assert len(checks) == 2  # a new table array is checked again


def test_self_check_covers_batches_of_eight_and_more():
    # MLX passes context_lens in device memory from 8 sequences: a kernel wrong only there must fail.
    from mlxkv.kernels.selfcheck import check_attention_impl

    class WrongFromEight(ScaledKernel):
        def partials(self, queries, *args, scale, **kwargs):
            factor = 2.0 if queries.shape[0] >= 8 else 1.0
            return REFERENCE.partials(queries, *args, scale=scale * factor, **kwargs)

    ok, err = check_attention_impl(WrongFromEight(), dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=2)
    assert not ok and err > 1e-3
    ok, _ = check_attention_impl(ScaledKernel(1.0), dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=2)
    assert ok
