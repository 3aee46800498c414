"""Block pool, free queue, eviction policies, retention expiry and the event buffer (pure Python)."""

import pytest

from mlxkv.kv.blocks.block import DEFAULT_PRIORITY, KVCacheBlock
from mlxkv.kv.blocks.block_pool import BlockPool, NoFreeBlocksError
from mlxkv.kv.blocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBuffer,
)
from mlxkv.kv.blocks.eviction import LFUPolicy, make_eviction_policy
from mlxkv.kv.blocks.free_queue import BucketedFreeQueue, FreeBlockQueue


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def ids(blocks):
    return [b.block_id for b in blocks]


def cache(pool, block, token, parent=None, group=0):
    """Cache a held block as a full block whose content is `token` repeated."""
    toks = (token,) * pool.block_size
    pool.cache_full_block(block, group_id=group, block_hash=("h", token), parent_hash=None,
                          parent_ref=parent, token_ids=toks, extra_keys=())


def test_free_queue_links_and_o1_remove():
    q = FreeBlockQueue()
    blocks = [KVCacheBlock(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 0, 1, 3, 4] and len(q) == 5
    assert q.popleft() is blocks[2]
    q.remove(blocks[4])
    assert ids(q) == [0, 1, 3] and blocks[4].prev_free is None and blocks[4].next_free is None
    with pytest.raises(AssertionError):
        q.remove(blocks[4])  # not linked any more


def test_bucketed_queue_orders_by_bucket_then_arrival():
    q = BucketedFreeQueue()
    b = [KVCacheBlock(i) for i in range(6)]
    q.push(b[0], 50)
    q.push(b[1], 10)
    q.push(b[2], 50)
    q.push(b[3], 10, front=True)
    q.push(b[4], -1)
    q.push(b[5], 80)
    assert ids(q) == [4, 3, 1, 0, 2, 5]
    assert q.bucket_sizes() == {-1: 1, 10: 2, 50: 2, 80: 1}
    q.remove(b[4])
    assert q.popleft() is b[3] and q.popleft() is b[1] and q.popleft() is b[0]
    assert len(q) == 2 and b[0].free_bucket is None


def test_allocation_order_and_exhaustion():
    pool = BlockPool(6, 4)
    assert pool.num_usable_blocks == 5 and pool.null_block.block_id == 0
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(3)
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    pool.free_blocks([a[2], a[1]])
    assert ids(pool.eviction_order()) == [3, 2]
    pool.check_invariants()


def test_lru_eviction_is_tail_first_and_revival_removes_from_queue():
    pool = BlockPool(8, 2)
    seq_a = pool.get_new_blocks(3)  # 1 2 3
    seq_b = pool.get_new_blocks(2)  # 4 5
    for i, b in enumerate(seq_a + seq_b):
        cache(pool, b, 10 + i)
    pool.free_blocks(seq_a[::-1])  # finished sequence: tail first
    pool.free_blocks(seq_b[::-1])
    # never-used blocks 6, 7 are reused before any cached block is evicted
    assert ids(pool.eviction_order()) == [6, 7, 3, 2, 1, 5, 4]
    pool.touch([seq_a[1]])  # prefix hit on block 2
    assert ids(pool.eviction_order()) == [6, 7, 3, 1, 5, 4]
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 3, 6, 7]  # the eviction order's first four, handed out by id (pages stay ascending)
    assert ids(pool.eviction_order()) == [5, 4]
    assert pool.num_evictions == 2 and not seq_a[0].cached and seq_a[1].cached
    assert pool.lookup(0, ("h", 10)) == [] and pool.lookup(0, ("h", 11)) == [seq_a[1]]
    pool.check_invariants()


def test_priority_policy_evicts_low_priority_first_then_lru():
    clock = FakeClock()
    pool = BlockPool(7, 2, eviction_policy="priority", clock=clock)
    blocks = pool.get_new_blocks(6)
    prios = [80, 20, 35, 20, 80, 35]
    for i, (b, p) in enumerate(zip(blocks, prios)):
        cache(pool, b, i)
        pool.set_retention(b, p, None, merge=False)
    pool.free_blocks(blocks)
    assert ids(pool.eviction_order()) == [2, 4, 3, 6, 1, 5]
    assert pool.stats().cached_by_priority == {20: 2, 35: 2, 80: 2}


