"""The distributed launch: which mode, the group of ranks, sharding the model, and agreeing on a pool size.

``mlx.launch -n N --backend ring -- mlxkv serve --distributed tensor ...`` starts N copies of one command; each
calls :func:`start_group` (``mx.distributed.init``) and learns its rank. Tensor parallelism shards every attention
and MLP projection through mlx-lm's ``model.shard(group)``, so each rank keeps ``n_kv_heads / N`` KV heads and its
KV blocks are ``1/N`` of a single process's. Pipeline parallelism (:mod:`mlxkv.distributed.pipeline`) keeps a
contiguous range of the layers on each rank, so its KV blocks hold only its layers.
"""

from __future__ import annotations

from typing import Any

MODES = ("off", "tensor", "pipeline")


def check_mode(mode: str) -> str:
    """``mode`` if valid (ValueError naming the choices otherwise)."""
    if mode not in MODES:
        raise ValueError(f"--distributed must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def start_group(mode: str) -> Any:
    """The ``mx.distributed`` group of this launch for ``mode`` (``"tensor"`` or ``"pipeline"``).

    Raises:
        ValueError: an unknown mode, a launch of one rank (not started by ``mlx.launch``), or a group that could
            not form (a port of the ring in use, an unreachable peer).
    """
    import mlx.core as mx

    check_mode(mode)
    if not mx.distributed.is_available():
        raise ValueError("this MLX build has no distributed backend (mx.distributed.is_available() is False)")
    try:
        group = mx.distributed.init()
    except RuntimeError as exc:
        raise ValueError(f"the distributed group did not start: {_explained(str(exc))}") from None
    if group.size() < 2:
        raise ValueError(f"--distributed {mode} needs several ranks: start it with mlx.launch, e.g. "
                         f"'mlx.launch -n 2 --backend ring -- mlxkv serve --distributed {mode} ...'")
    return group


def _explained(message: str) -> str:
    """MLX's error from ``mx.distributed.init``, its errno spelled out (``[ring] Couldn't bind socket (error: 98)``
    names no cause), with the remedy for a ring port in use."""
    import errno
    import os
    import re

    found = re.search(r"\(error: (\d+)\)", message)
    if found is None:
        return message
    code = int(found.group(1))
    message = f"{message[:found.start()]}({os.strerror(code)}){message[found.end():]}"
    if code == errno.EADDRINUSE:
        message += ": a port of this launch's ring is taken; give mlx.launch another --starting-port"
    return message


def check_undistributed() -> None:
    """Refuse to run as N silent copies: a command started by ``mlx.launch`` without ``--distributed``.

    Raises:
        ValueError: this process is one of several ranks.
    """
    import os

    # mlx.launch sets these for its ring / JACCL / MPI ranks; reading them avoids initializing a group here.
    if any(os.environ.get(v) for v in ("MLX_RANK", "OMPI_COMM_WORLD_RANK")):
        raise ValueError("started by mlx.launch without --distributed: pass --distributed tensor or pipeline (every "
                         "rank would otherwise run the whole model alone)")


def shard_model(model: Any, group: Any, mode: str) -> None:
    """Shard ``model`` over ``group`` in place (tensor parallel: mlx-lm's ``model.shard``; pipeline: this rank's
    layers, :func:`mlxkv.distributed.pipeline.pipeline_model`).

    Raises:
        ValueError: the architecture has no tensor-parallel sharding in mlx-lm, or its heads do not divide the
            number of ranks (tensor); it cannot be split by layers (pipeline).
    """
    import mlx.core as mx

    check_mode(mode)
    if mode == "pipeline":
        from mlxkv.distributed.pipeline import pipeline_model

        pipeline_model(model, group)
        return
    n = group.size()
    if not hasattr(model, "shard"):
        raise ValueError(f"mlx-lm has no tensor-parallel sharding for this architecture "
                         f"({type(model).__module__}): it cannot run with --distributed tensor")
    layers = getattr(getattr(model, "model", model), "layers", [])
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        for name in ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads"):
            heads = getattr(attn, name, None)
            if isinstance(heads, int) and heads % n:
                what = "KV heads" if "kv" in name or "key_value" in name else "attention heads"
                raise ValueError(f"the model has {heads} {what} per layer, which {n} ranks do "
                                 f"not divide: launch a number of ranks that divides it")
    model.shard(group)
    mx.eval(model.parameters())  # each rank keeps only its slices


def agree_grow_blocks(grow_blocks: int, group: Any) -> int:
    """The growth chunk (blocks) of every rank's pool: the smallest of the ranks' own, so that every rank's pool
    grows at the same allocations and hands out the same block ids."""
    import mlx.core as mx

    every = mx.distributed.all_gather(mx.array([grow_blocks], dtype=mx.int64), group=group).tolist()
    return min(every)


def agree_num_blocks(num_blocks: int, bytes_per_block: int, group: Any, *, same_size: bool = True) -> int:
    """The pool size in blocks every rank can hold: the smallest of the ranks' own (each rank sizes its pool from
    its own memory and ``--kv-cache-budget``); block ids must mean the same page on every rank. ``same_size``:
    every rank's blocks must have the same size (tensor parallel; pipeline ranks may hold unequal layer counts).

    Raises:
        RuntimeError: ``same_size`` and the ranks' blocks differ in size (they do not run the same model and
            options).
    """
    import mlx.core as mx

    mine = mx.array([num_blocks, bytes_per_block], dtype=mx.int64)
    every = mx.distributed.all_gather(mine[None], group=group).tolist()  # (N, 2)
    sizes = {b for _, b in every}
    if same_size and len(sizes) > 1:
        raise RuntimeError(f"the ranks' KV blocks differ in size ({sorted(sizes)} bytes): every rank must run the "
                           "same model with the same options")
    return min(n for n, _ in every)
