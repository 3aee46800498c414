"""Projections arranged for decode rows on the CPU: sibling projections fused, very wide ones split.

A decode step of a small model on MLX's CPU backend is a few hundred ``(rows, K) x (K, N)`` products with one to
a few rows each, and BLAS spends a good part of each on its fixed costs (packing, thread hand-off): one product
over the concatenated weight rows of ``q_proj``, ``k_proj`` and ``v_proj`` costs less than the three (measured on
SmolLM2-135M's shapes with OpenBLAS: 0.18 against 0.28 ms, and 0.49 against 0.54 ms for gate/up). The opposite
holds for the LM head (49,152 x 576 there): four products over a quarter of its rows each take ~30% less than one
(:class:`SplitEmbedding`, :class:`SplitLinear`).

:func:`install_decode_projections` concatenates each group's weights (and biases) into one array and gives every
member a :class:`FusedLinear` whose weight is its own rows of that array (a view: no memory is added). With at
most :data:`FUSED_MAX_ROWS` input rows, the first member called with an input computes the whole group's product
and each member returns its columns of it; with more rows (a prefill chunk) each member multiplies by its own rows
alone, exactly as ``nn.Linear`` does. Each group's shapes are checked at install time: every member's output at
1 to :data:`FUSED_MAX_ROWS` rows must equal ``nn.Linear``'s bit for bit on this machine's BLAS, else the group is
left as it is. Nothing changes on a GPU, nor with ``MLXKV_CPU_OPS=0``.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

log = logging.getLogger("mlxkv.fused_projections")

#: Inputs of at most this many rows (decode batches, speculative verification) take the fused product.
FUSED_MAX_ROWS = 16

#: Sibling projections the models call with one input, by attribute name within their parent module.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

#: Row counts the install-time check compares at (the fused product's BLAS call varies with them).
_CHECK_ROWS = (1, 2, 3, 4, 8, FUSED_MAX_ROWS)

#: Weight rows per product of a split projection; projections of at least twice as many rows are split.
SPLIT_ROWS = 12288


class Fusion:
    """One group's concatenated weight ``(sum N_i, K)`` (and bias ``(sum N_i,)``), and its last product.

    The product of the last input is kept until every member has taken its columns, so the members called in
    turn with the same input array share one matmul.
    """

    def __init__(self, weight: mx.array, bias: mx.array | None, widths: list[int]):
        self.weight, self.bias = weight, bias
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.bounds = [(s, s + w) for s, w in zip(starts, widths)]
        self._input: mx.array | None = None
        self._product: mx.array | None = None
        self._taken: set[int] = set()

    def product(self, x: mx.array) -> mx.array:
        """``x @ weight.T (+ bias)``: ``(..., K) -> (..., sum N_i)``."""
        if self.bias is not None:
            return mx.addmm(self.bias, x, self.weight.T)
        return x @ self.weight.T

    def columns(self, x: mx.array, index: int) -> mx.array:
        """Member ``index``'s output for ``x`` ``(..., N_index)``, from the group's product of ``x``."""
        if x is not self._input or index in self._taken:
            self._input, self._product, self._taken = x, self.product(x), set()
        start, end = self.bounds[index]
        out = self._product[..., start:end]
        self._taken.add(index)
        if len(self._taken) == len(self.bounds):  # every member served: hold no arrays between steps
            self._input = self._product = None
        return out


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight (and bias) are its rows of a :class:`Fusion`'s arrays.

    Inputs of at most :data:`FUSED_MAX_ROWS` rows take the group's shared product; larger ones run
    ``nn.Linear``'s own matmul on this member's rows.
    """

    def __init__(self, fusion: Fusion, index: int):
        nn.Module.__init__(self)
        start, end = fusion.bounds[index]
        self.weight = fusion.weight[start:end]  # (N_index, K): a view of the fused rows
        if fusion.bias is not None:
            self.bias = fusion.bias[start:end]
        self._fusion, self._index = fusion, index

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] <= FUSED_MAX_ROWS:
            return self._fusion.columns(x, self._index)
        return super().__call__(x)


def _fusable(members: list[Any]) -> bool:
    if not all(type(m) is nn.Linear for m in members):
        return False
    first = members[0]
    return all(m.weight.shape[1] == first.weight.shape[1] and m.weight.dtype == first.weight.dtype
               and ("bias" in m) == ("bias" in first) for m in members)


