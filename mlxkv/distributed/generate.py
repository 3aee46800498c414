"""``mlxkv generate --distributed tensor|pipeline`` under ``mlx.launch``: every rank runs the same generation on its
shard.

One sequence has no scheduler and no wall-clock decision, so every rank runs the very same code: the same prompt,
the same pool operations, the same forwards (their collectives meet), and the same logits (tensor parallel sums
each layer's output on every rank; pipeline parallel gathers the last rank's hidden state to every rank), hence
the same tokens. Sampling draws from one seed chosen by rank 0.
Only rank 0 prints the text.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from mlxkv.distributed.group import (
    check_mode,
    check_undistributed,
    shard_model,
    start_group,
)


class GenerateRanks:
    """The group of a distributed ``generate`` (``mode="off"``: a single process; refused under mlx.launch).

    Raises:
        ValueError: an unknown mode, ``--distributed`` without ``mlx.launch``, or ``mlx.launch`` without it.
    """

    def __init__(self, mode: str):
        self.mode = check_mode(mode)
        self.group = None
        if mode == "off":
            check_undistributed()
        else:
            self.group = start_group(mode)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    def shard(self, loaded: Any) -> None:
        """Keep this rank's shard of the loaded model (no-op alone)."""
        if self.group is not None:
            shard_model(loaded.model, self.group, self.mode)

    def seed(self, seed: int | None, sampled: bool) -> int | None:
        """The sampling seed every rank uses: ``seed``, or (sampling without one) one drawn by rank 0."""
        if self.group is None or seed is not None or not sampled:
            return seed
        import mlx.core as mx

        mine = int.from_bytes(os.urandom(4), "little") >> 1 if self.rank == 0 else 0
        return int(mx.distributed.all_sum(mx.array([mine], dtype=mx.int64), group=self.group).item())

    def quiet_followers(self) -> None:
        """Ranks above 0 print no text (their errors still reach stderr)."""
        if self.rank > 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
