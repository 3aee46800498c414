"""Decode projections: fused sibling projections (q/k/v, gate/up) and split LM heads give ``nn.Linear``'s outputs.

Whether a group is fused depends on the BLAS: the install-time check keeps a group separate unless its fused
products equal the separate ones bit for bit here (OpenBLAS and MLX's bundled BLAS differ on small shapes). The
mechanism tests below therefore force the check (``forced``) and compare within float32 rounding; the tests on a
loaded model check the real decision: whatever is fused, logits stay bit-equal.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx import nn

from mlxkv import decode_projections as fused_projections
from mlxkv.decode_projections import FUSED_MAX_ROWS, FusedLinear, install_decode_projections

pytestmark = pytest.mark.float_order


class _Attention(nn.Module):
    def __init__(self, dims: int, bias: bool):
        super().__init__()
        self.q_proj = nn.Linear(dims, 24, bias=bias)
        self.k_proj = nn.Linear(dims, 8, bias=bias)
        self.v_proj = nn.Linear(dims, 8, bias=bias)

    def __call__(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class _Block(nn.Module):
    def __init__(self, dims: int = 32, bias: bool = False):
        super().__init__()
        self.self_attn = _Attention(dims, bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(dims, 48, bias=False)
        self.mlp.up_proj = nn.Linear(dims, 48, bias=False)
        self.odd = nn.Module()  # widths differ: never fused
        self.odd.gate_proj = nn.Linear(dims, 8, bias=False)
        self.odd.up_proj = nn.Linear(dims + 1, 8, bias=False)


def _outputs(block, x):
    return [*block.self_attn(x), block.mlp.gate_proj(x), block.mlp.up_proj(x)]


@pytest.fixture()
def forced(monkeypatch):
    """Fuse and split whatever qualifies, whatever this BLAS rounds (the mechanism, not the install decision)."""
    monkeypatch.setattr(fused_projections, "_same_outputs", lambda members, fused: True)
    monkeypatch.setattr(fused_projections, "_split_matches", lambda module, twin: True)


def _close(a, b) -> bool:
    return a.shape == b.shape and mx.abs(a - b).max().item() <= 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, FUSED_MAX_ROWS, 40])
def test_whatever_is_fused_outputs_stay_bit_equal(bias, rows):
    block = _Block(bias=bias)
    mx.eval(block.parameters())
    x = mx.random.normal((rows, 1, 32), key=mx.random.key(rows))
    want = _outputs(block, x)
    install_decode_projections(block)
    assert type(block.odd.gate_proj) is nn.Linear
    for w, g in zip(want, _outputs(block, x)):
        assert g.shape == w.shape and mx.array_equal(g, w).item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, FUSED_MAX_ROWS, 40])
def test_fused_members_return_their_rows(forced, bias, rows):
    block = _Block(bias=bias)
    mx.eval(block.parameters())
    x = mx.random.normal((rows, 1, 32), key=mx.random.key(rows))
    want = _outputs(block, x)
    assert sorted(install_decode_projections(block)) == ["mlp.gate_proj/up_proj", "self_attn.q_proj/k_proj/v_proj"]
    assert isinstance(block.self_attn.k_proj, FusedLinear) and isinstance(block.mlp.up_proj, FusedLinear)
    assert type(block.odd.gate_proj) is nn.Linear  # widths differ: never fused
    for w, g in zip(want, _outputs(block, x)):
        if rows > FUSED_MAX_ROWS:  # prefill rows: each member's own rows, nn.Linear's very call
            assert g.shape == w.shape and mx.array_equal(g, w).item()
        else:
            assert _close(g, w)


def test_decode_rows_share_one_product_and_prefill_rows_do_not(forced, monkeypatch):
    block = _Block()
    install_decode_projections(block)
    products = []
    real = fused_projections.Fusion.product
    monkeypatch.setattr(fused_projections.Fusion, "product", lambda self, x: products.append(x.shape) or real(self, x))
    _outputs(block, mx.ones((2, 1, 32)))
    assert products == [(2, 1, 32), (2, 1, 32)]  # q/k/v once, gate/up once
    _outputs(block, mx.ones((2, 1, 32)))  # a new input array: a new product
    assert len(products) == 4
    _outputs(block, mx.ones((1, FUSED_MAX_ROWS + 1, 32)))  # a prefill chunk: each member its own rows
    assert len(products) == 4
    assert block.self_attn.q_proj._fusion._input is None  # nothing held between steps


def test_weights_are_views_of_one_array_and_parameters_count_once(forced):
    from mlx.utils import tree_flatten

    block = _Block()
    before = sum(p.size for _, p in tree_flatten(block.parameters()))
    install_decode_projections(block)
    assert sum(p.size for _, p in tree_flatten(block.parameters())) == before
    fusion = block.self_attn.q_proj._fusion
    assert fusion is block.self_attn.v_proj._fusion and fusion.weight.shape == (40, 32)


def test_a_group_that_differs_from_nn_linear_is_kept_separate(monkeypatch):
    block = _Block()
    monkeypatch.setattr(fused_projections, "_same_outputs", lambda members, fused: len(members) == 2)
    assert install_decode_projections(block) == ["mlp.gate_proj/up_proj"]
    assert type(block.self_attn.q_proj) is nn.Linear


def test_not_installed_off_the_cpu_or_with_the_flag_off(monkeypatch):
    from mlxkv.env import reload

    monkeypatch.setenv("MLXKV_CPU_OPS", "0")
    reload()
    assert install_decode_projections(_Block()) == []
    monkeypatch.delenv("MLXKV_CPU_OPS")
    reload()
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert install_decode_projections(_Block()) == []


def _greedy_logits(model, steps: int = 10) -> mx.array:
    """Greedy decode logits ``(steps, 1, vocab)`` of a fixed prompt, evaluated on the calling thread."""
    from mlxkv.kv import make_caches

    caches = make_caches(model)
    tokens, seen = mx.array([[5, 9, 13, 2, 7, 11, 3] * 5]), []
    for _ in range(steps):
        logits = model(tokens, cache=caches)[:, -1]
        seen.append(logits)
        tokens = mx.argmax(logits, axis=-1, keepdims=True)
    out = mx.stack(seen)
    mx.eval(out)
    return out


def _on_another_thread(model) -> mx.array:
    """:func:`_greedy_logits` on a thread other than the one that loaded ``model``, as the server's engine runs it:
    every weight must be evaluated already (MLX: "There is no Stream(cpu, N) in current thread" for a lazy one)."""
    outcome = []

    def run():
        try:
            outcome.append(_greedy_logits(model))
        except RuntimeError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert isinstance(outcome[0], mx.array), outcome[0]
    return outcome[0]


def _unfused(model) -> None:
    """Put plain ``nn.Linear`` projections back in place of ``model``'s fused ones (the same weights)."""
    from mlx.utils import tree_flatten, tree_unflatten

    plain = []
    for name, m in model.named_modules():
        if isinstance(m, FusedLinear):
            linear = nn.Linear(m.weight.shape[1], m.weight.shape[0], bias="bias" in m)
            linear.update(dict(tree_flatten({k: m[k] for k in ("weight", "bias") if k in m})))
            plain.append((name, linear))
    model.update_modules(tree_unflatten(plain))


