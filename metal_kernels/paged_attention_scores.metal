// The score write of paged_attention.metal's attention-mass variants (KernelSpec "..._scores" in
// mlxkv/kernels/metal_specs.py): it stands for the body's MLXKV_SCORE_WRITE line, which the variants without mass
// delete, so their source is the body without that line.
//
// outputs: scores [B, H, max_blocks * BS] float: element (b, h, t) is query head h's scaled logit of visible
//          position t (t in [start, L)); other elements are left unwritten and paged_mass.metal never reads them.
//
// Each visible position is `live` in exactly one lane group of one split, per head tile, and its LPK lanes hold
// the same reduced score: lane vl == 0 writes it. The logit, not a probability, is stored: a probability needs
// the softmax's final max and sum over every split (and the sink), which exist only after the merge.
if (live && vl == 0) {
  scores[(size_t(b) * H + g0 + g) * (size_t(max_blocks) * BS) + t] = s;
}
