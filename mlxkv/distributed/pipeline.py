"""Pipeline parallelism: each rank keeps a contiguous range of the decoder layers and runs only those.

Rank ``r`` keeps layers ``[start_r, end_r)`` (:func:`split_layers`: contiguous, the first ranks take one more
when the layers do not divide evenly) and drops the others, so its weights, and the paged pool built from its
layers afterwards, hold only its share: its KV block bytes are its layers' part of a single process's.

The model's own forward and layer code run unchanged: the first and last layer a rank keeps are wrapped in a
:class:`PipelineStage`. The first one, on every rank but 0, replaces its input by the hidden state received from
the rank before (``mx.distributed.recv``); the last one sends its output to the rank after, then every rank
takes the last rank's output from one ``all_gather``, so every rank runs the final norm and LM head on the same
hidden state and holds the same logits (as mlx-lm's own ``pipeline()`` of deepseek_v2/v3 does). Every rank still
embeds the tokens (cheap; ranks above 0 discard it), which keeps the model's forward whole.

Ranks run one after another within a forward (loopback or a cable carries one hidden state per step and rank);
pipeline parallelism splits memory, not time, since mlxkv runs one forward at a time.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn


def split_layers(n_layers: int, n_ranks: int) -> list[range]:
    """Contiguous layer ranges, one per rank, sizes differing by at most one (the first ranks take the extra).

    Raises:
        ValueError: fewer layers than ranks (a rank would hold none).
    """
    if n_layers < n_ranks:
        raise ValueError(f"the model has {n_layers} layers, fewer than the {n_ranks} ranks of --distributed pipeline: "
                         "launch at most one rank per layer")
    base, extra = divmod(n_layers, n_ranks)
    out, start = [], 0
    for r in range(n_ranks):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class PipelineStage(nn.Module):
    """One decoder layer at a rank's boundary: receives its input from the rank before (``receive``), and/or
    sends its output to the rank after and gathers the last rank's (``finish``). Attributes the model reads on
    its layers (``use_sliding``, ``self_attn`` ...) are the wrapped layer's."""

    def __init__(self, block: nn.Module, group: Any, *, receive: bool, finish: bool):
        super().__init__()
        self.block = block
        self._group = group
        self._receive = receive
        self._finish = finish

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key.startswith("_") or "block" not in self:
                raise
            return getattr(self["block"], key)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        group = self._group
        rank, size = group.rank(), group.size()
        if self._receive:
            received = mx.distributed.recv_like(h, rank - 1, group=group)  # (B, L, D): the previous rank's output
            # after the discarded input all the same: it holds the collectives every rank runs before the layers
            # (the decode inputs' all_sum), which must run here too, in the same order
            h = mx.depends(received, h)
        h = self.block(h, *args, **kwargs)  # (B, L, D)
        if self._finish:
            if rank < size - 1:
                h = mx.distributed.send(h, rank + 1, group=group)
            b = h.shape[0]
            # every rank's last output, stacked; the last rank's is the model's (an exact copy on every rank)
            h = mx.distributed.all_gather(h, group=group)[(size - 1) * b : size * b]  # (N*B, L, D) -> (B, L, D)
        return h


def _inner(model: Any) -> Any:
    """The module that holds ``layers`` and runs them in its forward (``model.model`` for mlx-lm's text models)."""
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), list):
        return inner
    raise ValueError(f"--distributed pipeline needs a model whose decoder layers are a list at model.model.layers "
                     f"({type(model).__module__} has none)")


def pipeline_model(model: Any, group: Any) -> range:
    """Keep this rank's layers of ``model`` (in place) and wire the hidden state between ranks; returns the range
    of the model's layers this rank now runs.

    Raises:
        ValueError: the architecture's layers are not a plain list, it already splits itself (mlx-lm
            ``pipeline()``), or it has fewer layers than ranks.
    """
    inner = _inner(model)
    if hasattr(inner, "pipeline") or hasattr(model, "pipeline"):
        raise ValueError(f"{type(model).__module__} has its own mlx-lm pipeline split, which the paged pool does not "
                         "run: use --distributed tensor")
    mine = split_layers(len(inner.layers), group.size())[group.rank()]
    layers = inner.layers[mine.start : mine.stop]
    first, last = layers[0], layers[-1]
    receive = group.rank() > 0
    if len(layers) == 1:
        layers[0] = PipelineStage(first, group, receive=receive, finish=True)
    else:
        layers[0] = PipelineStage(first, group, receive=receive, finish=False)
        layers[-1] = PipelineStage(last, group, receive=False, finish=True)
    inner.layers = layers
    _slice_layer_indices(inner, mine)
    # read by mlxkv's prefill: a forward whose caches alone are evaluated would skip this rank's send (and the
    # next rank would wait for it), so every forward's output is evaluated
    model.eval_outputs = True
    mx.eval(model.parameters())
    return mine


def _slice_layer_indices(inner: Any, mine: range) -> None:
    """Per-layer bookkeeping some models keep beside ``layers`` (mlx-lm llama: ``layer_types`` and the index of
    the first full / sliding layer, whose cache makes each mask), restated for this rank's slice."""
    types = getattr(inner, "layer_types", None)
    if isinstance(types, list) and len(types) > mine.stop - 1:
        types = inner.layer_types = types[mine.start : mine.stop]
        if hasattr(inner, "fa_idx"):
            # a rank with no full-attention layer never reads the full mask: any index of its caches will do
            inner.fa_idx = types.index("full_attention") if "full_attention" in types else 0
        if hasattr(inner, "swa_idx"):
            inner.swa_idx = types.index("sliding_attention") if "sliding_attention" in types else None
    if hasattr(inner, "num_hidden_layers"):
        inner.num_hidden_layers = len(mine)
