"""Paged KV write: exact rows, value semantics, O(rows) per step when the pool is sole-owned."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import pytest

from mlxkv.kernels import kv_write, kv_write_reference
from mlxkv.kernels.kv_write_ref import slot_runs, write_row_runs


def pools(num_blocks, block_size=16, kv_heads=2, head_dim=64, dtype=mx.float32, seed=0):
    k1, k2 = mx.random.split(mx.random.key(seed))
    shape = (kv_heads, num_blocks, block_size, head_dim)
    return mx.random.normal(shape, key=k1).astype(dtype), mx.random.normal(shape, key=k2).astype(dtype)


def token_rows(pages):
    """Token-major view ``(slot, kv head, D)`` of pages ``(kv head, block, row, D)``."""
    return pages.reshape(pages.shape[0], -1, pages.shape[3]).transpose(1, 0, 2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rows_land_in_their_slots_and_nothing_else_changes(dtype):
    bs = 16
    k_pages, v_pages = pools(6, bs, dtype=dtype)
    k_before, v_before = mx.array(k_pages), mx.array(v_pages)
    slots = [3 * bs + 5, 1 * bs + 0, 5 * bs + 15, 2 * bs + 7]  # unordered, page edges included
    k_new = mx.random.normal((4, 2, 64)).astype(dtype)
    v_new = mx.random.normal((4, 2, 64)).astype(dtype)
    k_out, v_out = kv_write_reference(k_pages, v_pages, mx.array(slots, dtype=mx.int32), k_new, v_new)

    for out, before, new in ((k_out, k_before, k_new), (v_out, v_before, v_new)):
        assert out.dtype == dtype and out.shape == before.shape
        flat, flat_before = token_rows(out), token_rows(before)
        for i, s in enumerate(slots):
            assert mx.array_equal(flat[s], new[i]).item()
        untouched = mx.array([s for s in range(6 * bs) if s not in slots])
        assert mx.array_equal(flat[untouched], flat_before[untouched]).item()
    # The inputs are values: the caller's arrays still hold the old contents.
    assert mx.array_equal(k_pages, k_before).item() and mx.array_equal(v_pages, v_before).item()


def test_new_rows_are_cast_to_the_pool_dtype():
    k_pages, v_pages = pools(3, dtype=mx.float16)
    rows = mx.random.normal((1, 2, 64))  # float32
    k_out, _ = kv_write_reference(k_pages, v_pages, mx.array([20], dtype=mx.int32), rows, rows)
    assert k_out.dtype == mx.float16
    assert mx.array_equal(token_rows(k_out)[20], rows[0].astype(mx.float16)).item()


def test_dispatch_uses_the_reference_write_on_cpu():
    k_pages, v_pages = pools(3)
    rows = mx.random.normal((2, 2, 64))
    slots = mx.array([17, 30], dtype=mx.int32)
    got = kv_write(k_pages, v_pages, slots, rows, rows)
    want = kv_write_reference(k_pages, v_pages, slots, rows, rows)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_bad_shapes_raise_value_error():
    k_pages, v_pages = pools(3)
    with pytest.raises(ValueError, match="k_new and v_new"):
        kv_write_reference(k_pages, v_pages, mx.array([1], dtype=mx.int32), mx.zeros((1, 3, 64)),
                           mx.zeros((1, 3, 64)))
    with pytest.raises(ValueError, match="int32"):
        kv_write_reference(k_pages, v_pages, mx.array([1]).astype(mx.int64), mx.zeros((1, 2, 64)),
                           mx.zeros((1, 2, 64)))


def median_step_seconds(num_blocks: int, steps: int = 12) -> float:
    """Decode-like loop: write 4 rows per step into a sole-owned pool, evaluating each step."""
    k_pages, v_pages = pools(num_blocks)
    mx.eval(k_pages, v_pages)
    rows = mx.random.normal((4, 2, 64))
    times = []
    for step in range(steps):
        slots = mx.array([(step * 4 + i) * 7 % (num_blocks * 16) for i in range(4)], dtype=mx.int32)
        mx.eval(slots)
        t0 = time.perf_counter()
        k_pages, v_pages = kv_write_reference(k_pages, v_pages, slots, rows, rows)
        mx.eval(k_pages, v_pages)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def test_step_time_does_not_grow_with_pool_size():
    # 64x more pool (256 KB -> 64 MB per pool): a whole-pool copy would cost tens of ms per step.
    small = median_step_seconds(64)
    large = median_step_seconds(4096)
    assert large < 10 * small + 0.002, (small, large)


def test_a_held_reference_gets_a_copy_not_a_corruption():
    k_pages, v_pages = pools(8)
    mx.eval(k_pages, v_pages)
    held = k_pages  # e.g. an attention output that still reads the old pool
    snapshot = mx.array(held) + 0
    mx.eval(snapshot)
    rows = mx.ones((1, 2, 64))
    k_pages, v_pages = kv_write_reference(k_pages, v_pages, mx.array([40], dtype=mx.int32), rows, rows)
    mx.eval(k_pages, v_pages)
    assert mx.array_equal(held, snapshot).item()
    assert mx.array_equal(token_rows(k_pages)[40], rows[0]).item()


# ---- host-known slots: static slice updates (the decode write on reference backends) ---------------------
def test_slot_runs_split_at_gaps_and_page_edges():
    bs = 4
    assert slot_runs([9], bs) == [(9, 0, 1)]
    assert slot_runs([5, 6, 7, 8, 9, 20, 21], bs) == [(5, 0, 3), (8, 3, 2), (20, 5, 2)]  # page edge at 8, gap
    assert slot_runs([7, 6], bs) == [(7, 0, 1), (6, 1, 1)]  # descending: never merged


def as_rows(pages):
    """Pages ``(KVH, NB, bs, D)`` stored as rows ``(1, KVH, NB * bs, D)`` (same memory order, as PagedStorage)."""
    H, NB, bs, D = pages.shape
    return pages.reshape(1, H, NB * bs, D)


@pytest.mark.parametrize("slots", [[37], [16, 17, 18, 19, 20, 21], [5, 6, 40, 41, 42, 3]])
def test_write_row_runs_equals_the_reference_scatter(slots):
    bs = 16
    k_pages, v_pages = pools(4, bs)
    k_new = mx.random.normal((len(slots), 2, 64))  # (T, KVH, D)
    v_new = mx.random.normal((len(slots), 2, 64))
    k_ref, v_ref = kv_write_reference(k_pages, v_pages, mx.array(slots, dtype=mx.int32), k_new, v_new)
    runs = slot_runs(slots, bs)
    k_rows, v_rows = as_rows(k_pages), as_rows(v_pages)
    k_out = write_row_runs(k_rows, runs, k_new.transpose(1, 0, 2)[None])  # a cache's layout (1, KVH, T, D)
    v_out = write_row_runs(v_rows, runs, v_new.transpose(1, 0, 2)[None])
    assert k_out is k_rows  # updated in place
    assert mx.array_equal(k_out, as_rows(k_ref)).item() and mx.array_equal(v_out, as_rows(v_ref)).item()


def test_write_row_runs_on_a_sole_owned_pool_is_in_place():
    """Proved by memory: writing one row into a 32 MiB pool it solely owns allocates no second pool."""
    k_pages, _ = pools(1024, 16, kv_heads=8)  # (8, 1024, 16, 64) float32: 32 MiB
    rows = as_rows(k_pages) + 0  # its own buffer
    del k_pages
    row = mx.random.normal((1, 8, 1, 64))
    mx.eval(rows, row)
    pool_bytes = rows.nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    rows = write_row_runs(rows, slot_runs([1234], 16), row)
    mx.eval(rows)
    assert mx.get_peak_memory() - base < pool_bytes // 100
    held = rows[:, :, 1:]  # a view sharing the buffer: the next write must copy (the check above can fail)
    before = held[:, :, 1234] + 0  # row 1235, (1, 8, 64)
    mx.eval(held, before)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    rows = write_row_runs(rows, slot_runs([1235], 16), row)
    mx.eval(rows)
    assert mx.get_peak_memory() - base >= pool_bytes
    assert mx.array_equal(held[:, :, 1234], before).item()  # the view keeps the old row
    assert mx.array_equal(rows[:, :, 1235], row[:, :, 0]).item()
