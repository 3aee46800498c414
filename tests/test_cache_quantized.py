"""Quantized storage (4/8-bit K/V) under every layout: exactly the quantize-dequantized K/V and attention over
them up to float32 rounding, mlx-lm's QuantizedKVCache logits for the standard layout, and within the documented
tolerance of dense."""

from functools import cache

import mlx.core as mx
import pytest
import testkit.cache_runs as cache_helpers
from mlx_lm.models import cache as mlx_cache
from mlx_lm.utils import _get_classes
from testkit.archs import _init_weights, get_config
from testkit.cache_runs import max_diff

from mlxkv.kv.layouts import (
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    install_attention_hook,
    make_caches,
)
from mlxkv.kv.layouts.dense_attention import quantized_attend

pytestmark = pytest.mark.float_order

PROMPT = [(i * 37 + 11) % 1000 + 3 for i in range(40)]
GROUP = 32
#: Head dims of the tiny test models are 16; quantization groups need >= 32.
WIDER = {"llama": {"hidden_size": 128}, "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 32},
         "llama4": {"head_dim": 32}}


@cache
def model_for(arch):
    config = get_config(arch)
    config.get("text_config", config).update(WIDER[arch])
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _init_weights(model, 0)
    mx.eval(model.parameters())
    install_attention_hook(model)
    return model


def run(model, caches, feed=None, steps=24):
    return cache_helpers.run(model, caches, PROMPT, feed=feed, steps=steps)


def fake_quant(layout, bits):
    """A dense layout that stores quantize-then-dequantize rows: the exact meaning of a quantized cache."""

    class FakeQuant(layout):
        def update_and_fetch(self, keys, values):
            def rt(x):
                return mx.dequantize(*mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits)
            return super().update_and_fetch(rt(keys), rt(values))

    return FakeQuant


def fake_quant_caches(model, bits):
    out = []
    for c in make_caches(model):
        if isinstance(c, RotatingKVCache):
            out.append(fake_quant(RotatingKVCache, bits)(c.max_size, c.keep))
        elif isinstance(c, ChunkedKVCache):
            out.append(fake_quant(ChunkedKVCache, bits)(c.chunk_size))
        else:
            out.append(fake_quant(KVCache, bits)())
    return out


EPS = float(mx.finfo(mx.float32).eps)  # 1.19e-7


def same_mask(a, b) -> bool:
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.shape == b.shape and mx.array_equal(a, b).item()
    return a is None and b is None or isinstance(a, str) and a == b


def rounding_bound(q, k, v, mask, out) -> mx.array:
    """First-order float32 rounding bound, per query row ``(B, n_q, L, 1)``, on how far two attention computations
    over the same ``q`` (already scaled) and dequantized K/V ``(B, n_kv, K, D)`` can differ when they order their
    sums and dequantize differently (eps = 1.2e-7; |x|_1 and |x|_inf over head_dim):

    - a score sums D products, and a value dequantized on the fly (scale * w + bias, |scale * w| + |bias| about
      3 times the row's largest value at most) rounds once more: |ds_j| <= (D + 3) eps |q|_1 |k_j|_inf;
    - score errors move the output by sum_j p_j ds_j (v_j - o), at most sum_j p_j |ds_j| (|v_j|_inf + |o|_inf);
    - the weighted sum of K values and the softmax's sum of K weights add (2K + 4) eps, the values' dequantize
      3 eps, times sum_j p_j |v_j|_inf."""
    B, n_q, L, D = q.shape
    n_kv, K = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    qg = q.reshape(B, n_kv, rep, L, D)
    scores = qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # (B, n_kv, rep, L, K)
    if isinstance(mask, str):
        mask = mx.arange(K - L, K)[:, None] >= mx.arange(K)[None]  # "causal": (L, K)
    if mask is not None:
        assert mask.dtype == mx.bool_, "the layouts' make_mask gives boolean masks"
        scores = mx.where(mask, scores, -mx.inf)
    p = mx.softmax(scores, axis=-1, precise=True)  # (B, n_kv, rep, L, K)
    q1 = mx.abs(qg).sum(-1, keepdims=True)  # (B, n_kv, rep, L, 1)
    k_inf = mx.expand_dims(mx.abs(k).max(-1), (2, 3))  # (B, n_kv, 1, 1, K)
    v_inf = mx.expand_dims(mx.abs(v).max(-1), (2, 3))  # (B, n_kv, 1, 1, K)
    o_inf = mx.abs(out).max(-1, keepdims=True).reshape(B, n_kv, rep, L, 1)
    w = p * (D + 3) * EPS * q1 * k_inf  # p_j |ds_j|
    bound = (w * (v_inf + o_inf)).sum(-1) + (2 * K + 7) * EPS * (p * v_inf).sum(-1)  # (B, n_kv, rep, L)
    return bound.reshape(B, n_q, L, 1)


