"""Pure-MLX paged KV write: the reference twin of ``metal_kernels/kv_write.metal``.

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
            "k_pages and v_pages must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}"
        )
    T = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    expected = (T, *k_pages.shape[2:])
    if slot_mapping.ndim != 1 or slot_mapping.dtype != mx.int32:
        raise ValueError(f"slot_mapping must be int32 [T], got {slot_mapping.dtype} {slot_mapping.shape}")
    if k_new.shape != expected or v_new.shape != expected:
        raise ValueError(f"k_new and v_new must be {list(expected)}, got {k_new.shape} and {v_new.shape}")


def kv_write_reference(
    k_pages: mx.array, v_pages: mx.array, slot_mapping: mx.array, k_new: mx.array, v_new: mx.array
) -> tuple[mx.array, mx.array]:
    """Write ``T`` new K/V rows into their slots; return the updated pools (inputs unchanged).

    Args:
        k_pages, v_pages: ``[num_blocks, block_size, kv_heads, head_dim]``.
        slot_mapping: int32 ``[T]``, flat slot ``block_id * block_size + offset`` per row; slots
            must be distinct and in range (pad with slots of the null block 0, never read
            unmasked).
        k_new, v_new: ``[T, kv_heads, head_dim]`` (cast to the pool dtype).

    Returns:
        ``(k_pages, v_pages)`` with the rows written. Per-step cost is O(T) when the caller
        follows the ownership rule in this module's docstring, O(pool) otherwise.
    """
    check_kv_write_inputs(k_pages, v_pages, slot_mapping, k_new, v_new)
    _, _, KVH, D = k_pages.shape
    k_flat = k_pages.reshape(-1, KVH, D)  # (slots, KVH, D): a fresh handle; the input stays as is
    v_flat = v_pages.reshape(-1, KVH, D)
    k_flat[slot_mapping] = k_new.astype(k_pages.dtype)  # scatter; donated when sole owner
    v_flat[slot_mapping] = v_new.astype(v_pages.dtype)
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)
