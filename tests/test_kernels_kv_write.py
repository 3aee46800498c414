"""Paged KV write: exact rows, value semantics, O(rows) per step when the pool is sole-owned."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import pytest

from mlxkv.kernels import kv_write, kv_write_reference


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