def _fuse(members: list[nn.Linear]) -> list[FusedLinear]:
    weight = mx.concatenate([m.weight for m in members])  # (sum N_i, K)
    bias = mx.concatenate([m.bias for m in members]) if "bias" in members[0] else None
    mx.eval(weight, *([bias] if bias is not None else []))
    fusion = Fusion(weight, bias, [m.weight.shape[0] for m in members])
    fused = [FusedLinear(fusion, i) for i in range(len(members))]
    mx.eval([m.parameters() for m in fused])  # the views too: the engine's thread cannot run another's graph
    return fused


def _same_outputs(members: list[nn.Linear], fused: list[FusedLinear]) -> bool:
    """Bit equality of every fused member with its ``nn.Linear`` at each of :data:`_CHECK_ROWS` row counts."""
    dims = members[0].weight.shape[1]
    for rows in _CHECK_ROWS:
        x = mx.random.normal((rows, 1, dims), key=mx.random.key(rows)).astype(members[0].weight.dtype)
        for original, member in zip(members, fused):
            want, got = original(x), member(x)
            if want.shape != got.shape or not mx.array_equal(want, got).item():
                return False
    return True


class _Split:
    """Decode rows of a wide ``x @ weight.T`` as products over row chunks of ``weight``, concatenated."""

    def split_product(self, x: mx.array, weight: mx.array) -> mx.array:
        rows = weight.shape[0]
        parts = [x @ weight[start:start + SPLIT_ROWS].T for start in range(0, rows, SPLIT_ROWS)]  # (..., <= SPLIT_ROWS)
        return mx.concatenate(parts, axis=-1)  # (..., rows)


class SplitLinear(nn.Linear, _Split):
    """A bias-free ``nn.Linear`` (an LM head) whose decode rows take :meth:`split_product`."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] <= FUSED_MAX_ROWS:
            return self.split_product(x, self.weight)
        return super().__call__(x)


class SplitEmbedding(nn.Embedding, _Split):
    """An ``nn.Embedding`` whose ``as_linear`` (a tied LM head) takes :meth:`split_product` for decode rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] <= FUSED_MAX_ROWS:
            return self.split_product(x, self.weight)
        return super().as_linear(x)


def _split(module: Any) -> Any | None:
    """The split twin of a wide bias-free ``nn.Linear`` or ``nn.Embedding`` sharing its weight, else None."""
    if type(module) not in (nn.Linear, nn.Embedding) or "bias" in module:
        return None
    rows, dims = module.weight.shape
    if rows < 2 * SPLIT_ROWS:
        return None
    twin = SplitLinear(dims, rows, bias=False) if type(module) is nn.Linear else SplitEmbedding(rows, dims)
    twin.weight = module.weight
    if not _split_matches(module, twin):
        log.info("a split %s of %s rows differs from one product here; kept whole", type(module).__name__, rows)
        return None
    return twin


def _split_matches(module: Any, twin: Any) -> bool:
    """Bit equality of the split twin's decode rows with the original's at each of :data:`_CHECK_ROWS` row counts."""
    original = module.__call__ if type(module) is nn.Linear else module.as_linear
    project = twin.__call__ if type(twin) is SplitLinear else twin.as_linear
    for count in _CHECK_ROWS:
        x = mx.random.normal((count, 1, module.weight.shape[1]), key=mx.random.key(count)).astype(module.weight.dtype)
        if not mx.array_equal(project(x), original(x)).item():
            return False
    return True


def install_decode_projections(model: Any) -> list[str]:
    """On the CPU backend, fuse each module's ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
    (plain ``nn.Linear`` siblings with one input width) and split projections of at least ``2 * SPLIT_ROWS`` rows
    (LM heads, tied or not), where the results are bit-equal to the originals'; returns what was changed (nothing on
    a GPU or with ``MLXKV_CPU_OPS=0``)."""
    from mlxkv.env import flags

    if mx.default_device() != mx.cpu or not flags().cpu_ops:
        return []
    swaps, changed, checked = [], [], {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for names in GROUPS:
            members = [getattr(module, n, None) for n in names]
            if any(m is None for m in members) or not _fusable(members):
                continue
            fused = _fuse(members)
            key = (tuple(m.weight.shape for m in members), members[0].weight.dtype, "bias" in members[0])
            if key not in checked:
                checked[key] = _same_outputs(members, fused)
                if not checked[key]:
                    log.info("fused %s of shape %s differ from the separate products here; kept separate", names,
                             key[0])
            if checked[key]:
                swaps.extend((prefix + n, m) for n, m in zip(names, fused))
                changed.append(f"{prefix}{'/'.join(names)}")
        twin = _split(module) if name else None
        if twin is not None:
            swaps.append((name, twin))
            changed.append(name)
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return changed
