// Paged KV write. Body-only source for mx.fast.metal_kernel (KernelSpec "kv_write" in
// mlxkv/kernels/metal_specs.py). Twin of kv_write_reference in mlxkv/kernels/kv_write_ref.py.
//
// inputs : k_pages / v_pages [KVH, NB, BS, D] T (the pool before the write),
//          k_new / v_new [N, KVH, D] T, slot_rows [num_blocks * BS] int32 (the new row
//          written to each slot, or -1: the inverse of slot_mapping)
// outputs: k_out / v_out [KVH, NB, BS, D] T
// template: T, D, KVH, BS, NB (num_blocks)
// grid   : (D, KVH, NB * BS) threads, threadgroup (min(D, 256), 1, 1)
//
// mx.fast.metal_kernel outputs are fresh buffers (no aliasing with inputs), so this kernel
// rewrites the whole pool: O(pool) per call. The dispatcher prefers MLX's scatter (which donates
// the pool buffer when the caller holds the only reference) unless MLXKV_PAGED_KERNEL=metal.
const int d = int(thread_position_in_grid.x);
const int h = int(thread_position_in_grid.y);
const size_t slot = size_t(thread_position_in_grid.z);
const size_t i = (size_t(h) * NB * BS + slot) * D + d;  // head h, page slot/BS, row slot%BS
const int r = slot_rows[slot];
if (r >= 0) {
  const size_t j = (size_t(r) * KVH + h) * D + d;
  k_out[i] = k_new[j];
  v_out[i] = v_new[j];
} else {
  k_out[i] = k_pages[i];
  v_out[i] = v_pages[i];
}
