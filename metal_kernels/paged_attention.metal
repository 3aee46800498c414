// Paged decode attention, split-K partials. Body-only source for mx.fast.metal_kernel, shared by two kernels
// that differ only in how a K/V row is stored: the line MLXKV_KV_ROW_READ below stands for a K/V row read
// chosen when the source is generated (KernelSpec.kv_read_file in mlxkv/kernels/metal_specs.py):
// paged_attention_dense.metal (KernelSpec "paged_attention", twin ReferencePagedAttention.partials in
// mlxkv/kernels/paged_attention_ref.py) or paged_attention_quantized.metal (KernelSpec
// "paged_attention_quantized", twin ReferenceQuantizedPagedAttention.partials in
// mlxkv/kernels/quantized_paged_ref.py). MLX generates the signature from the spec.
//
// inputs : queries [B, H, 1, D] T, the K/V pages (as the row read's header says),
//          block_tables [B, max_blocks] int32, context_lens [B] int32,
//          params int32 {window, chunk, pages_per_split, num_splits, max_blocks, num_blocks}, scale float
// outputs: o_part [B, H, S, D] float (normalised per split), lse [B, H, S] float
// template: T, D (multiple of 32), BS, KVH, G (query heads per kv head), HT (heads per
//           threadgroup, divides G), LPK (lanes per key: 8, 16 or 32, divides D), NSG (simdgroups),
//           plus the row read's own (quantized: BITS, GS)
// grid   : (32 * NSG, KVH * G / HT, B * S) threads, threadgroup (32 * NSG, 1, 1)
//
// As MLX's sdpa_vector: one threadgroup per (sequence, kv head, tile of HT query heads, split),
// simdgroups walking the split's visible tokens, K/V rows read through the block table (no
// gather). A simdgroup takes KPS = 32 / LPK tokens per step: lane group j (lanes j * LPK ...)
// holds elements vl, vl + LPK, ... of token t + j's row (vl = lane % LPK, so a group's loads are
// contiguous) and reduces its partial dots with log2(LPK) shuffles, all KPS tokens at once: each
// lane group is a "virtual simdgroup" with its own online-softmax state, NV = NSG * KPS of them
// combined at the end. Per lane the state is HT * D / LPK query and as many accumulator floats
// (the host keeps them <= 8: no register spills); the G / HT threadgroups of one kv head read the
// same K/V rows, mostly from cache. Shuffles sit in control flow uniform across the simdgroup: a
// lane group past the split's end computes on a clamped row and discards the result. Only
// visible tokens update the state, so every score is finite and the running max starts at -inf:
// exp(-inf) == 0 under math_mode "safe" makes the first correction factor vanish.
constexpr int KPS = 32 / LPK;
constexpr int EL = D / LPK;  // elements of a row per lane
constexpr int DL = D / 32;   // elements per lane in the final combine
constexpr int NV = NSG * KPS;
constexpr int H = KVH * G;
constexpr int TILES = G / HT;
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int vl = lane % LPK;             // lane within its key group
const int vsg = sg * KPS + lane / LPK;  // virtual simdgroup: one token in flight
const int kvh = int(threadgroup_position_in_grid.y) / TILES;
const int g0 = kvh * G + (int(threadgroup_position_in_grid.y) % TILES) * HT;  // first query head of the tile
const int window = params[0];
const int chunk = params[1];
const int pages_per_split = params[2];
const int num_splits = params[3];
const int max_blocks = params[4];
const int num_blocks = params[5];
const int b = int(threadgroup_position_in_grid.z) / num_splits;
const int split = int(threadgroup_position_in_grid.z) % num_splits;

// Visible positions [start, L), as visible_start() in mlxkv/kernels/geometry.py. The host refuses
// tables that disagree with the pool (KernelDispatch); the kernel still never reads outside it:
// L is clamped to what the table row can hold and each block id to the pool.
const int L = metal::clamp(context_lens[b], 0, max_blocks * BS);
int start = 0;
if (window > 0) {
  start = metal::max(start, L - window);
}
if (chunk > 0) {
  start = metal::max(start, ((L - 1) / chunk) * chunk);
}
const int first_page = start / BS;
const int t_begin = metal::max(start, (first_page + split * pages_per_split) * BS);
const int t_end = metal::min(L, (first_page + (split + 1) * pages_per_split) * BS);

