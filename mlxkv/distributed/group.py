"""The distributed launch: which mode, the group of ranks, sharding the model, and agreeing on a pool size.

``mlx.launch -n N --backend ring -- mlxkv serve --distributed tensor ...`` starts N copies of one command; each
calls :func:`start_group` (``mx.distributed.init``) and learns its rank. Tensor parallelism shards every attention
and MLP projection through mlx-lm's ``model.shard(group)``, so each rank keeps ``n_kv_heads / N`` KV heads and its
KV blocks are ``1/N`` of a single process's.
"""

from __future__ import annotations

from typing import Any

MODES = ("off", "tensor")


def check_mode(mode: str) -> str:
    """``mode`` if valid (ValueError naming the choices otherwise; ``pipeline`` is refused with the reason)."""
    if mode == "pipeline":
        raise ValueError("--distributed pipeline is not supported yet (mlx-lm 0.32's llama family has no pipeline "
                         "split, and the paged pool holds every layer): use --distributed tensor")
    if mode not in MODES:
        raise ValueError(f"--distributed must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def start_group(mode: str) -> Any:
    """The ``mx.distributed`` group of this launch for ``mode`` (``"tensor"``).

    Raises:
        ValueError: an unknown mode, or a launch of one rank (not started by ``mlx.launch``).
    """
    import mlx.core as mx

    check_mode(mode)
    if not mx.distributed.is_available():
        raise ValueError("this MLX build has no distributed backend (mx.distributed.is_available() is False)")
    group = mx.distributed.init()
    if group.size() < 2:
        raise ValueError(f"--distributed {mode} needs several ranks: start it with mlx.launch, e.g. "
                         "'mlx.launch -n 2 --backend ring -- mlxkv serve --distributed tensor ...'")
    return group


def check_undistributed() -> None:
    """Refuse to run as N silent copies: a command started by ``mlx.launch`` without ``--distributed``.

    Raises:
        ValueError: this process is one of several ranks.
    """
    import os

    # mlx.launch sets these for its ring / JACCL / MPI ranks; reading them avoids initializing a group here.
    if any(os.environ.get(v) for v in ("MLX_RANK", "OMPI_COMM_WORLD_RANK")):
        raise ValueError("started by mlx.launch without --distributed: pass --distributed tensor (every rank would "
                         "otherwise run the whole model alone)")


def shard_model(model: Any, group: Any, mode: str) -> None:
    """Shard ``model`` over ``group`` in place (tensor parallel: mlx-lm's ``model.shard``).

    Raises:
        ValueError: the architecture has no tensor-parallel sharding in mlx-lm, or its heads do not divide the
            number of ranks.
    """
    import mlx.core as mx

    check_mode(mode)
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
                raise ValueError(f"the model has {heads} {name.replace('_', ' ')} per layer, which {n} ranks do "
                                 f"not divide: launch a number of ranks that divides it")
    model.shard(group)
    mx.eval(model.parameters())  # each rank keeps only its slices


def agree_num_blocks(num_blocks: int, bytes_per_block: int, group: Any) -> int:
    """The pool size in blocks every rank can hold: the smallest of the ranks' own (each rank sizes its pool from
    its own memory and ``--kv-cache-budget``); block ids must mean the same page on every rank.

    Raises:
        RuntimeError: the ranks' blocks differ in size (they do not run the same model and options).
    """
    import mlx.core as mx

    mine = mx.array([num_blocks, bytes_per_block], dtype=mx.int64)
    every = mx.distributed.all_gather(mine[None], group=group).tolist()  # (N, 2)
    sizes = {b for _, b in every}
    if len(sizes) > 1:
        raise RuntimeError(f"the ranks' KV blocks differ in size ({sorted(sizes)} bytes): every rank must run the "
                           "same model with the same options")
    return min(n for n, _ in every)
