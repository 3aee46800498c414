"""Paged KV write through MLX's scatter, on every backend (a GPU kernel on Metal).

Ownership rule (what makes the write O(rows) instead of O(pool)): MLX arrays are values, and a
scatter copies its input buffer unless MLX can donate it, which it does only when nothing else
still references that buffer at evaluation time. So hold each pool in exactly one place and
rebind it to the result before evaluating::

    self.k_pages, self.v_pages = kv_write_reference(self.k_pages, self.v_pages, slots, k, v)

Any other live reference to the old pool (a saved copy, a view, a lazy graph that still reads
it, such as an attention output not yet evaluated) makes MLX copy the whole pool for that step,
still correctly: the holder keeps seeing the old contents.
"""

from __future__ import annotations

import mlx.core as mx


def check_kv_write_inputs(
    k_pages: mx.array, v_pages: mx.array, slot_mapping: mx.array, k_new: mx.array, v_new: mx.array
) -> None:
    """Raises ValueError unless the shapes follow the layout in :mod:`mlxkv.kernels`."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [kv_heads, num_blocks, block_size, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    T = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    expected = (T, k_pages.shape[0], k_pages.shape[3])  # (T, kv_heads, head_dim)
    if slot_mapping.ndim != 1 or slot_mapping.dtype != mx.int32:
        raise ValueError(f"slot_mapping must be int32 [T], got {slot_mapping.dtype} {slot_mapping.shape}")
    if k_new.shape != expected or v_new.shape != expected:
        raise ValueError(f"k_new and v_new must be {list(expected)}, got {k_new.shape} and {v_new.shape}")


def kv_write_reference(
    k_pages: mx.array, v_pages: mx.array, slot_mapping: mx.array, k_new: mx.array, v_new: mx.array
) -> tuple[mx.array, mx.array]:
    """Write ``T`` new K/V rows into their slots; return the updated pools (inputs unchanged).

    Args:
        k_pages, v_pages: ``[kv_heads, num_blocks, block_size, head_dim]``.
        slot_mapping: int32 ``[T]``, flat slot ``block_id * block_size + offset`` per row; slots
            must be distinct and in range (pad with slots of the null block 0, never read
            unmasked).
        k_new, v_new: ``[T, kv_heads, head_dim]`` (cast to the pool dtype).

    Returns:
        ``(k_pages, v_pages)`` with the rows written. Per-step cost is O(T) when the caller
        follows the ownership rule in this module's docstring, O(pool) otherwise.
    """
    check_kv_write_inputs(k_pages, v_pages, slot_mapping, k_new, v_new)
    rows = page_rows(slot_mapping, k_pages.shape)  # (T * KVH,)
    return scatter_rows(k_pages, rows, k_new), scatter_rows(v_pages, rows, v_new)


def page_rows(slot_mapping: mx.array, pages_shape: tuple[int, ...]) -> mx.array:
    """Row indices ``(T * kv_heads,)`` into pages ``(KVH, NB, bs, D)`` flattened to ``(KVH * NB * bs, D)``
    for flat slots ``(T,)``, ordered (token, kv head) like the rows of a ``(T, kv_heads, D)`` write."""
    kv_heads, num_blocks, block_size, _ = pages_shape
    heads = mx.arange(kv_heads, dtype=mx.int32) * (num_blocks * block_size)  # (KVH,) first row of each head
    return (slot_mapping[:, None] + heads).reshape(-1)  # (T * KVH,): a slot is the row within its head


def scatter_rows(pages: mx.array, rows: mx.array, new: mx.array) -> mx.array:
    """``pages`` ``(KVH, NB, bs, D)`` with ``new`` ``(T, KVH, D)`` written at ``rows`` (from :func:`page_rows`).

    The flattened handle is fresh, so the caller's array is unchanged; the scatter donates the buffer
    when that handle is its sole owner (the ownership rule above).
    """
    flat = pages.reshape(-1, pages.shape[-1])  # (KVH * NB * bs, D)
    flat[rows] = new.reshape(-1, new.shape[-1]).astype(pages.dtype)
    return flat.reshape(pages.shape)


def slot_runs(slots: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """Host-known flat slots as runs ``(first flat row, first source row, count)``: consecutive slots that stay
    inside one page. A decode step's single row is one run; a prefill chunk into fresh pages one per page."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and s == runs[-1][0] + runs[-1][2] and s % block_size != 0:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, i, 1))
    return runs


def write_row_runs(rows: mx.array, runs: list[tuple[int, int, int]], new: mx.array) -> mx.array:
    """Pages stored as rows ``(1, KVH, NB * bs, D)`` (the pages' memory seen as one dense cache: slot ``s`` is row
    ``s``) with ``new`` ``(1, KVH, T, D)`` written at the host-known ``runs`` (:func:`slot_runs`): the same
    result as :func:`scatter_rows` at those slots, as one static slice update per run — exactly a dense cache's
    append, no index arrays. The caller's handle is updated in place (ownership as above: it must be the pages'
    only holder for the write to be O(rows))."""
    if new.dtype != rows.dtype:
        new = new.astype(rows.dtype)
    T = new.shape[2]
    for slot, src, count in runs:
        rows[:, :, slot:slot + count] = new if count == T else new[:, :, src:src + count]  # (1, KVH, count, D)
    return rows