// Pre-scaled queries of the tile's HT heads, float32 in registers.
float q[HT][EL];
for (int g = 0; g < HT; ++g) {
  const size_t q_row = (size_t(b) * H + g0 + g) * D;
  for (int i = 0; i < EL; ++i) {
    q[g][i] = static_cast<float>(queries[q_row + vl + LPK * i]) * scale;
  }
}

// Online softmax state per head: running max, running sum, accumulator.
float m[HT];
float l[HT];
float acc[HT][EL];
for (int g = 0; g < HT; ++g) {
  m[g] = -INFINITY;
  l[g] = 0.0f;
  for (int i = 0; i < EL; ++i) {
    acc[g][i] = 0.0f;
  }
}

// The step loop's bounds are the same for every lane of a simdgroup (shuffles stay uniform).
for (int t0 = t_begin + sg * KPS; t0 < t_end; t0 += NV) {
  const int t = t0 + lane / LPK;
  const bool live = t < t_end;
  const int tc = live ? t : t_end - 1;  // a real row either way
  const int block = metal::clamp(block_tables[size_t(b) * max_blocks + tc / BS], 0, num_blocks - 1);
  const size_t slot = (size_t(kvh) * num_blocks + block) * BS + tc % BS;  // the token's row in the pool
  // The kernel's row read: float k[EL], v[EL] = elements vl + LPK * i of K and V row `slot`.
  MLXKV_KV_ROW_READ
  for (int g = 0; g < HT; ++g) {
    float s = 0.0f;
    for (int i = 0; i < EL; ++i) {
      s += q[g][i] * k[i];
    }
    for (int mask = LPK / 2; mask > 0; mask /= 2) {  // sum over the key's LPK lanes
      s += simd_shuffle_xor(s, ushort(mask));
    }
    MLXKV_SCORE_WRITE
    if (live) {
      const float m_new = metal::max(m[g], s);
      const float corr = metal::exp(m[g] - m_new);
      const float p = metal::exp(s - m_new);
      l[g] = l[g] * corr + p;
      for (int i = 0; i < EL; ++i) {
        acc[g][i] = acc[g][i] * corr + p * v[i];
      }
      m[g] = m_new;
    }
  }
}

// Combine the NV virtual simdgroups' states through threadgroup memory.
threadgroup float tg_m[NV * HT];
threadgroup float tg_l[NV * HT];
threadgroup float tg_acc[NV * HT * D];
for (int g = 0; g < HT; ++g) {
  if (vl == 0) {
    tg_m[vsg * HT + g] = m[g];
    tg_l[vsg * HT + g] = l[g];
  }
  for (int i = 0; i < EL; ++i) {
    tg_acc[(vsg * HT + g) * D + vl + LPK * i] = acc[g][i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// Simdgroup sg finalises heads sg, sg + NSG, ...: normalised output and log-sum-exp.
for (int g = sg; g < HT; g += NSG) {
  float top = -INFINITY;
  for (int j = 0; j < NV; ++j) {
    top = metal::max(top, tg_m[j * HT + g]);
  }
  const float top_safe = top == -INFINITY ? 0.0f : top;
  float total = 0.0f;
  float o[DL];
  for (int i = 0; i < DL; ++i) {
    o[i] = 0.0f;
  }
  for (int j = 0; j < NV; ++j) {
    const float w = metal::exp(tg_m[j * HT + g] - top_safe);
    total += w * tg_l[j * HT + g];
    for (int i = 0; i < DL; ++i) {
      o[i] += w * tg_acc[(j * HT + g) * D + lane + 32 * i];
    }
  }
  const bool seen = total != 0.0f;  // NaN inputs propagate, as in the reference
  const size_t out_row = (size_t(b) * H + g0 + g) * num_splits + split;
  for (int i = 0; i < DL; ++i) {
    o_part[out_row * D + lane + 32 * i] = seen ? o[i] / total : 0.0f;
  }
  if (lane == 0) {
    lse[out_row] = seen ? top + metal::log(total) : -INFINITY;
  }
}