def test_expired_priority_returns_to_default_and_goes_first_in_its_bucket():
    clock = FakeClock()
    pool = BlockPool(5, 2, eviction_policy="priority", clock=clock)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        cache(pool, b, i)
    pool.set_retention(blocks[0], 90, clock.t + 10.0, merge=False)  # block 1: 90 for 10 s
    pool.set_retention(blocks[1], 60, None, merge=False)  # block 2: 60 forever
    pool.free_blocks(blocks)
    assert ids(pool.eviction_order()) == [3, 4, 2, 1]
    clock.t += 10.0
    assert blocks[0].effective_priority(clock.t) == DEFAULT_PRIORITY
    assert ids(pool.eviction_order()) == [1, 3, 4, 2]
    assert pool.stats().cached_by_priority == {35: 3, 60: 1}
    assert ids(pool.get_new_blocks(1)) == [1]


def test_lfu_policy_keeps_frequently_hit_blocks():
    pool = BlockPool(4, 2, eviction_policy=LFUPolicy())
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        cache(pool, b, i)
    pool.free_blocks(blocks)
    for _ in range(3):
        pool.touch([blocks[0]])
        pool.free_blocks([blocks[0]])
    pool.touch([blocks[2]])
    pool.free_blocks([blocks[2]])
    assert ids(pool.eviction_order()) == [2, 3, 1]


def test_unknown_policy_names_the_options():
    with pytest.raises(ValueError, match="lru, priority, lfu"):
        make_eviction_policy("fifo")


def test_events_stored_removed_cleared():
    pool = BlockPool(3, 2, events=KVEventBuffer(16))
    a, b = pool.get_new_blocks(2)
    cache(pool, a, 1)
    cache(pool, b, 2, parent=a.ref)
    pool.free_blocks([b, a])
    pool.evict_cached(1)
    assert not b.cached and a.cached
    events = pool.events.drain()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert events[0].token_ids == (1, 1) and events[0].parent_block_hash is None
    assert events[2].block_hashes == (("h", 2),)
    held = pool.get_new_blocks(1)
    assert pool.reset_prefix_cache() is False  # a block is in use
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True and not a.cached
    assert isinstance(pool.events.drain()[-1], AllBlocksCleared)


def test_event_buffer_is_bounded_and_cursor_reads_report_drops():
    buf = KVEventBuffer(capacity=4)
    for i in range(3):
        buf.append(BlockRemoved((i,), 0))
    first = buf.read(0)
    assert [n for n, _ in first.events] == [1, 2, 3] and first.cursor == 3 and first.dropped == 0
    for i in range(3, 10):
        buf.append(BlockRemoved((i,), 0))
    assert len(buf) == 4
    later = buf.read(first.cursor)
    assert [e.block_hashes[0] for _, e in later.events] == [6, 7, 8, 9]
    assert later.dropped == 3 and later.cursor == 10
    assert buf.read(later.cursor).events == [] and buf.read(later.cursor).dropped == 0
    assert len(buf.drain()) == 4 and len(buf) == 0
    off = KVEventBuffer(enabled=False)
    assert off.append(AllBlocksCleared()) == 0 and len(off) == 0


def test_evict_hook_sees_content_before_it_is_dropped():
    pool = BlockPool(2, 2)
    seen = []
    pool.add_evict_hook(lambda b: seen.append((b.block_id, b.token_ids, b.cached)))
    (b,) = pool.get_new_blocks(1)
    cache(pool, b, 7)
    pool.free_blocks([b])
    pool.get_new_blocks(1)
    assert seen == [(1, (7, 7), True)]


def test_caching_disabled_keeps_nothing():
    pool = BlockPool(3, 2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(b, group_id=0, block_hash=1, parent_hash=None, parent_ref=None,
                                 token_ids=(1, 2), extra_keys=()) is False
    assert not b.cached and pool.lookup(0, 1) == []


def test_new_blocks_continue_the_table_when_the_next_block_is_free_and_uncached():
    """``after``: the blocks right after a table's last block are taken first when they hold no cached content;
    a cached one is not taken out of eviction order."""
    pool = BlockPool(12, 2)
    a = pool.get_new_blocks(3)  # 1 2 3
    b = pool.get_new_blocks(3)  # 4 5 6
    pool.free_blocks(b[::-1])  # uncached: back at the queue's tail (7 .. 11 first)
    got = pool.get_new_blocks(2, after=a[-1].block_id)
    assert ids(got) == [4, 5]  # not 7, 8: the table 1 2 3 stays consecutive
    cache(pool, got[0], 99)
    pool.free_blocks(got)
    got = pool.get_new_blocks(1, after=3)  # 4 is cached now: the eviction order decides
    assert ids(got) == [7] and got[0].block_id != 4 and pool.num_evictions == 0
    pool.check_invariants()
