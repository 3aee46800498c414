"""KVCacheManager: exact block ids for prefix hits, partial reuse, CoW, fork, trim, collisions, salts,
hybrid groups, retention and preemption (pure Python)."""

import pytest

from mlxkv.kv.blocks.events import BlockRemoved, BlockStored
from mlxkv.kv.blocks.manager import KVCacheManager
from mlxkv.kv.blocks.retention import RetentionConfig
from mlxkv.kv.blocks.seq_state import CopyOp, slot_mapping
from mlxkv.kv.blocks.specs import KVCacheGroupSpec


def prefill(m, seq_id):
    a = m.allocate_slots(seq_id)
    assert a is not None
    m.commit(seq_id)
    return a


def decode(m, seq_id, token):
    a = m.allocate_slots(seq_id, token_ids=[token])
    assert a is not None
    m.commit(seq_id)
    return a


def refs(m, *block_ids):
    return [m.pool.blocks[i].ref_cnt for i in block_ids]


def test_prefix_hit_exact_block_ids_and_partial_tail_take():
    m = KVCacheManager(21, 4)
    a = m.open(list(range(14)))
    assert a.num_cached_tokens == 0
    assert prefill(m, a.seq_id).new_blocks == [[1, 2, 3, 4]]
    assert [type(e) for e in m.events.drain()] == [BlockStored] * 3  # full blocks only

    b = m.open(list(range(12)) + [99, 98, 97])
    assert b.num_cached_tokens == 12 and b.block_tables == [[1, 2, 3]] and b.copies == []
    assert prefill(m, b.seq_id).new_blocks == [[5]]
    assert refs(m, 1, 2, 3, 4, 5) == [2, 2, 2, 1, 1]

    m.free(a.seq_id)  # tail first; block 4 (tokens 12, 13) stays findable as a partial block
    assert refs(m, 1, 2, 3, 4) == [1, 1, 1, 0]
    assert [blk.block_id for blk in m.pool.eviction_order()][-1] == 4

    c = m.open(list(range(14)) + [50])
    assert c.num_cached_tokens == 14 and c.block_tables == [[1, 2, 3, 4]] and c.copies == []
    assert not m.pool.blocks[4].cached  # taken for writing: no longer a cache entry
    alloc = m.allocate_slots(c.seq_id)
    assert alloc.start == 14 and alloc.slot_mapping == [[4 * 4 + 2]] and alloc.new_blocks == [[]]
    m.check_invariants()


def test_full_hit_recomputes_exactly_the_last_token_via_copy():
    m = KVCacheManager(11, 4)
    prompt = list(range(100, 116))  # four full blocks
    a = m.open(prompt)
    prefill(m, a.seq_id)
    m.free(a.seq_id)
    b = m.open(prompt)
    # three full blocks plus 3 of the 4 tokens of the last one, copied so the cached block stays intact
    assert b.num_cached_tokens == 15
    assert b.copies == [CopyOp(group_id=0, src_block=4, dst_block=5, num_tokens=3)]
    assert b.block_tables == [[1, 2, 3, 5]]
    alloc = m.allocate_slots(b.seq_id)
    assert alloc.num_tokens == 1 and alloc.slot_mapping == [[5 * 4 + 3]]
    assert m.pool.blocks[4].cached and m.pool.blocks[4].ref_cnt == 0
    assert m.stats().hit_tokens == 15 and m.stats().prompt_tokens == 32


def test_full_hit_without_copy_takes_the_block_and_without_partial_recomputes_a_block():
    prompt = list(range(8))
    m = KVCacheManager(11, 4, copy_on_partial_reuse=False)
    a = m.open(prompt)
    prefill(m, a.seq_id)
    m.free(a.seq_id)
    m.events.drain()
    b = m.open(prompt)
    assert b.num_cached_tokens == 7 and b.copies == [] and b.block_tables == [[1, 2]]
    assert [type(e) for e in m.events.drain()] == [BlockRemoved]  # block 2 will be overwritten

    m2 = KVCacheManager(11, 4, enable_partial_reuse=False)
    a = m2.open(prompt)
    prefill(m2, a.seq_id)
    m2.free(a.seq_id)
    assert m2.open(prompt).num_cached_tokens == 4  # vLLM behaviour: the last block is recomputed


