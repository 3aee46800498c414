"""Helpers shared by the cache-layout tests: a prefill + decode run that records logits, and their distance."""

from itertools import pairwise

import mlx.core as mx


def run(model, caches, prompt, chunks=(), feed=None, steps=24):
    """Prefill ``prompt`` in chunks (split at ``chunks``), then decode ``steps`` tokens. Decoding feeds
    ``feed`` (teacher forcing) when given, else the greedy token. Returns (logits per step, tokens fed)."""
    bounds = [0, *chunks, len(prompt)]
    for a, b in pairwise(bounds):
        logits = model(mx.array(prompt[a:b])[None], cache=caches)[0, -1]  # (vocab,)
    out, fed = [logits], []
    for i in range(steps):
        token = feed[i] if feed is not None else mx.argmax(logits).item()
        fed.append(token)
        logits = model(mx.array([[token]]), cache=caches)[0, -1]  # (vocab,)
        mx.eval(logits)
        out.append(logits)
    return out, fed


def max_diff(a, b):
    """Largest absolute difference between two runs' logits, step by step."""
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b))
