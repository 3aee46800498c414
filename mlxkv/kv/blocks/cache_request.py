""":class:`CacheRequest`: what one request asks of the KV cache, carried whole from the engine to the block
manager (and copied whole to a forked child, and reused whole by a resume)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """One sequence's cache settings, fixed for its whole life.

    Attributes:
        salt: cache salt: sequences with different salts never share blocks.
        spans: ``(start, end, key)`` token ranges whose blocks get ``key`` in their hash (per-range salts).
        snapshot_at: prompt positions (chat message ends) where models with recurrent layers also snapshot their
            state, at the last block boundary at or before each.
        retention: the block manager's ``RetentionConfig``: ranks the sequence's blocks for eviction.
        preemption_rank: ranks the sequence for preemption: the pool preempts lower ranks first.
        overflow: the sequence's :class:`mlxkv.config.KvOverflowConfig` (``None``: the pool's default).
    """

    salt: str | bytes | None = None
    spans: tuple = ()
    snapshot_at: tuple = ()
    retention: Any = None
    preemption_rank: int = 0
    overflow: Any = None

    def __post_init__(self) -> None:  # tuples, so that the request stays immutable and compares by value
        object.__setattr__(self, "spans", tuple(self.spans))
        object.__setattr__(self, "snapshot_at", tuple(self.snapshot_at))
