"""CachePool.fork: best-of-n children share the prompt's blocks (paged) and continue exactly."""

import mlx.core as mx
import pytest
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.prefill import prefill
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.layouts import install_attention_hook
from mlxkv.kv.store import CachePool, CacheRequest, PoolFullError

PROMPT = [(11 * i + 5) % 900 + 10 for i in range(200)]
BLOCK = 16


def decode(model, seq, first_token, steps):
    """Greedy decode ``steps`` tokens on one pool sequence, driving the paged bridge like the engines do."""
    tokens, y = [], first_token
    for _ in range(steps):
        tokens.append(y)
        seq.feed([y])
        logits = model(mx.array([[y]]), cache=seq.caches)[0, -1]  # (vocab,)
        y = mx.argmax(logits).item()
        seq.commit()
    return tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_best_of_8_shares_prompt_blocks_and_each_child_decodes_exactly(arch):
    model, _ = build_model(arch)
    expected = list(DirectEngine(model, None, pool=CachePool(model)).generate_tokens(
        PROMPT, SamplingParams(max_tokens=10)))
    pool = CachePool(model, max_sequences=9, backend="paged",
                     kv_config=KvCacheConfig(backend="paged", block_size=BLOCK), num_blocks=400)
    parent = pool.open(prompt=PROMPT)
    logits = prefill(model, parent.caches, mx.array(PROMPT, dtype=mx.uint32))  # (vocab,)
    first = mx.argmax(logits).item()
    parent.commit()
    manager = pool.paged.manager
    used_after_prompt = manager.pool.num_used_blocks
    children = pool.fork(parent.id, 8)
    pool.release(parent.id)
    for child in children:
        assert decode(model, child, first, 10) == expected
    pool.check_invariants()
    used = manager.pool.num_used_blocks
    groups = len(pool.paged.specs)
    # Shared: the prompt's blocks once, plus per child at most its own tail (one partial copy + new tokens).
    assert used <= used_after_prompt + 8 * groups * 2
    assert used < 8 * used_after_prompt / 2  # far below eight private copies of the prompt
    for child in children:
        pool.release(child.id)
    pool.check_invariants()
    assert manager.pool.num_used_blocks == 0  # every block back in the free queue


def test_dense_fork_copies_and_continues_exactly():
    model, _ = build_model("llama")
    expected = list(DirectEngine(model, None, pool=CachePool(model)).generate_tokens(
        PROMPT, SamplingParams(max_tokens=6)))
    pool = CachePool(model, max_sequences=3)
    parent = pool.open()
    first = mx.argmax(prefill(model, parent.caches, mx.array(PROMPT, dtype=mx.uint32))).item()
    children = pool.fork(parent.id, 2)
    with pytest.raises(PoolFullError):
        pool.fork(parent.id, 1)
    for child in children:
        assert decode(model, child, first, 6) == expected
    assert decode(model, parent, first, 6) == expected  # the parent is untouched by its children


def test_a_forked_preempted_and_resumed_child_keeps_its_cache_request():
    """A child carries its parent's cache request whole (salt, snapshot marks, retention rank): after a preemption
    its resume opens with the same, so a recurrent hybrid's child still stops its prefill at the marked message end
    and hits only under its salt."""
    model, _ = build_model("qwen3_next")
    install_attention_hook(model)
    pool = CachePool(model, max_sequences=4, backend="paged", num_blocks=200,
                     kv_config=KvCacheConfig(backend="paged", block_size=4))
    request = CacheRequest(salt="tenant-a", snapshot_at=(9,), preemption_rank=3)
    prompt = PROMPT[:14]
    parent = pool.open(prompt=prompt, cache_request=request)
    assert parent.prefill_chunk(0, 14) == 8  # the mark at 9 snapshots at its block boundary, 8
    prefill(model, parent.caches, mx.array(prompt, dtype=mx.uint32))
    parent.commit()
    child = pool.fork(parent.id, 1)[0]
    assert child.cache_request == request
    pool.release(parent.id)
    pool.preempt(child.id)
    pool.resume(child.id, prompt)
    assert child.cache_request == request
    assert child.paged.recorder.marks == [8]  # the resumed child's recorder has its parent's marks
    assert child.num_cached == 0 and child.prefill_chunk(0, 14) == 8  # no snapshot was taken: it stops at 8 again
    pool.release(child.id)
    pool.check_invariants()
