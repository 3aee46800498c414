"""Quantized paged KV pages on the real SmolLM2-135M-Instruct (head_dim 64, groups of 64): greedy tokens equal the
dense quantized cache's, step for step, at 8 and 4 bits. Needs ``MLXKV_TEST_GGUF`` (see tests/test_real_model.py); skipped without it.

Tolerance: both sides store the same quantized planes (each row quantized on its own) and attend them with the same
``quantized_attend``; full-attention layers return the rows in the same order, so the logits agree to float32
rounding of the paged path's view-vs-buffer reads (at most 1e-4 of the logit scale; measured 0).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.float_order]
PROMPT = "What are the main differences between Python lists and tuples?"
STEPS = 8


def run(model, caches, prompt: list[int], seq=None) -> tuple[list[int], list[mx.array]]:
    """Greedy: prefill, then ``STEPS`` decode steps; (tokens, logits per step)."""
    logits = model(mx.array(prompt, dtype=mx.uint32)[None], cache=caches)[0, -1]
    tokens, all_logits = [], [logits]
    for _ in range(STEPS):
        if seq is not None:
            seq.commit()
        tokens.append(int(mx.argmax(logits).item()))
        if seq is not None:
            seq.feed(tokens[-1:])
        logits = model(mx.array(tokens[-1:], dtype=mx.uint32)[None], cache=caches)[0, -1]
        mx.eval(logits)
        all_logits.append(logits)
    return tokens, all_logits


@pytest.mark.parametrize("bits", [8, 4])
def test_real_model_paged_quantized_equals_dense_quantized(smollm2, bits):
    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.layouts import make_caches
    from mlxkv.kv.store import CachePool

    prompt = smollm2.tokenizer.encode(PROMPT)
    pool = CachePool(smollm2.model, backend="paged", num_blocks=64,
                     kv_config=KvCacheConfig(backend="paged", block_size=16, kv_bits=bits, kv_group_size=64))
    seq = pool.open(prompt=prompt)
    paged_tokens, paged_logits = run(smollm2.model, seq.caches, prompt, seq)
    dense_tokens, dense_logits = run(smollm2.model, make_caches(smollm2.model, kv_bits=bits, kv_group_size=64), prompt)
    assert paged_tokens == dense_tokens and len(set(dense_tokens)) > 3
    scale = max(1.0, max(mx.abs(d).max().item() for d in dense_logits))
    assert max(mx.abs(p - d).max().item() for p, d in zip(paged_logits, dense_logits)) <= 1e-4 * scale
    pool.release(seq.id)