class Lockstep:
    """One layer's quantized cache under test next to the fake-quantized dense reference, fed the same K/V and
    queries. The model continues with the reference's attention output, so rounding in one layer never reaches
    the next layer's K/V: a rounding-level change there could move a value across a quantization step, a
    difference of a whole step (scale / 255 or / 15) rather than of rounding."""

    def __init__(self, ours, ref, checked):
        self.ours, self.ref, self.checked = ours, ref, checked

    def __getattr__(self, name):  # offset and anything else the model reads: the cache under test answers
        return getattr(self.ours, name)

    def make_mask(self, *args, **kwargs):
        mask = self.ours.make_mask(*args, **kwargs)
        assert same_mask(mask, self.ref.make_mask(*args, **kwargs))
        return mask

    def update_and_fetch(self, keys, values):
        self.fetched = self.ours.update_and_fetch(keys, values)
        return self.ref.update_and_fetch(keys, values)

    def attend(self, queries, keys, values, scale, mask=None, sinks=None):
        ours_k, ours_v = self.fetched
        g, b = self.ours.group_size, self.ours.bits
        # Quantizing the same rows is deterministic, so the stored values equal the reference's bit for bit,
        # in the same order (ring order, chunk fronts dropped): a pure copy of the quantized values.
        assert mx.array_equal(mx.dequantize(*ours_k, group_size=g, bits=b), keys).item()
        assert mx.array_equal(mx.dequantize(*ours_v, group_size=g, bits=b), values).item()
        out = self.ref.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        got = self.ours.attend(queries, ours_k, ours_v, scale=scale, mask=mask, sinks=sinks)
        mx.eval(out, got)
        # mx.quantized_matmul and the BLAS matmul of dense attention sum in different orders (equal only by
        # chance under MLX's bundled reference BLAS): rounding apart, bounded by rounding_bound.
        diff, bound = mx.abs(got - out), rounding_bound(queries * scale, keys, values, mask, out)
        self.checked.append(((diff <= bound).all().item(), (diff / mx.maximum(bound, 1e-30)).max().item()))
        return out


@pytest.mark.parametrize("arch", list(WIDER))
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_layouts_attend_exactly_the_quantized_values(arch, bits):
    """Rotating (gemma3, past its window) and chunked (llama4, across chunks) included."""
    model = model_for(arch)
    checked = []
    caches = [Lockstep(ours, ref, checked) for ours, ref in
              zip(make_caches(model, kv_bits=bits, kv_group_size=GROUP), fake_quant_caches(model, bits))]
    run(model, caches)
    assert len(checked) == (1 + 24) * len(caches)  # every layer at the prefill and at each decode step
    assert all(ok for ok, _ in checked), f"up to {max(r for _, r in checked):.3g} x the rounding bound"


