"""Where a :class:`~mlxkv.kv.store.CachePool` keeps its sequences' K/V: the :class:`Storage` protocol and its dense
implementation (the paged one is :class:`mlxkv.kv.storage_paged.PagedKVStorage`).

The pool owns the sequences (ids, ``max_sequences``, preemption marks); a storage gives each one its layer caches
and its per-step slots (:class:`mlxkv.kv.sequence.Slots`), and answers every question about room, sharing and the
prefix cache. Dense storage has no blocks: everything fits, nothing is shared, nothing is cached. The secondary
tier's I/O is a storage's :attr:`Storage.tier` (:class:`TierIO`): the paged storage's tier bridge, else
:data:`NO_TIER`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence as Tokens
from typing import TYPE_CHECKING, Any, Callable, Protocol

from mlxkv.kv.sequence import DenseSlots, Sequence

if TYPE_CHECKING:
    from mlxkv.kv.blocks.cache_request import CacheRequest
    from mlxkv.kv.blocks.events import EventBatch


class TierIO(Protocol):
    """The secondary tier's I/O as the engine drives it between steps (:class:`mlxkv.kv.tier.bridge.TierBridge`)."""

    def due_in(self) -> float | None: ...

    def ready(self, prompt: Tokens[int], cache_request: CacheRequest) -> bool: ...

    def wait_reads(self, timeout: float) -> None: ...

    def persist(self) -> int: ...

    def flush(self, timeout: float) -> dict | None: ...


class NoTier:
    """No secondary tier: nothing is ever due, read or written."""

    def due_in(self) -> None:
        return None

    def ready(self, prompt: Tokens[int], cache_request: CacheRequest) -> bool:
        return True

    def wait_reads(self, timeout: float) -> None:
        pass

    def persist(self) -> int:
        return 0

    def flush(self, timeout: float) -> None:
        return None


NO_TIER = NoTier()


class Storage(Protocol):
    """What a :class:`~mlxkv.kv.store.CachePool` asks of its storage (module docstring)."""

    is_paged: bool
    paged: Any  # the PagedBackend (None: dense)
    tier: TierIO

    @property
    def prefix_caching(self) -> bool: ...

    @property
    def state_snapshots(self) -> bool: ...

    def check_overflow(self, overflow: Any) -> None: ...

    def attach(self, seq: Sequence, tokens: list[int] | None) -> None: ...

    def detach(self, seq: Sequence) -> None: ...

    def fork(self, parent: Sequence, children: list[Sequence]) -> None: ...

    def can_extend(self, seq: Sequence, num_tokens: int) -> bool: ...

    def victim_for(self, seq: Sequence) -> Sequence | None: ...

    def admission_cost(self, num_tokens: int) -> int: ...

    def free_capacity(self) -> int: ...

    def has_decode_headroom(self, num_sequences: int) -> bool: ...

    def max_sequence_tokens(self) -> int | None: ...

    def evict_cached(self, salt: str | None) -> int: ...

    def release_due_in(self) -> float | None: ...

    def release_unused(self) -> int: ...

    def kv_events(self, since: int) -> EventBatch | None: ...

    def block_map(self) -> dict | None: ...

    def stats(self) -> dict: ...

    def check_invariants(self, sequences: list[Sequence]) -> None: ...


class DenseStorage:
    """Per-sequence buffers from a cache factory: no blocks, so everything fits and nothing is shared or cached.

    Args:
        model: the mlx-lm model.
        factory: ``factory(model) -> list`` of layer caches (the plain caches).
        overflow_factory: ``overflow_factory(model, overflow=config)``: caches under a per-sequence budget policy
            (our layouts only; None: mlx-lm's caches, which have none).
        max_kv_size, kv_bits: the pool's caps, which an overflow policy must not combine with.
    """

    is_paged = False
    paged = None
    tier: TierIO = NO_TIER
    prefix_caching = False
    state_snapshots = False

    def __init__(self, model: Any, factory: Callable[[Any], list], overflow_factory: Callable[..., list] | None,
                 max_kv_size: int | None, kv_bits: int | None):
        self.model = model
        self.factory = factory
        self.overflow_factory = overflow_factory
        self.max_kv_size, self.kv_bits = max_kv_size, kv_bits

    def check_overflow(self, overflow: Any) -> None:
        policy = f"kv_overflow {overflow.policy}"
        if self.overflow_factory is None:
            raise ValueError(f"{policy} needs the mlxkv cache layout (mlx-lm's caches have no overflow policies)")
        if self.max_kv_size is not None:
            raise ValueError(f"{policy} and --max-kv-size both cap the context: use the overflow budget only")
        if self.kv_bits is not None and overflow.policy != "window":
            raise ValueError(f"{policy} keeps full-precision K/V: it does not combine with --kv-bits")
        self.overflow_factory(self.model, overflow=overflow)  # raises where the model's attention cannot (MLA)

    def attach(self, seq: Sequence, tokens: list[int] | None) -> None:
        seq.caches = (self.factory(self.model) if seq.overflow is None
                      else self.overflow_factory(self.model, overflow=seq.overflow))
        seq.slots = DenseSlots(seq)

    def detach(self, seq: Sequence) -> None:
        seq.caches = []  # drop our references so MLX can free the buffers

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        for child in children:
            child.caches = copy.deepcopy(parent.caches)
            child.slots = DenseSlots(child)

    def can_extend(self, seq: Sequence, num_tokens: int) -> bool:
        return True

    def victim_for(self, seq: Sequence) -> None:
        return None

    def admission_cost(self, num_tokens: int) -> int:
        return 0

    def free_capacity(self) -> int:
        return 0

    def has_decode_headroom(self, num_sequences: int) -> bool:
        return True

    def max_sequence_tokens(self) -> None:
        return None

    def evict_cached(self, salt: str | None) -> int:
        return 0

    def release_due_in(self) -> None:
        return None

    def release_unused(self) -> int:
        return 0

    def kv_events(self, since: int) -> None:
        return None

    def block_map(self) -> None:
        return None

    def stats(self) -> dict:
        return {}

    def check_invariants(self, sequences: list[Sequence]) -> None:
        pass
