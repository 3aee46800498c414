"""One request's life on a CachePool, as the tier tests drive it: open (a paged backend restores what its tier
holds), prefill the uncached rest, commit, release."""

from __future__ import annotations

import mlx.core as mx


def prefill_and_release(pool, tokens: list[int]) -> tuple[mx.array, int]:
    """Run ``tokens`` through a fresh sequence of ``pool``; returns (last position's logits, tokens it found cached).
    The pool's invariants are checked after the release."""
    seq = pool.open(prompt=tokens)
    cached = seq.num_cached
    out = pool.model(mx.array(tokens[cached:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]  # (vocab,)
    mx.eval(out)
    seq.commit()
    pool.release(seq.id)
    pool.check_invariants()
    return out, cached
