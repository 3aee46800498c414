// Split-K merge of paged-attention partials, with optional attention sinks. Body-only source for
// mx.fast.metal_kernel (KernelSpec "paged_merge" in mlxkv/kernels/metal_specs.py).
// Twin of merge_partials in mlxkv/kernels/paged_attention_ref.py; cascade attention merges its
// shared-prefix and suffix partials with it too.
//
// inputs : o_part [B, H, S, D] float (normalised partials), lse [B, H, S] float,
//          sinks [H] float (ignored unless HAS_SINKS), params int32 {S}
// outputs: out [B, H, 1, D] T
// template: T, D, HAS_SINKS
// grid   : (D, H, B) threads, threadgroup (min(D, 256), 1, 1)
const int d = int(thread_position_in_grid.x);
const int h = int(thread_position_in_grid.y);
const int b = int(thread_position_in_grid.z);
const int H = int(threads_per_grid.y);
const int S = params[0];
const size_t row = (size_t(b) * H + h) * S;

float top = -INFINITY;
for (int s = 0; s < S; ++s) {
  top = metal::max(top, lse[row + s]);
}
if (HAS_SINKS) {
  top = metal::max(top, sinks[h]);
}
const float top_safe = top == -INFINITY ? 0.0f : top;

// Empty splits carry lse = -inf, so exp() gives them weight 0 (math_mode "safe").
float denom = 0.0f;
float num = 0.0f;
for (int s = 0; s < S; ++s) {
  const float w = metal::exp(lse[row + s] - top_safe);
  denom += w;
  num += w * o_part[(row + s) * D + d];
}
if (HAS_SINKS) {
  denom += metal::exp(sinks[h] - top_safe);
}
out[(size_t(b) * H + h) * D + d] = static_cast<T>(denom != 0.0f ? num / denom : 0.0f);