def test_partial_reuse_copies_a_block_held_by_another_sequence():
    m = KVCacheManager(21, 4)
    a = m.open(list(range(10)))
    prefill(m, a.seq_id)  # blocks 1 2 3, block 3 holds tokens 8, 9
    (a2,) = m.fork(a.seq_id)
    m.free(a.seq_id)  # block 3 registered as partial, still held by the fork
    assert m.pool.blocks[3].cached and m.pool.blocks[3].ref_cnt == 1
    c = m.open(list(range(10)) + [42, 43])
    assert c.num_cached_tokens == 10
    assert c.copies == [CopyOp(0, 3, 4, 2)] and c.block_tables == [[1, 2, 4]]
    # the fork owns block 3 alone now: it writes in place after dropping the cache entry
    alloc = decode(m, a2, 7)
    assert alloc.copies == [] and alloc.slot_mapping == [[3 * 4 + 2]] and not m.pool.blocks[3].cached
    m.check_invariants()


def test_partial_reuse_inside_a_diverging_full_block():
    m = KVCacheManager(21, 4)
    a = m.open(list(range(16)))
    prefill(m, a.seq_id)
    m.free(a.seq_id)
    b = m.open(list(range(10)) + [77] * 6)  # diverges at token 10, inside block 2
    assert b.num_cached_tokens == 10
    assert b.copies == [CopyOp(0, 3, 5, 2)] and b.block_tables == [[1, 2, 5]]


def test_trim_then_append_copies_a_shared_block():
    m = KVCacheManager(21, 4)
    a = m.open(list(range(12)) + [5])
    prefill(m, a.seq_id)  # blocks 1 2 3 4
    b = m.open(list(range(12)) + [6])
    assert b.num_cached_tokens == 12 and b.block_tables == [[1, 2, 3]]
    prefill(m, b.seq_id)
    assert m.trim(b.seq_id, 3) == 3  # back into block 3, which A holds and the cache indexes
    assert m.block_tables(b.seq_id) == [[1, 2, 3]] and m.num_tokens(b.seq_id) == 10
    alloc = decode(m, b.seq_id, 70)
    assert alloc.copies == [CopyOp(0, 3, 6, 2)] and m.block_tables(b.seq_id) == [[1, 2, 6]]
    assert m.pool.blocks[3].cached and m.pool.blocks[3].ref_cnt == 1
    assert m.token_ids(b.seq_id) == list(range(10)) + [70]
    m.check_invariants()


