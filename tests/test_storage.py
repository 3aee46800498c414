"""The pool's storages behind one protocol: dense and paged storage answer every question of
:class:`mlxkv.kv.storage.Storage`, and a sequence's per-step calls go to the slots its storage gave it (the paged
sequence while it holds blocks, no-ops while it holds none)."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.config import KvCacheConfig
from mlxkv.kv.sequence import DenseSlots, Slots
from mlxkv.kv.storage import DenseStorage, Storage
from mlxkv.kv.storage_paged import PagedKVStorage
from mlxkv.kv.store import CachePool

B = 4
PROMPT = [(3 * i + 7) % 900 + 10 for i in range(18)]


def members(protocol: type) -> set[str]:
    """The public names a protocol class declares (methods, properties, annotated attributes)."""
    return {name for name in (*vars(protocol), *protocol.__annotations__) if not name.startswith("_")}


def paged_pool(model):
    return CachePool(model, max_sequences=3, backend="paged", kv_config=KvCacheConfig(backend="paged", block_size=B),
                     num_blocks=32)


def test_each_storage_answers_every_question_of_the_protocol(model):
    wanted = members(Storage)
    assert {"attach", "detach", "fork", "can_extend", "victim_for", "stats", "tier", "prefix_caching"} <= wanted
    for storage in (CachePool(model).storage, paged_pool(model).storage):
        assert sorted(name for name in wanted if not hasattr(storage, name)) == [], type(storage).__name__
    assert members(Slots) <= set(dir(DenseSlots))


def test_the_pool_delegates_to_its_storage(model):
    dense, paged = CachePool(model, max_sequences=2), paged_pool(model)
    assert isinstance(dense.storage, DenseStorage) and dense.paged is None and not dense.is_paged
    assert isinstance(paged.storage, PagedKVStorage) and paged.paged is paged.storage.paged and paged.is_paged
    assert dense.admission_cost(100) == 0 and dense.max_sequence_tokens() is None and dense.block_stats() == {}
    assert paged.admission_cost(9) == 3 and paged.free_capacity() == 31  # 32 blocks less the null block
    assert paged.block_stats()["kv_blocks"]["block_size"] == B


def test_a_preempted_sequence_holds_no_slots_until_it_resumes(model):
    pool = paged_pool(model)
    seq = pool.open(prompt=PROMPT)
    assert seq.slots is seq.paged and all(hasattr(seq.slots, name) for name in members(Slots))
    mx.eval(model(mx.array(PROMPT, dtype=mx.uint32)[None], cache=seq.caches))
    seq.commit()
    assert seq.num_committed == 18
    pool.preempt(seq.id)
    assert isinstance(seq.slots, DenseSlots) and seq.paged is None
    seq.feed([1, 2])  # nothing held: nothing to allocate
    assert seq.feed_placeholder() is None and seq.num_committed == 0 and seq.num_cached == 0
    pool.resume(seq.id, PROMPT)
    assert seq.slots is seq.paged and seq.num_cached == 17  # its verified blocks, and all but the last token
    pool.check_invariants()
