"""The leader's plan for each forward, and the decode inputs, sent to every rank over ``mx.distributed``.

A message (:class:`~mlxkv.distributed.steps.StepMessage`: pool changes, then the step to run) is pickled to
bytes: its length, then its bytes as a ``uint8`` array, each an ``all_sum`` of the leader's values and zeros
elsewhere (MLX has no broadcast; a sum with zeros is exact). Pickle is safe here: every rank runs the same program
started by one ``mlx.launch``, and the group is not a network endpoint anyone else can write to. The decode inputs
travel inside the step's graph (:meth:`PlanChannel.share`), so the leader can build a step while the previous one
is still computing its tokens.
"""

from __future__ import annotations

import pickle
from typing import Any

import mlx.core as mx

from mlxkv.distributed.watchdog import Watchdog, fatal


class PlanChannel:
    """Messages from rank 0 to every rank of ``group``; each completed collective feeds ``watchdog``."""

    def __init__(self, group: Any, watchdog: Watchdog):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.watchdog = watchdog
        self.sent = 0  # messages sent (leader) or received (follower)
        self.bytes = 0
        self.tier_figures = None  # () -> [host blocks, disk blocks, restored blocks] of this rank's KV tier

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _sum(self, x: mx.array) -> mx.array:
        try:
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:  # MLX reports a lost TCP peer this way
            fatal(self.rank, f"the distributed group failed ({exc})")
        self.watchdog.beat()
        return out

    def send(self, message: Any) -> None:
        """Leader: ``message`` to every rank (blocks until they have it)."""
        assert self.is_leader, "only rank 0 sends plans"
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._sum(mx.array([len(payload)], dtype=mx.int64))
        self._sum(mx.array(memoryview(payload), dtype=mx.uint8))  # (n,)
        self.sent += 1
        self.bytes += len(payload)

    def receive(self) -> Any:
        """Follower: the next message from rank 0 (blocks until it comes)."""
        assert not self.is_leader, "rank 0 sends plans"
        n = int(self._sum(mx.zeros((1,), dtype=mx.int64)).item())
        data = self._sum(mx.zeros((n,), dtype=mx.uint8))
        self.sent += 1
        self.bytes += n
        return pickle.loads(bytes(memoryview(data)))

    def gather_memory(self) -> list[dict]:
        """Every rank's MLX memory, and its KV tier's blocks with a tier (all ranks call it at the same point of
        the plan): one dict per rank."""
        tier = self.tier_figures() if self.tier_figures is not None else [0, 0, 0]
        mine = mx.array([[mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(), *tier]],
                        dtype=mx.int64)
        try:
            every = mx.distributed.all_gather(mine, group=self.group)  # (N, 6)
            mx.eval(every)
        except RuntimeError as exc:
            fatal(self.rank, f"the distributed group failed ({exc})")
        self.watchdog.beat()
        out = []
        for r, (a, p, c, host, disk, restored) in enumerate(every.tolist()):
            out.append({"rank": r, "mlx_active_bytes": a, "mlx_peak_bytes": p, "mlx_cache_bytes": c})
            if self.tier_figures is not None:
                out[-1]["tier"] = {"memory_blocks": host, "disk_blocks": disk, "restored_blocks": restored}
        return out

    def agree(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether it is true on every rank (all ranks call it with as many flags)."""
        if not flags:
            return []
        total = self._sum(mx.array([int(f) for f in flags], dtype=mx.int32))  # (K,): ranks answering yes
        return [n == self.size for n in total.tolist()]

    def share(self, inputs: mx.array | None, shape: tuple[int, ...]) -> mx.array:
        """The leader's ``inputs`` (uint32 token ids of ``shape``) on every rank, lazily: the sum is part of the
        graph that uses it (followers pass None)."""
        local = inputs.astype(mx.int32) if self.is_leader else mx.zeros(shape, dtype=mx.int32)
        return mx.distributed.all_sum(local, group=self.group).astype(mx.uint32)
