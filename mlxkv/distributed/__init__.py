"""Serving and generating across machines on MLX's own distributed layer (``mlx.launch``, ``mx.distributed``).

Tensor parallelism: every rank holds its shard of the weights (mlx-lm's ``model.shard(group)``) and of the paged
KV pool (its KV heads). Rank 0 (the leader) runs HTTP, the scheduler and the block manager; every other rank (a
follower) runs no scheduler of its own: before each forward the leader sends it the pool changes it made since
the last one (open, feed, commit, preempt, fork, release ..., typed data applied by one function on every rank)
and the description of the forward it runs (prefill chunks or decode rows), over ``mx.distributed``. Block
ids, slot mappings and prefix hits are thus the same on every rank, and every rank writes its own heads of each
block; only the leader samples.

- :mod:`~mlxkv.distributed.group`: the launch (mode, group, sharding, the block count every rank agrees on);
- :mod:`~mlxkv.distributed.changes`: the pool changes a step makes, and :func:`apply_change`, which every rank
  applies them with;
- :mod:`~mlxkv.distributed.steps`: the message before each forward (changes, then the step every rank runs);
- :mod:`~mlxkv.distributed.channel`: one message per forward and the decode inputs, over ``all_sum``;
- :mod:`~mlxkv.distributed.watchdog`: a rank that stops answering ends the process with a clear error;
- :mod:`~mlxkv.distributed.leader_pool`: the leader's pool, each change applied and recorded for the followers;
- :mod:`~mlxkv.distributed.leader` / :mod:`~mlxkv.distributed.follower`: the two roles of ``mlxkv serve``;
- :mod:`~mlxkv.distributed.tier`: the secondary KV tier across ranks (each rank its shard; restores agreed by all).

See docs/distributed.md for the launch lines.
"""
