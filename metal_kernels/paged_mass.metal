// Attention mass per cached position from the mass variant's logits: the split-K rescale of the probabilities.
// Body-only source for mx.fast.metal_kernel (KernelSpec "paged_mass" in mlxkv/kernels/metal_specs.py); twin of
// mass_from_scores in mlxkv/kernels/paged_attention_ref.py.
//
// inputs : scores [B, H, P] float (paged_attention_scores.metal: logits at visible positions only),
//          lse [B, H, S] float (the partials' per-split log-sum-exps), sinks [H] float (ignored unless
//          HAS_SINKS), context_lens [B] int32, params int32 {window, chunk, S, P}
// outputs: mass [B, KVH, P] float: sum over the G query heads of kv head kvh of the softmax probability of
//          position t; 0 outside the visible positions [start, L)
// template: KVH, G, HAS_SINKS
// grid   : (ceil(P / TX) * TX, KVH, B) threads, threadgroup (TX, 1, 1), TX = min(256, P rounded up to 32)
//
// Split s's normalised probability of a token is exp(score - lse_s) and the final one is that times
// exp(lse_s - LSE), where LSE = log(sum_s exp(lse_s) + exp(sink)) is the merged log-sum-exp (as in
// paged_merge.metal). Their product is exp(score - LSE): each position's logit is exponentiated once against
// the merged statistics, computed per head as the merge does (top = largest lse or sink, exp(-inf) == 0 for
// empty splits under math_mode "safe").
const int t = int(thread_position_in_grid.x);
const int kvh = int(thread_position_in_grid.y);
const int b = int(thread_position_in_grid.z);
const int window = params[0];
const int chunk = params[1];
const int S = params[2];
const int P = params[3];
if (t < P) {
  // Visible positions [start, L), as visible_start() in mlxkv/kernels/geometry.py and the decode body.
  const int L = metal::clamp(context_lens[b], 0, P);
  int start = 0;
  if (window > 0) {
    start = metal::max(start, L - window);
  }
  if (chunk > 0) {
    start = metal::max(start, ((L - 1) / chunk) * chunk);
  }
  float total = 0.0f;
  if (t >= start && t < L) {
    for (int g = 0; g < G; ++g) {
      const int h = kvh * G + g;
      const size_t row = (size_t(b) * KVH * G + h) * S;
      float top = -INFINITY;
      for (int s = 0; s < S; ++s) {
        top = metal::max(top, lse[row + s]);
      }
      if (HAS_SINKS) {
        top = metal::max(top, sinks[h]);
      }
      const float top_safe = top == -INFINITY ? 0.0f : top;
      float denom = 0.0f;
      for (int s = 0; s < S; ++s) {
        denom += metal::exp(lse[row + s] - top_safe);
      }
      if (HAS_SINKS) {
        denom += metal::exp(sinks[h] - top_safe);
      }
      const float score = scores[(size_t(b) * KVH * G + h) * P + t];
      total += denom != 0.0f ? metal::exp(score - top_safe) / denom : 0.0f;
    }
  }
  mass[(size_t(b) * KVH + kvh) * P + t] = total;
}
