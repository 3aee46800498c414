"""Test oracles: gather each sequence's pages into dense K/V and call the fused SDPA.

Deliberately simple (one sequence at a time, an explicit boolean mask over every position) so
it shares no code path with the paged implementations it checks. It computes in float32 by
default and rounds the output to the query dtype once: MLX's CPU SDPA on float16 inputs is itself
off by up to ~1.6e-3 from the exact answer (measured), more than the 1e-3 float16 tolerance.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.kernels.geometry import default_scale


def gather_dense(
    pages: mx.array, block_table_row: list[int], context_len: int
) -> mx.array:
    """One sequence's first ``context_len`` rows as dense ``(1, kv_heads, context_len, D)``."""
    KVH, _, bs, D = pages.shape
    n_pages = -(-context_len // bs)
    blocks = mx.array(block_table_row[:n_pages], dtype=mx.int32)  # (n_pages,)
    dense = mx.take(pages, blocks, axis=1)  # (KVH, n_pages, bs, D)
    return dense.reshape(KVH, n_pages * bs, D)[:, :context_len][None]  # (1, KVH, L, D)


def visible_mask(context_len: int, window: int | None, chunk_size: int | None) -> mx.array:
    """Boolean ``(context_len,)``: which positions the token at ``context_len - 1`` attends to."""
    pos = mx.arange(context_len)
    query_pos = context_len - 1
    keep = pos <= query_pos
    if window is not None:
        keep = keep & (query_pos - pos < window)
    if chunk_size is not None:
        keep = keep & (pos >= (query_pos // chunk_size) * chunk_size)
    return keep


def dense_paged_attention(
    queries: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: mx.array | None = None,
    compute_dtype: mx.Dtype | None = mx.float32,
) -> mx.array:
    """Gather-then-SDPA oracle with the same signature and output as the paged implementations.

    ``compute_dtype`` (default float32; None keeps the input dtype) is what SDPA runs in.
    """
    D = queries.shape[-1]
    dtype = queries.dtype
    if compute_dtype is not None:
        queries, k_pages, v_pages = (a.astype(compute_dtype) for a in (queries, k_pages, v_pages))
    scale = default_scale(D) if scale is None else scale
    tables = block_tables.tolist()
    outs = []
    for b, L in enumerate(context_lens.tolist()):
        k = gather_dense(k_pages, tables[b], L)  # (1, KVH, L, D)
        v = gather_dense(v_pages, tables[b], L)
        mask = visible_mask(L, window, chunk_size)[None, None, None, :]  # (1, 1, 1, L)
        outs.append(
            mx.fast.scaled_dot_product_attention(
                queries[b : b + 1], k, v, scale=scale, mask=mask,
                sinks=None if sinks is None else sinks.astype(queries.dtype),
            )
        )
    return mx.concatenate(outs, axis=0).astype(dtype)  # (B, H, 1, D)


def dense_attention_mass(
    queries: mx.array,
    k_pages: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    *,
    scale: float | None = None,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """The attention mass by the KV-overflow layer's second score pass (:mod:`mlxkv.kv.overflow.mass`) over each
    sequence's rows gathered densely: float32 ``(B, kv_heads, max_blocks * block_size)``, 0 past the context."""
    from mlxkv.kv.overflow.mass import attention_mass, masked_scores

    KVH, _, bs, D = k_pages.shape
    P = block_tables.shape[1] * bs
    scale = default_scale(D) if scale is None else scale
    out = []
    for b, L in enumerate(context_lens.tolist()):
        mass = mx.zeros((KVH, P), dtype=mx.float32)  # (KVH, P)
        if L > 0:
            keys = gather_dense(k_pages, block_tables[b].tolist(), L)  # (1, KVH, L, D)
            mask = visible_mask(L, window, chunk_size).reshape(1, 1, 1, L)
            seen = attention_mass(masked_scores(queries[b:b + 1], keys, scale, mask), sinks)  # (KVH, L)
            mass = mx.concatenate([seen, mass[:, L:]], axis=1)  # (KVH, P)
        out.append(mass)
    return mx.stack(out)  # (B, KVH, P)
