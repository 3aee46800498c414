"""Stored responses: what ``previous_response_id`` continues, kept in memory and in the KV cache.

A response created with ``store`` (the default) is kept here: its public object (``GET /v1/responses/{id}``), the
conversation it ends (its input and output as chat messages, without ``instructions``: the Responses API does not
carry them over) and the token ids whose KV the engine computed for it (its prompt and its output). At most
``max_responses`` are kept (the least recently used go first); ``DELETE`` drops one at once. Every entry belongs
to its tenant, the API key that created it together with its ``cache_salt``: another tenant asking for the id
gets a 404, as for an id that never existed.

**KV retention.** The blocks of a stored response (its prompt and its output) are retained in the paged pool at
priority ``priority`` for ``ttl_s`` seconds (the pool's retention: :mod:`mlxkv.kv.blocks.retention`), so the next
turn's prompt, which starts with them, is served from the cache while other traffic's blocks, at the default
priority 35, are evicted first. Retained blocks stay evictable like any cached block: when nothing of lower
priority is left the pool takes them too, and a later turn then recomputes what it lost.

The retained responses together hold at most ``kv_budget_bytes`` of KV. A continuation's retention covers its
parent's blocks (they are its prompt's start) and renews them, so a conversation is charged once, at its latest
turn's length: it keeps its retention while the total stays within the budget. A new conversation (no retained
parent) is retained only while the total stays within half the budget, so the conversations already retained keep
room to grow: a pool that retains a few conversations for good serves each of their turns from the cache, where
retaining every newcomer would have them evict one another (conversations taken in turn thrash any
least-recently-used order). A response refused retention is stored all the same, its blocks cached at the
default priority. Charges end with their TTL (the pool's priorities expire then too; a refused continuation's
parent stays charged until then, as its blocks stay retained). The budget is checked when a response starts, at
its prompt's length, and its charge set to prompt plus output when it ends.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxkv.engine.request import RetentionRange, RetentionSpec

#: Default retention priority of a stored response's blocks (the pool's default for other blocks is 35).
DEFAULT_PRIORITY = 80


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """How many responses are stored and how their KV is retained (``mlxkv serve --responses-*``).

    Attributes:
        max_responses: stored responses kept at most (least recently used dropped first).
        ttl_s: seconds a stored response's KV blocks keep their retention priority.
        kv_budget_bytes: the KV the retained responses may hold together (``None``: half the paged pool).
        priority: the retention priority of their blocks (0-100; the pool's default is 35).
    """

    max_responses: int = 1000
    ttl_s: float = 600.0
    kv_budget_bytes: int | None = None
    priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        if self.max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {self.max_responses}")
        if not self.ttl_s > 0:
            raise ValueError(f"the responses' KV TTL must be > 0 seconds, got {self.ttl_s}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 0:
            raise ValueError(f"the responses' KV budget must be >= 0 bytes, got {self.kv_budget_bytes}")
        if not 0 <= self.priority <= 100:
            raise ValueError(f"the responses' retention priority must be in 0-100, got {self.priority}")


def tenant_of(key: str, salt: str | None) -> str:
    """The owner of a stored response: its request's tenant (:func:`mlxkv.server.tenancy.request_tenant`'s name,
    hashed) and its ``cache_salt``."""
    return hashlib.sha256(f"{key}\0{salt or ''}".encode()).hexdigest()


@dataclass(slots=True)
class StoredResponse:
    """One stored response.

    Attributes:
        id: the response id.
        tenant: :func:`tenant_of` its request.
        salt: its ``cache_salt`` (a continuation's prompt is cached under the same one).
        body: the public response object.
        messages: the conversation it ends, as chat messages (without instructions).
        tokens: its prompt's and output's token ids (the KV the engine computed).
        text: ``tokens`` decoded (special tokens included), to check that a continuation's rendered prompt
            starts with it.
        holds_images: its input held images (not stored: it cannot be continued).
    """

    id: str
    tenant: str
    salt: str | None
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    holds_images: bool = False


class ResponseStore:
    """Stored responses and the KV-retention budget of their blocks (see the module docstring).

    Args:
        config: limits and retention.
        bytes_per_token: KV bytes one token holds in the paged pool (``None``: no paged pool, nothing retained).
        pool_bytes: the paged pool's KV bytes (the default budget is half of it).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, config: StoreConfig, bytes_per_token: float | None, pool_bytes: int | None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.bytes_per_token = bytes_per_token
        budget = config.kv_budget_bytes if config.kv_budget_bytes is not None else (pool_bytes or 0) // 2
        self.budget_bytes = budget if bytes_per_token else 0
        self._clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._charges: dict[str, tuple[int, float]] = {}  # response id -> (retained tokens, expiry)
        self._taken: dict[str, tuple[str, tuple[int, float]]] = {}  # running response -> its parent's charge

    def __len__(self) -> int:
        return len(self._responses)

    def __contains__(self, response_id: object) -> bool:
        """Whether a response ``response_id`` is stored, whichever tenant's."""
        return response_id in self._responses

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The tenant's stored response ``response_id`` (``None``: none, or another tenant's)."""
        stored = self._responses.get(response_id)
        if stored is None or stored.tenant != tenant:
            return None
        self._responses.move_to_end(response_id)
        return stored

    def put(self, stored: StoredResponse) -> None:
        """Keep ``stored`` (dropping the least recently used beyond ``max_responses``)."""
        self._responses[stored.id] = stored
        self._responses.move_to_end(stored.id)
        while len(self._responses) > self.config.max_responses:
            self._responses.popitem(last=False)

    def delete(self, response_id: str, tenant: str) -> bool:
        """Drop the tenant's stored response ``response_id``; whether there was one. Its blocks keep their
        retention until it expires (the pool's priorities cannot be lowered from here) and stay charged."""
        if self.get(response_id, tenant) is None:
            return False
        del self._responses[response_id]
        return True

    def retained_bytes(self) -> float:
        """KV bytes the unexpired retentions hold."""
        self._expire()
        return sum(tokens for tokens, _ in self._charges.values()) * (self.bytes_per_token or 0)

    def retain(self, response_id: str, tokens: int, parent: str | None) -> RetentionSpec | None:
        """The retention of a new stored response whose prompt has ``tokens`` tokens (continuing ``parent``'s
        conversation, whose charge it takes over when it was retained), or ``None`` when the budget cannot hold it:
        the whole budget for a retained conversation's continuation, half of it for a new conversation."""
        self._expire()
        if not self.bytes_per_token:
            return None
        others = sum(t for rid, (t, _) in self._charges.items() if rid != parent)
        limit = self.budget_bytes if parent in self._charges else self.budget_bytes / 2
        if (others + tokens) * self.bytes_per_token > limit:
            return None
        if parent in self._charges:
            self._taken[response_id] = (parent, self._charges.pop(parent))
        ttl = self.config.ttl_s
        self._charges[response_id] = (tokens, self._clock() + ttl)
        return RetentionSpec((RetentionRange(0, None, self.config.priority, ttl),), self.config.priority, ttl)

    def settle(self, response_id: str, tokens: int) -> None:
        """A retained response ended with ``tokens`` tokens of KV (prompt and output): its charge."""
        self._taken.pop(response_id, None)
        charge = self._charges.get(response_id)
        if charge is not None:
            self._charges[response_id] = (tokens, charge[1])

    def release(self, response_id: str) -> None:
        """A response that failed or was not stored: it charges nothing, and its parent's charge is back."""
        self._charges.pop(response_id, None)
        taken = self._taken.pop(response_id, None)
        if taken is not None:
            self._charges[taken[0]] = taken[1]

    def _expire(self) -> None:
        now = self._clock()
        for rid in [rid for rid, (_, expiry) in self._charges.items() if expiry <= now]:
            del self._charges[rid]
