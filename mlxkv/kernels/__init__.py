"""Paged-attention kernels: pure-MLX references, Metal kernels, dispatch and runtime self-check.

Data layout (the paged cache storage is built on this)
-----------------------------------------------------
- K and V page arrays, one pair per layer: ``[kv_heads, num_blocks, block_size, head_dim]``
  (head-outermost: kv head ``h``'s rows of page ``b`` are one contiguous ``block_size * head_dim``
  run, and so are its rows of any run of consecutive pages). On CPU this is what matters: the
  reference gathers whole runs straight into the ``(kv_heads, tokens, head_dim)`` layout its
  matmuls read, and pages that are physically consecutive are a zero-copy view in exactly the
  layout of a dense cache. Block 0 is the null block: padding entries of block tables point at it
  and it is never read unmasked. Flat slot ``block_id * block_size + offset`` names one token
  position of a page (row ``offset`` of page ``block_id`` in every kv head).
- ``block_tables``: int32 ``[B, max_blocks_per_seq]``; row ``b`` lists sequence ``b``'s pages in
  position order (page ``p`` holds positions ``p*block_size .. p*block_size + block_size - 1``),
  padded with 0.
- ``context_lens``: int32 ``[B]``, the tokens visible to each sequence *including* the current
  token, which must already be written (its position is ``context_lens[b] - 1``).
- ``queries``: ``[B, n_heads, 1, head_dim]``, one decode token per sequence;
  ``n_heads = kv_heads * gqa`` and query head ``h`` reads kv head ``h // gqa`` (mlx-lm's order).
- Options: ``window`` W (sliding: attend to the last W positions, the current one included),
  ``chunk_size`` C (Llama-4 chunked: attend from ``(L-1)//C*C``), ``sinks`` (``[n_heads]`` sink
  logits, unscaled, as ``mx.fast.scaled_dot_product_attention(..., sinks=)``), ``scale``
  (default ``1/sqrt(head_dim)``).
- Output: ``[B, n_heads, 1, head_dim]`` in the query dtype. Softmax state is float32 throughout.
- Attention mass (``with_mass=True``, off by default): also float32 ``[B, kv_heads, max_blocks_per_seq *
  block_size]``, per logical position of the block table the softmax probability summed over the kv head's query
  heads (0 where not visible); what the heavy-hitter KV-overflow policies rank positions by.
- KV write: ``slot_mapping`` int32 ``[T]`` (distinct flat slots) and new rows
  ``[T, kv_heads, head_dim]`` for K and for V; returns the updated pools. Keep each pool
  referenced in one place and rebind it to the result, or MLX copies the pool (see
  :mod:`mlxkv.kernels.kv_write_ref`).

Modules
-------
``geometry`` (visible ranges, split plans, input and table checks, tolerances) · ``paged_attention_ref``
(reference twin, split-K + log-sum-exp merge) · ``page_views_ref`` (shared prefixes as page views) ·
``kv_write_ref`` (MLX's scatter) · ``cascade`` (shared-prefix attention) · ``metal_specs`` / ``metal``
(Metal sources, factories) · ``variants`` (every launch the factories emit, for the checks) ·
``quantized_paged_ref`` / ``metal_quantized`` (decode over quantized pages) · ``paged_mass_ref`` (the attention-mass
output, ``with_mass=True``) · ``selfcheck`` · ``dispatch`` (``MLXKV_PAGED_KERNEL``).
"""

from .cascade import PrefixGroup, cascade_attention, find_prefix_groups
from .dispatch import (
    KernelDispatch,
    kv_write,
    paged_attention,
    quantized_paged_attention,
    reference_on_views,
)
from .geometry import TOLERANCES, SplitPlan, plan_splits
from .kv_write_ref import kv_write_reference
from .paged_attention_ref import merge_partials, paged_attention_reference
from .paged_mass_ref import MASS_TOLERANCE, mass_from_scores
from .quantized_paged_ref import quantized_paged_attention_reference

__all__ = [
    "KernelDispatch",
    "MASS_TOLERANCE",
    "PrefixGroup",
    "SplitPlan",
    "TOLERANCES",
    "cascade_attention",
    "find_prefix_groups",
    "kv_write",
    "kv_write_reference",
    "mass_from_scores",
    "merge_partials",
    "paged_attention",
    "paged_attention_reference",
    "quantized_paged_attention",
    "quantized_paged_attention_reference",
    "reference_on_views",
    "plan_splits",
]