def test_loaded_model_generates_the_same_logits_fused_and_unfused():
    """The demo model through ``mlxkv.models.load``, with what the install check fused on this BLAS, against the same
    weights with plain projections: greedy decode logits equal bit for bit (prefill rows run each member's own rows,
    decode rows the fused one), the loaded model running on another thread."""
    from mlxkv.models import load

    model = load(None, progress=False).model
    loaded = _on_another_thread(model)
    _unfused(model)
    assert mx.array_equal(_greedy_logits(model), loaded).item()


def test_a_loaded_model_with_fused_projections_runs_on_another_thread(forced):
    """Fused on any BLAS (the check forced): the fused weight views are evaluated at load, so the model runs on a
    thread other than the loader's (the server's engine thread), within float32 rounding of the plain model."""
    from mlxkv.models import load

    model = load(None, progress=False).model
    assert any(isinstance(m, FusedLinear) for _, m in model.named_modules())
    fused = _on_another_thread(model)
    _unfused(model)
    assert _close(_greedy_logits(model), fused)


@pytest.mark.parametrize("kind", ["embedding", "linear"])
def test_wide_projections_split_for_decode_rows(forced, kind, monkeypatch):
    from mlxkv.decode_projections import SplitEmbedding, SplitLinear

    monkeypatch.setattr(fused_projections, "SPLIT_ROWS", 100)
    model = nn.Module()
    model.embed_tokens = nn.Embedding(250, 32)
    model.lm_head = nn.Linear(32, 250, bias=False)
    model.narrow = nn.Linear(32, 199, bias=False)  # under two chunks: kept whole
    mx.eval(model.parameters())
    x = mx.random.normal((3, 1, 32), key=mx.random.key(3))
    wide = mx.random.normal((1, FUSED_MAX_ROWS + 1, 32), key=mx.random.key(4))

    def project(m, inputs):
        return m.embed_tokens.as_linear(inputs) if kind == "embedding" else m.lm_head(inputs)

    want, want_wide = project(model, x), project(model, wide)
    assert sorted(install_decode_projections(model)) == ["embed_tokens", "lm_head"]
    assert type(model.embed_tokens) is SplitEmbedding and type(model.lm_head) is SplitLinear
    assert type(model.narrow) is nn.Linear
    products = []
    monkeypatch.setattr(fused_projections._Split, "split_product",
                        lambda self, inputs, w, real=fused_projections._Split.split_product:
                        products.append(w.shape) or real(self, inputs, w))
    assert _close(project(model, x), want)
    assert products == [(250, 32)]
    assert mx.array_equal(project(model, wide), want_wide).item() and len(products) == 1  # prefill rows: one product
    assert mx.array_equal(model.embed_tokens(mx.array([[1, 249]])), model.embed_tokens.weight[mx.array([[1, 249]])]).item()
