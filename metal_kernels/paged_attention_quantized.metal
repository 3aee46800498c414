// The K/V row read of paged_attention.metal over quantized pages (KernelSpec "paged_attention_quantized"): it
// stands for the body's MLXKV_KV_ROW_READ line and dequantizes MLX's affine planes in registers.
//
// inputs  : k_packed / v_packed [KVH, num_blocks, BS, D * BITS / 32] uint32 (32 / BITS values a word, lowest
//           bits first, as mx.quantize packs them), k_scales / k_biases / v_scales / v_biases
//           [KVH, num_blocks, BS, D / GS] T (one scale and bias per group of GS elements along D)
// template: BITS (4 or 8), GS (32, 64 or 128, divides D)
//
// Element d of a row: q = (packed[d / PW] >> ((d % PW) * BITS)) & MASK, value = scale[d / GS] * q + bias[d / GS],
// in float32 (mx.dequantize with float32 scales and biases). A lane's elements d = vl + LPK * i share their
// words with the key group's neighbouring lanes, so a key group's word loads stay contiguous.
constexpr int PW = 32 / BITS;               // values per packed word
constexpr uint MASK = (1u << BITS) - 1u;
constexpr int WPR = D / PW;                 // packed words per row
constexpr int GPR = D / GS;                 // scale / bias groups per row
const size_t words = slot * WPR;
const size_t groups = slot * GPR;
float k[EL];
float v[EL];
for (int i = 0; i < EL; ++i) {
  const int d = vl + LPK * i;
  const uint shift = uint(d % PW) * uint(BITS);
  const size_t w = words + d / PW;
  const size_t gi = groups + d / GS;
  const float kq = static_cast<float>((k_packed[w] >> shift) & MASK);
  const float vq = static_cast<float>((v_packed[w] >> shift) & MASK);
  k[i] = static_cast<float>(k_scales[gi]) * kq + static_cast<float>(k_biases[gi]);
  v[i] = static_cast<float>(v_scales[gi]) * vq + static_cast<float>(v_biases[gi]);
}
