"""A partial-block copy (prefix reuse, copy-on-write) must not copy the whole page pool."""

import mlx.core as mx
from testkit.archs import build_model

from mlxkv.config import KvCacheConfig
from mlxkv.engine.prefill import prefill
from mlxkv.kv.store import CachePool

BASE = [(7 * i + 3) % 900 + 10 for i in range(407)]  # 25 full blocks + a 7-token partial block


def run(model, pool, prompt):
    seq = pool.open(prompt=prompt)
    mx.eval(prefill(model, seq.caches, mx.array(prompt[seq.num_cached:])))
    seq.commit()
    return seq


def test_partial_reuse_copy_does_not_copy_the_pool():
    model, _ = build_model("llama")
    # preallocated: the page arrays are the whole 8000 blocks, the size a copy of them would show
    pool = CachePool(model, max_sequences=2, backend="paged", kv_config=KvCacheConfig(backend="paged", preallocate=True),
                     num_blocks=8000)
    pool.release(run(model, pool, BASE).id)
    pool.release(run(model, pool, BASE + list(range(11, 21))).id)  # leaves cached blocks over the shared tail rows
    pages = pool.paged.storage
    page_bytes = pages.k_rows[0].nbytes  # one layer's key pages: 8000 blocks
    copies = []
    copy_blocks = pages.copy_blocks
    pages.copy_blocks = lambda ops: (copies.extend(ops), copy_blocks(ops))
    mx.eval(pages.arrays())
    mx.reset_peak_memory()
    base_memory = mx.get_active_memory()
    seq = run(model, pool, BASE + list(range(12, 22)))  # reuses the shared tail rows by copying them into a new block
    assert seq.num_cached == 407 and copies, "the scenario must exercise a partial-block copy"
    assert mx.get_peak_memory() - base_memory < page_bytes / 4  # no layer's pool was duplicated
    pool.release(seq.id)
    pool.check_invariants()
