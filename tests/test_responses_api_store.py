"""The stored responses of ``/v1/responses`` (mlxkv.server.responses_api.store): the retention budget, its TTL, a
continuation taking over its parent's charge, the bounded count and tenancy. Pure Python, a fake clock."""

from __future__ import annotations

import pytest

from mlxkv.server.responses_api.store import ResponseStore, StoredResponse, StoreConfig, tenant_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(rid: str, tenant: str = "t") -> StoredResponse:
    return StoredResponse(rid, tenant, None, {"id": rid}, [])


def test_new_conversations_take_half_the_budget_and_ttl_frees_it():
    clock = Clock()
    store = ResponseStore(StoreConfig(ttl_s=10, kv_budget_bytes=1000, priority=70), bytes_per_token=10,
                          pool_bytes=None, clock=clock)
    spec = store.retain("a", 30, None)
    assert spec.ranges[0].priority == 70 and spec.ranges[0].duration == 10 and spec.decode_priority == 70
    store.settle("a", 40)  # prompt and output: 400 bytes
    assert store.retain("b", 20, None) is None  # a newcomer: 400 + 200 > half the budget
    assert store.retain("c", 10, None) is not None  # 400 + 100 fits in half
    clock.now = 10.5
    assert store.retained_bytes() == 0  # both expired with their priorities
    assert store.retain("d", 50, None) is not None


def test_a_continuation_takes_over_its_parents_charge():
    store = ResponseStore(StoreConfig(kv_budget_bytes=1000), bytes_per_token=10, pool_bytes=None, clock=Clock())
    store.retain("turn1", 40, None)
    store.settle("turn1", 60)
    assert store.retain("turn2", 90, "turn1") is not None  # 900 alone: the parent's 600 are its prefix
    assert store.retained_bytes() == 900
    assert store.retain("other", 2, None) is None  # over half the budget: no newcomer
    store.settle("turn2", 95)
    assert store.retain("turn3", 101, "turn2") is None  # over the whole budget
    assert store.retained_bytes() == 950  # turn2's blocks stay retained (and charged) until their TTL
    assert store.retain("turn3", 96, "turn2") is not None
    store.release("turn3")  # it failed: turn2 is charged again
    assert store.retained_bytes() == 950


def test_default_budget_is_half_the_pool_and_nothing_without_one():
    assert ResponseStore(StoreConfig(), bytes_per_token=4, pool_bytes=4000).budget_bytes == 2000
    dense = ResponseStore(StoreConfig(), bytes_per_token=None, pool_bytes=None)
    assert dense.retain("a", 1, None) is None
    assert ResponseStore(StoreConfig(kv_budget_bytes=0), 4, 4000).retain("a", 1, None) is None


def test_count_bound_tenancy_and_delete():
    store = ResponseStore(StoreConfig(max_responses=2), None, None)
    for rid in ("a", "b", "c"):
        store.put(stored(rid))
    assert store.get("a", "t") is None and store.get("b", "t") and store.get("c", "t")
    assert store.get("b", "someone else") is None and not store.delete("b", "someone else")
    assert store.delete("b", "t") and store.get("b", "t") is None
    assert tenant_of("k", None) != tenant_of("k2", None) != tenant_of("k", "salt")


@pytest.mark.parametrize("bad", [{"max_responses": 0}, {"ttl_s": 0}, {"kv_budget_bytes": -1}, {"priority": 101}])
def test_config_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        StoreConfig(**bad)
