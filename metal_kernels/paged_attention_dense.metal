// The K/V row read of paged_attention.metal over dense pages (KernelSpec "paged_attention"): it stands for
// the body's MLXKV_KV_ROW_READ line.
//
// inputs : k_pages / v_pages [KVH, num_blocks, BS, D] T; element d of pool row `slot` is pages[slot * D + d].
const size_t row = slot * D;
float k[EL];
float v[EL];
for (int i = 0; i < EL; ++i) {
  k[i] = static_cast<float>(k_pages[row + vl + LPK * i]);
  v[i] = static_cast<float>(v_pages[row + vl + LPK * i]);
}
