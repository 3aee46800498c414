"""What request preparation may know about the engine's KV store, read once before the engine thread starts.

The engine thread owns the pool (:class:`mlxkv.kv.CachePool` is not thread-safe): the server's routes, on the
event loop, never call it. What they need to validate a request — whether message ends are worth marking, the
default ``kv_overflow`` policy and which policies the store can run — is a :class:`PoolFacts`, captured by the
engine's constructor and immutable after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from mlxkv.config import KvOverflowConfig
from mlxkv.rules import KV_OVERFLOW_POLICIES

#: A budget every page size and sink count leaves room in: probing a policy must not trip the budget checks.
_PROBE_BUDGET = 1 << 16


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """The pool's request-independent answers, captured by :meth:`of`.

    Attributes:
        state_snapshots: positions marked with ``snapshot_at`` are used (paged, recurrent layers, prefix caching).
        default_overflow: the pool's own ``kv_overflow`` policy (``None``: preempt, the plain caches).
        block_size: tokens per page on the paged backend (a policy's budget must leave room for whole pages),
            ``None`` on the dense one.
        refusals: why the pool cannot run each capped policy it refuses, whatever its budget (absent: it can).
    """

    state_snapshots: bool = False
    default_overflow: KvOverflowConfig | None = None
    block_size: int | None = None
    refusals: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, pool: Any) -> "PoolFacts":
        """Ask ``pool`` (a :class:`mlxkv.kv.CachePool`, or a wrapper of one such as the distributed leader's)
        once, on the thread that owns it (before the engine thread starts): each capped policy is checked with a
        budget no page geometry refuses, so what it refuses is the store (backend, ``--kv-bits``,
        ``--max-kv-size``, the model's attention, ``--distributed``), not the numbers."""
        refusals: dict[str, str] = {}
        for policy in KV_OVERFLOW_POLICIES:
            if policy == "preempt":
                continue
            try:
                pool.check_overflow(KvOverflowConfig(policy=policy, budget=_PROBE_BUDGET))
            except Exception as exc:  # noqa: BLE001 - a store that cannot build a policy's caches refuses it
                refusals[policy] = str(exc) if isinstance(exc, ValueError) else f"kv_overflow {policy}: {exc}"
        paged = getattr(pool, "paged", None)
        return cls(state_snapshots=bool(pool.state_snapshots), default_overflow=getattr(pool, "overflow", None),
                   block_size=None if paged is None else int(paged.block_size),
                   refusals=MappingProxyType(refusals))

    def check_overflow(self, config: KvOverflowConfig) -> None:
        """What ``pool.check_overflow(config)`` says, from the captured facts (any thread).

        Raises:
            ValueError: the pool cannot run ``config`` (a capped policy), naming the conflict.
        """
        if self.block_size is not None:
            config.check_pages(self.block_size)
        refusal = self.refusals.get(config.policy)
        if refusal is not None:
            raise ValueError(refusal)
