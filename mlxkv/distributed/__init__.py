"""Serving and generating across machines on MLX's own distributed layer (``mlx.launch``, ``mx.distributed``).

Tensor parallelism: every rank holds its shard of the weights (mlx-lm's ``model.shard(group)``) and of the paged
KV pool (its KV heads). Rank 0 (the leader) runs HTTP, the scheduler and the block manager; every other rank (a
follower) runs no scheduler of its own: it replays, in order, what the leader did to its pool (open, feed, commit,
preempt, fork, release ...) and the forwards it ran, received over ``mx.distributed`` before each forward. Block
ids, slot mappings and prefix hits are thus the same on every rank, and every rank writes its own heads of each
block; only the leader samples.

- :mod:`~mlxkv.distributed.group`: the launch (mode, group, sharding, the block count every rank agrees on);
- :mod:`~mlxkv.distributed.channel`: one message per forward (the plan) and the decode inputs, over ``all_sum``;
- :mod:`~mlxkv.distributed.watchdog`: a rank that stops answering ends the process with a clear error;
- :mod:`~mlxkv.distributed.journal`: the leader's pool, recording every operation for the followers;
- :mod:`~mlxkv.distributed.leader` / :mod:`~mlxkv.distributed.follower`: the two roles of ``mlxkv serve``;
- :mod:`~mlxkv.distributed.tier`: the secondary KV tier across ranks (each rank its shard; restores agreed by all).

See docs/distributed.md for the launch lines.
"""
