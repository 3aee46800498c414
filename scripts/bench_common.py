"""Shared benchmark plumbing: OpenBLAS preloading, random-weight models, timing helpers."""

from __future__ import annotations

import os
import sys
import time

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def ensure_openblas() -> str:
    """Re-exec this script with Debian's OpenBLAS preloaded when it is installed; return the BLAS in use.

    MLX's Linux CPU wheel bundles a slow reference BLAS; both sides of every comparison run in this one
    process, so they always share the same BLAS.
    """
    if sys.platform != "linux":
        return "platform default (Accelerate on macOS)"
    if OPENBLAS in os.environ.get("LD_PRELOAD", ""):
        return f"OpenBLAS ({OPENBLAS})"
    if os.path.exists(OPENBLAS) and os.environ.get("MLXKV_BENCH_NO_OPENBLAS") != "1":
        env = {**os.environ, "LD_PRELOAD": OPENBLAS}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return "MLX's bundled reference BLAS (install libopenblas0-pthread for ~30x faster prefill)"


def random_llama(hidden: int, layers: int, vocab: int, heads: int = 16, kv_heads: int = 4, seed: int = 0):
    """A random-weight float32 llama of the given size, built in memory (no download)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                     intermediate_size=hidden * 3, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=True)
    model = Model(args)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, params


def timed_tokens(token_iter, n_tokens: int) -> tuple[float, float]:
    """Consume a token generator; return (seconds to the first token, decode tok/s after it)."""
    start = time.perf_counter()
    first = None
    count = 0
    for _ in token_iter:
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == n_tokens:
            break
    end = time.perf_counter()
    decode = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    return first - start, decode
