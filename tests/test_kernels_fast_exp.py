"""The compiled base-2 exponential of the pure-MLX attention: accurate, exact where it must be, and guarded."""

from __future__ import annotations

import logging
import shutil

import mlx.core as mx
import pytest

from mlxkv.kernels import fast_exp


@pytest.fixture
def unchecked(monkeypatch):
    """A fresh process's state: the self-check runs again at the next use (restored after the test)."""
    monkeypatch.setattr(fast_exp, "_ready", None)


def exponents(n: int = 20000, seed: int = 0) -> mx.array:
    return -mx.random.uniform(0, 60, (n,), key=mx.random.key(seed))  # (n,) in (-60, 0]


def test_the_polynomial_matches_mx_power_uncompiled():
    """The math itself (run op by op, no compiler): within the self-check's bound of 2 ** x, 0 below -125."""
    x = mx.concatenate([exponents(), -mx.arange(0, 140, 0.25), mx.array([-mx.inf, -1e9])])
    p, bits = fast_exp._parts(x)
    got, want = p * bits.view(mx.float32), mx.power(2.0, x)
    assert mx.all(mx.abs(got - want) <= fast_exp.RELATIVE * want + fast_exp.ABSOLUTE).item()
    assert mx.all(mx.where(x < -125, got == 0, True)).item()


@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX compiles CPU kernels with g++")
def test_compiled_exp2_is_used_on_large_float32_inputs_and_is_accurate(unchecked):
    assert fast_exp.fast_exp2_ready()
    x = exponents().reshape(4, 5000)
    got = fast_exp.exp2(x)
    assert not mx.array_equal(got, mx.power(2.0, x))  # not the fallback: rounded differently somewhere
    want = mx.power(2.0, x)
    assert mx.all(mx.abs(got - want) <= fast_exp.RELATIVE * want).item()
    special = mx.concatenate([mx.array([-mx.inf, mx.nan, 0.0, -200.0]), mx.zeros(fast_exp.MIN_ELEMENTS)])
    out = fast_exp.exp2(special)
    assert out[0].item() == 0 and out[3].item() == 0 and out[2].item() == 1
    assert mx.isnan(out[1]).item()  # NaN stays NaN (a broken score is not hidden)


def test_small_large_and_half_precision_inputs_take_mx_power():
    small = exponents(fast_exp.MIN_ELEMENTS - 1)
    assert mx.array_equal(fast_exp.exp2(small), mx.power(2.0, small))
    large = exponents(fast_exp.MAX_ELEMENTS + 1)
    assert mx.array_equal(fast_exp.exp2(large), mx.power(2.0, large))
    half = exponents().astype(mx.float16)
    assert mx.array_equal(fast_exp.exp2(half), mx.power(2.0, half))


def test_a_failing_self_check_falls_back_with_a_warning(unchecked, monkeypatch, caplog):
    monkeypatch.setattr(fast_exp, "_exp2_compiled", lambda x: mx.power(2.0, x) * 1.001)  # 0.1% off
    with caplog.at_level(logging.WARNING, logger=fast_exp.__name__):
        assert not fast_exp.fast_exp2_ready()
    assert "disagrees" in caplog.text
    x = exponents()
    assert mx.array_equal(fast_exp.exp2(x), mx.power(2.0, x))


def test_a_build_error_falls_back_with_a_warning(unchecked, monkeypatch, caplog):
    def broken(x):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fast_exp, "_exp2_compiled", broken)
    with caplog.at_level(logging.WARNING, logger=fast_exp.__name__):
        assert not fast_exp.fast_exp2_ready()
    assert "no compiler" in caplog.text
    x = exponents()
    assert mx.array_equal(fast_exp.exp2(x), mx.power(2.0, x))


def test_disabled_compilation_keeps_mx_power(unchecked, monkeypatch):
    monkeypatch.setenv("MLX_DISABLE_COMPILE", "1")
    assert not fast_exp.fast_exp2_ready()


def test_no_compiler_keeps_mx_power(unchecked, monkeypatch):
    """Without g++ MLX would run the polynomial op by op (slower than mx.power): not used."""
    monkeypatch.setattr(fast_exp.sys, "platform", "linux")
    monkeypatch.setattr(fast_exp.shutil, "which", lambda name: None)
    assert not fast_exp.fast_exp2_ready()