def test_standard_layout_matches_mlx_lm_quantized_cache():
    model = model_for("llama")
    ref_caches = [c.to_quantized(group_size=GROUP, bits=8) for c in mlx_cache.make_prompt_cache(model)]
    ref, fed = run(model, ref_caches)
    ours_caches = make_caches(model, kv_bits=8, kv_group_size=GROUP)
    assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in ours_caches)
    ours, _ = run(model, ours_caches, feed=fed)
    assert max_diff(ours, ref) <= 1e-5


def test_8bit_model_tolerance_vs_dense():
    """Documented: 8-bit logits within 5% of the logit range of the dense cache on the tiny test models
    (random weights make attention sharp, which amplifies K/V rounding), greedy tokens mostly unchanged."""
    model = model_for("llama")
    dense, fed = run(model, make_caches(model))
    q8, _ = run(model, make_caches(model, kv_bits=8, kv_group_size=GROUP), feed=fed)
    scale = max(mx.abs(x).max().item() for x in dense)
    assert max_diff(q8, dense) <= 0.05 * scale
    assert sum(mx.argmax(x).item() == t for x, t in zip(q8, fed)) >= 0.9 * len(fed)


@pytest.mark.parametrize("bits,tol", [(8, 1e-2), (4, 1e-1)])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "none"])
def test_quantized_attention_tolerance(bits, tol, mask_kind):
    """Documented tolerance at the attention level (unit-normal K/V, head_dim 64, GQA 4:1, sinks):
    8-bit within 1e-2 of dense attention, 4-bit within 1e-1; and equal to attention over the
    dequantized K/V."""
    k0, k1, k2 = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((1, 8, 5, 64), key=k0)  # (B, n_q, L, D)
    k = mx.random.normal((1, 2, 200, 64), key=k1)  # (B, n_kv, K, D)
    v = mx.random.normal((1, 2, 200, 64), key=k2)
    causal = mx.arange(195, 200)[:, None] >= mx.arange(200)[None]  # (L, K)
    mask = {"causal": "causal", "bool": causal, "none": None,
            "additive": mx.where(causal, 0.0, -1e9)[None, None]}[mask_kind]  # (1, 1, L, K)
    sinks = mx.linspace(-1.0, 1.0, 8)
    qk = tuple(mx.quantize(k, group_size=64, bits=bits))
    qv = tuple(mx.quantize(v, group_size=64, bits=bits))
    out = quantized_attend(q, qk, qv, 0.125, mask, sinks, bits, 64)
    dense = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    dq = [mx.dequantize(*x, group_size=64, bits=bits) for x in (qk, qv)]
    exact = mx.fast.scaled_dot_product_attention(q, *dq, scale=0.125, mask=mask, sinks=sinks)
    assert mx.abs(out - dense).max().item() <= tol
    assert mx.allclose(out, exact, atol=1e-5).item()


def test_quantized_bytes_per_row():
    kv = mx.ones((1, 2, 10, 64))
    dense, q8, q4 = KVCache(), QuantizedKVCache(bits=8, group_size=32), QuantizedKVCache(bits=4, group_size=32)
    for c in (dense, q8, q4):
        c.update_and_fetch(kv, kv)
    # per element: 32 bits dense; 8 or 4 bits + a float32 scale and bias per 32 elements
    assert q8.nbytes / dense.nbytes == pytest.approx((8 + 64 / 32) / 32)
    assert q4.nbytes / dense.nbytes == pytest.approx((4 + 64 / 32) / 32)


def test_bad_quantization_settings():
    with pytest.raises(ValueError, match="kv_bits"):
        QuantizedKVCache(bits=5)
    with pytest.raises(ValueError, match="kv_group_size"):
        QuantizedKVCache(bits=8, group_size=48)
    with pytest.raises(ValueError, match="head_dim 16"):
        QuantizedKVCache(bits=8, group_size=32).update_and_fetch(mx.ones((1, 1, 2, 16)), mx.ones((1, 1, 2, 16)))