def test_speculative_tokens_are_cached_only_once_verified():
    m = KVCacheManager(21, 4)
    a = m.open([1, 2, 3])
    prefill(m, a.seq_id)
    m.allocate_slots(a.seq_id, token_ids=[4, 5, 6, 7, 8])  # 1 sampled + 4 drafts
    m.commit(a.seq_id, 2)  # tokens 4 and 5 accepted
    assert m.trim(a.seq_id, 3) == 3
    assert m.stats().pool.cached == 1  # block 0 = [1, 2, 3, 4]; [5] is not a full block
    m.free(a.seq_id)
    hit = m.find_prefix_hit([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.num_full_blocks == 1 and hit.num_tokens == 5  # never 8: the drafts were rejected


def test_hash_collisions_never_serve_wrong_kv():
    collide = lambda parent, tokens, extra: 0
    m = KVCacheManager(21, 4, hash_algo=collide)
    x, y, t = [1, 2, 3, 4], [9, 9, 9, 9], [5, 6, 7, 8]
    a = m.open(x + t + [0])
    prefill(m, a.seq_id)  # blocks 1 (x) 2 (t after x) 3
    b = m.open(y + [0])
    prefill(m, b.seq_id)  # block 4 (y) 5
    m.free(a.seq_id)
    m.free(b.seq_id)
    # block 2 holds t after x: same hash, same tokens, wrong parent → must not follow block 4 (y)
    c = m.open(y + t + [1])
    assert c.num_cached_tokens == 4 and c.block_tables == [[4]]
    d = m.open(x + t + [1])
    assert d.num_cached_tokens == 8 and m.block_tables(d.seq_id)[0][:2] == [1, 2]
    e = m.open([7, 7, 7, 7] + t + [1])
    assert e.num_cached_tokens == 0


def test_salts_never_share_even_with_colliding_hashes():
    for algo in ("sha256", lambda parent, tokens, extra: 0):
        m = KVCacheManager(41, 4, hash_algo=algo)
        prompt = list(range(9))
        s = m.open(prompt, salt="alice")
        prefill(m, s.seq_id)
        m.free(s.seq_id)
        assert m.open(prompt, salt="bob").num_cached_tokens == 0
        assert m.open(prompt).num_cached_tokens == 0
        assert m.open(prompt, salt="alice").num_cached_tokens == 8


def test_extra_keys_and_spans_separate_content():
    m = KVCacheManager(41, 4)
    prompt = list(range(9))
    s = m.open(prompt, extra=("lora-a",), spans=((4, 6, "img-1"),))
    prefill(m, s.seq_id)
    m.free(s.seq_id)
    assert m.open(prompt, extra=("lora-b",), spans=((4, 6, "img-1"),)).num_cached_tokens == 0
    assert m.open(prompt, extra=("lora-a",), spans=((4, 6, "img-2"),)).num_cached_tokens == 4
    assert m.open(prompt, extra=("lora-a",), spans=((4, 6, "img-1"),)).num_cached_tokens == 8


@pytest.mark.parametrize("block_size, copies", [(16, 0), (32, 7)])
def test_best_of_8_fork_shares_the_prompt(block_size, copies):
    m = KVCacheManager(400, block_size)
    prompt = [i % 1000 for i in range(2000)]
    root = m.open(prompt)
    prefill(m, root.seq_id)
    seqs = [root.seq_id] + m.fork(root.seq_id, 7)
    n_copies = 0
    for step in range(100):
        for k, s in enumerate(seqs):
            n_copies += len(decode(m, s, 5000 + 100 * k + step).copies)
    used_slots = m.pool.num_used_blocks * block_size
    assert used_slots <= 2800 + 8 * block_size
    shared = 2000 // block_size
    own = -(-(2000 % block_size + 100) // block_size)
    assert m.pool.num_used_blocks == shared + 8 * own
    assert n_copies == copies
    tables = [m.block_tables(s)[0] for s in seqs]
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert len({t[-1] for t in tables}) == 8
    m.check_invariants()


def hybrid(num_blocks=64, window=5, **kw):
    groups = [KVCacheGroupSpec("full"), KVCacheGroupSpec("sliding", window=window)]
    return KVCacheManager(num_blocks, 4, groups, **kw)


def prefill_chunked(m, seq_id, n, chunk=4):
    for _ in range(n // chunk):
        assert m.allocate_slots(seq_id, chunk) is not None
        m.commit(seq_id)


def test_sliding_group_releases_blocks_that_left_the_window():
    m = hybrid()
    a = m.open(list(range(24)) + [0])
    prefill_chunked(m, a.seq_id, 24)
    full, sliding = m.block_tables(a.seq_id)
    assert full == [1, 3, 5, 7, 9, 11] and sliding == [0, 0, 0, 0, 10, 12]
    assert sliding[:4] == [0, 0, 0, 0] and 0 not in sliding[4:]  # window 5 at position 24 needs block 5
    m.check_invariants()


def test_sliding_hybrid_hit_needs_only_the_window_and_intersects_groups():
    m = hybrid()
    prompt = list(range(24))
    a = m.open(prompt + [0])
    prefill_chunked(m, a.seq_id, 24)
    sliding_blocks = [m.pool.blocks[i] for i in m.block_tables(a.seq_id)[1]]
    full_blocks = [m.pool.blocks[i] for i in m.block_tables(a.seq_id)[0]]
    m.free(a.seq_id)
    hit = m.find_prefix_hit(prompt + [1])
    assert hit.num_full_blocks == 6
    assert [b.block_id for b in hit.blocks[1]][:5] == [0] * 5  # only the last W-1 = 4 tokens are needed
    # a hole in the sliding group far from the end does not matter ...
    released = [b for b in m.pool.blocks[1:] if b.cached and b.group_id == 1 and b.token_ids[0] == 4]
    m.pool.uncache(released[0])
    assert m.find_prefix_hit(prompt + [1]).num_full_blocks == 6
    # ... a miss at the end makes the sliding group search further left, and the full group follows
    m.pool.uncache(sliding_blocks[5])
    hit = m.find_prefix_hit(prompt + [1])
    assert hit.num_full_blocks == 5 and hit.num_tokens == 20
    assert hit.blocks[0] == full_blocks[:5] and hit.blocks[1][4] is sliding_blocks[4]
    # a full-attention miss bounds the sliding group too: at 8 tokens the window needs block 1, the hole,
    # so both settle at 4 tokens
    m.pool.uncache(full_blocks[2])
    hit = m.find_prefix_hit(prompt + [1])
    assert hit.num_tokens == 4 and [[b.block_id for b in g] for g in hit.blocks] == [[1], [2]]


def test_sliding_trim_takes_released_blocks_back_from_the_cache():
    m = hybrid()
    a = m.open(list(range(24)) + [0])
    prefill_chunked(m, a.seq_id, 24)
    assert m.block_tables(a.seq_id)[1][3] == 0
    assert m.trim(a.seq_id, 8) == 8  # position 16 needs tokens 12..15 = block 3 again
    assert m.block_tables(a.seq_id)[1][3] != 0
    m.check_invariants()
    # a released block that was evicted cannot come back: the trim stops where the window no longer needs it
    b = m.open(list(range(100, 124)) + [0])
    prefill_chunked(m, b.seq_id, 24)
    (gone,) = [x for x in m.pool.blocks if x.cached and x.group_id == 1 and x.token_ids == (112, 113, 114, 115)]
    assert gone.ref_cnt == 0
    m.pool.uncache(gone)
    assert m.trim(b.seq_id, 8) == 4  # position 20 needs tokens 16..19 only
    assert m.num_tokens(b.seq_id) == 20
    assert m.trim(b.seq_id, 20) == 20  # an empty sequence needs nothing
    m.check_invariants()


def test_chunked_group_releases_finished_chunks_and_hits_at_chunk_starts():
    groups = [KVCacheGroupSpec("full"), KVCacheGroupSpec("chunked", chunk_size=8)]
    m = KVCacheManager(64, 4, groups)
    prompt = list(range(20))
    a = m.open(prompt + [0])
    prefill_chunked(m, a.seq_id, 20)
    assert m.block_tables(a.seq_id)[1][:4] == [0, 0, 0, 0]  # chunks [0, 8) and [8, 16) are finished
    m.free(a.seq_id)
    hit = m.find_prefix_hit(prompt + [1])
    assert hit.num_full_blocks == 5 and [b.block_id for b in hit.blocks[1]][:4] == [0] * 4
    m.check_invariants()


def test_retention_priorities_decide_eviction_order():
    clock = [0.0]
    m = KVCacheManager(7, 4, clock=lambda: clock[0])
    keep = RetentionConfig(ranges=[(0, 4, 90)], decode_priority=10)
    a = m.open([1, 2, 3, 4, 5, 6, 7, 8], retention=keep)
    prefill(m, a.seq_id)  # block 1: 90, block 2: 35
    decode(m, a.seq_id, 9)
    for t in (10, 11, 12):
        decode(m, a.seq_id, t)  # block 3 = [9..12] generated: 10
    m.free(a.seq_id)
    assert [m.pool.blocks[i].priority for i in (1, 2, 3)] == [90, 35, 10]
    order = [b.block_id for b in m.pool.eviction_order()]
    assert order == [4, 5, 6, 3, 2, 1]
    b = m.open(list(range(50, 70)))
    prefill(m, b.seq_id)  # needs 5 blocks: evicts 3 then 2, keeps the priority-90 block
    assert m.pool.blocks[1].cached and m.pool.blocks[1].token_ids == (1, 2, 3, 4)
    assert m.stats().pool.evictions == 2
    # a second request hitting the block with a higher priority raises it; a lower one never lowers it
    m.free(b.seq_id)
    c = m.open([1, 2, 3, 4, 9], retention=RetentionConfig(ranges=[(0, 4, 20)]))
    assert m.pool.blocks[1].priority == 90 and c.num_cached_tokens == 4


def test_preemption_picks_lowest_priority_newest_and_keeps_blocks_cached():
    m = KVCacheManager(9, 4)  # 8 usable blocks
    hi = m.open(list(range(8)), priority=5)
    lo_old = m.open(list(range(100, 108)), priority=0)
    lo_new = m.open(list(range(200, 208)), priority=0)
    for s in (hi, lo_old, lo_new):
        prefill(m, s.seq_id)  # 2 blocks each → 2 free
    assert m.choose_victim() == lo_new.seq_id
    assert m.choose_victim(requester=lo_new.seq_id) is None  # nobody ranks below it
    assert m.choose_victim(requester=hi.seq_id) == lo_new.seq_id
    assert m.allocate_slots(lo_new.seq_id, token_ids=list(range(12))) is None  # needs 3 blocks
    assert not m.can_allocate(hi.seq_id, 12)
    tokens = m.token_ids(lo_new.seq_id)
    m.free(lo_new.seq_id)  # preempted: its verified blocks stay cached
    alloc = m.allocate_slots(hi.seq_id, token_ids=list(range(300, 312)))
    assert alloc is not None
    m.free(hi.seq_id)
    res = m.open(tokens)  # resumed over its tokens: a prefix hit
    # its blocks stayed cached, and the one allocation that needed an eviction took its tail (block 6)
    assert res.num_cached_tokens == 4 and res.block_tables == [[5]]
    m.check_invariants()


def test_hit_rate_is_token_weighted():
    m = KVCacheManager(41, 4)
    a = m.open(list(range(16)))
    prefill(m, a.seq_id)
    m.free(a.seq_id)
    m.open(list(range(16)))  # 15 of 16
    m.open(list(range(8)) + [99] * 8)  # 8 of 16
    assert m.stats().hit_rate == pytest.approx((15 + 8) / 48)


def test_block_reuse_disabled():
    m = KVCacheManager(21, 4, enable_block_reuse=False)
    a = m.open(list(range(9)))
    prefill(m, a.seq_id)
    m.free(a.seq_id)
    assert m.open(list(range(9))).num_cached_tokens == 0
    assert len(m.events) == 0 and m.stats().pool.cached == 0


def test_allocation_failure_changes_nothing_and_errors_are_clear():
    m = KVCacheManager(3, 4)
    a = m.open(list(range(12)))
    assert not m.can_allocate(a.seq_id, 12) and m.can_allocate(a.seq_id, 8)
    assert m.allocate_slots(a.seq_id) is None
    assert m.num_tokens(a.seq_id) == 0 and m.pool.num_used_blocks == 0
    assert m.allocate_slots(a.seq_id, 8) is not None
    with pytest.raises(ValueError, match="prompt tokens without slots"):
        m.allocate_slots(a.seq_id, token_ids=[1])
    with pytest.raises(ValueError, match="expected 0..4"):
        m.allocate_slots(a.seq_id, 5)
    with pytest.raises(ValueError, match="at least one prompt token"):
        m.open([])
    with pytest.raises(KeyError):
        m.free(12345)


def test_slot_mapping_helper():
    assert slot_mapping([7, 3, 9], [0, 3, 4, 9], 4) == [28, 31, 12, 37]
    m = KVCacheManager(11, 4)
    a = m.open(list(range(6)))
    prefill(m, a.seq_id)
    assert m.slot_mapping(a.seq_id, 2, 6) == [[6, 7, 8, 9]]


def test_sliding_window_start_is_anchored_to_the_full_attention_chain():
    # every block hashes alike and holds the same tokens: only the anchor tells position 4..7 from 0..3
    m = hybrid(hash_algo=lambda parent, tokens, extra: 0)
    a = m.open([0] * 8)
    prefill(m, a.seq_id)
    full_a, sliding_a = m.block_tables(a.seq_id)
    b = m.open([0] * 9)
    assert b.num_cached_tokens == 8
    assert b.block_tables[0] == full_a and b.block_tables[1][1] == sliding_a[1]


def test_pure_sliding_model_links_blocks_inside_the_window():
    m = KVCacheManager(32, 4, [KVCacheGroupSpec("sliding", window=9)], hash_algo=lambda p, t, e: 0)
    seqs = [m.open([x] * 4 + [5] * 4 + [0]) for x in (1, 2)]
    for s in seqs:
        prefill(m, s.seq_id)
    tables = [m.block_tables(s.seq_id)[0] for s in seqs]
    for s in seqs:
        m.free(s.seq_id)
    m.pool.uncache(m.pool.blocks[tables[1][1]])  # [5,5,5,5] after [2,2,2,2] is gone; after [1,1,1,1] is not
    hit = m.find_prefix_hit([2] * 4 + [5] * 4 + [9])
    assert hit.num_full_blocks == 1 and [b.block_id for b in hit.blocks[0]] == [tables[1][0]]


def test_unverified_draft_tokens_never_enter_a_partial_block():
    m = KVCacheManager(21, 4)
    a = m.open([1, 2, 3, 4, 5])
    prefill(m, a.seq_id)
    m.allocate_slots(a.seq_id, token_ids=[6, 7])  # one sampled token and one draft, neither verified
    m.free(a.seq_id)
    tail = m.pool.blocks[2]  # holds tokens 5, 6, 7; only 5 is verified
    assert tail.cached and tail.token_ids == (5,)
    assert m.find_prefix_hit([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 5


def test_copy_target_is_not_cached_before_a_commit_proves_the_copy_ran():
    m = KVCacheManager(21, 4)
    prompt = list(range(8))
    a = m.open(prompt)
    prefill(m, a.seq_id)
    m.free(a.seq_id)
    b = m.open(prompt)
    (copy,) = b.copies
    m.free(b.seq_id)  # cancelled before any model step: the copy may never have happened
    assert not m.pool.blocks[copy.dst_block].cached


def test_partial_reuse_uses_the_shortest_match_over_groups():
    from mlxkv.kv.blocks.block_pool import BlockPool
    from mlxkv.kv.blocks.coordinator import KVCacheCoordinator
    from mlxkv.kv.blocks.hashing import (
        HashContext,
        extend_block_hashes,
        sha256_block_hash,
    )

    pool = BlockPool(10, 4)
    specs = [KVCacheGroupSpec("full"), KVCacheGroupSpec("sliding", window=3)]
    tokens = [0, 1, 2, 3, 4, 5, 6, 9]
    hashes = extend_block_hashes(sha256_block_hash, tokens, len(tokens), 4, HashContext(), [])
    head0, head1, tail0, tail1 = pool.get_new_blocks(4)
    pool.cache_full_block(head0, group_id=0, block_hash=hashes[0], parent_hash=None, parent_ref=None,
                          token_ids=(0, 1, 2, 3), extra_keys=())
    pool.cache_full_block(head1, group_id=1, block_hash=hashes[0], parent_hash=None, parent_ref=None,
                          token_ids=(0, 1, 2, 3), extra_keys=(), anchor=head0.ref)
    pool.cache_partial_block(tail0, group_id=0, parent_ref=head0.ref, token_ids=(4, 5, 6), extra_keys=())
    pool.cache_partial_block(tail1, group_id=1, parent_ref=head1.ref, token_ids=(4, 5), extra_keys=())
    pool.free_blocks([tail1, tail0, head1, head0])
    hit = KVCacheCoordinator(pool, specs).find_prefix_hit(tokens, hashes, HashContext(), max_tokens=7)
    assert hit.num_full_blocks == 1 and hit.num_tokens == 6
    assert [(p.block.block_id, p.num_tokens) for p in hit.partial] == [(tail0.block_id, 2), (tail1.block_id, 2)]
