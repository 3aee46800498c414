"""Prompt prefill: the prompt through the model in chunks, optionally padded to a tile multiple.

Every prompt token but the last fills the caches in chunks whose logits are never computed; the last
token then runs alone for its logits (as mlx-lm's ``generate_step`` does). Padded prefill runs the last
of those chunks right-padded to a multiple of ``PAD_TILE`` tokens (so every chunk forward has a
tile-aligned length) and trims the pad tokens back out of every cache before the last token. Causal attention keeps the pad tokens from touching real positions,
and mlxkv's exact ``trim`` removes them from the caches, so logits and cache contents equal the
unpadded run's.

It applies only where every layer can drop the pad exactly (:func:`supports_padded_prefill`):
standard and rotating layouts (rotating: ``max_rewind >= PAD_TILE - 1``) and mlx-lm's ``KVCache``.
Recurrent hybrids never pad (their state cannot be rewound), nor do chunked-attention models (kept
out by design, although mlxkv's chunked ``trim`` would drop the pad exactly).

Default: off. On the CPU backend padding showed no gain (68M-param llama, OpenBLAS, 2 shared cores,
best of 4 alternating runs, padded vs unpadded: 500 tokens 1.53 vs 1.54 s, 1000 tokens 4.38 vs
4.54 s, 1017 tokens 5.27 vs 4.76 s — within the machine's noise) while it adds up to ``PAD_TILE - 1``
tokens of work; the gain it is meant for (shape-stable kernels and compiled graphs on Metal) is not
measured yet. ``MLXKV_FORCE_PADDED_PREFILL=1`` turns it on where supported;
``MLXKV_NO_PADDED_PREFILL=1`` turns it off and wins over FORCE.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlxkv import env
from mlxkv.kv import cache_arrays, can_drop_tokens, each_layer_cache
from mlxkv.vision.spans import chunk_embeddings

#: Pad the last chunk to a multiple of this many tokens.
PAD_TILE = 32

#: Whether padding is on when no flag says otherwise (see the module docstring).
PADDED_PREFILL_DEFAULT = False

#: Interruptible prefill (``should_stop`` given): the first chunk's tokens, and the seconds each later chunk is
#: sized to take from the rate measured so far, so a stop request is seen within about that long on any backend
#: (SmolLM2 Q4_1 on a CPU prefills ~9 tok/s, the same model on a GPU thousands).
INTERRUPTIBLE_FIRST_CHUNK = 8
INTERRUPTIBLE_CHUNK_SECONDS = 0.2


class PrefillStopped(Exception):
    """``should_stop`` turned true between two prefill chunks; ``done`` prompt tokens are in the caches."""

    def __init__(self, done: int):
        super().__init__(f"prefill stopped after {done} tokens")
        self.done = done


def supports_padded_prefill(model: Any, caches: list) -> bool:
    """True when every layer's cache can drop pad tokens exactly (no chunked or recurrent layers)."""
    return can_drop_tokens(caches, PAD_TILE - 1)


def padded_prefill_enabled(model: Any, caches: list) -> bool:
    """Whether :func:`prefill` pads for this model: supported, and the flags (or the default) say so."""
    override = env.flags().padded_prefill
    if override is False or not supports_padded_prefill(model, caches):
        return False
    return PADDED_PREFILL_DEFAULT if override is None else True


def prefill(model: Any, caches: list, tokens: mx.array, step_size: int = 2048, seq: Any = None,
            start: int = 0, should_stop: Callable[[], bool] | None = None, media: Sequence[Any] = ()) -> mx.array:
    """Run the prompt ``tokens`` (1-D) through ``model``, filling ``caches``.

    Args:
        model: an mlx-lm model (attention hook installed or not).
        caches: one cache per layer (``make_caches`` or mlx-lm's), empty or holding a prefix.
        tokens: the prompt token ids, shape ``(n,)``.
        step_size: tokens per forward; the last chunk holds the rest.
        seq: the pool's handle of the sequence (optional): chunks end where it asks
            (:meth:`~mlxkv.kv.sequence.Sequence.prefill_chunk`: recurrent-state snapshots) and it is committed
            after each; ``start``: the sequence position of ``tokens[0]`` (its cached prefix).
        should_stop: checked before each chunk; chunks are then sized to take about
            :data:`INTERRUPTIBLE_CHUNK_SECONDS` each (at most ``step_size``), so a stop is seen quickly.
        media: the prompt's images (:class:`mlxkv.vision.spans.ImageSpan`, positions in the sequence, so
            ``start`` matters): chunks holding their placeholders go in as input embeddings.

    Returns:
        The last prompt token's logits, shape ``(vocab,)``.

    Raises:
        ValueError: empty prompt, non 1-D tokens, or ``step_size < 1``.
        PrefillStopped: ``should_stop`` returned true; the caches hold the chunks run before it.
    """
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
    if step_size < 1:
        raise ValueError(f"step_size must be >= 1, got {step_size}")
    # All but the last token fill the caches without their logits ever being computed (MLX is lazy and only
    # the caches are evaluated), as mlx-lm does; the last token then runs alone for the logits we need.
    body = tokens[:-1]  # (n - 1,)
    pad_enabled = padded_prefill_enabled(model, caches)
    pos = 0
    want = step_size if should_stop is None else min(step_size, INTERRUPTIBLE_FIRST_CHUNK)
    while pos < body.size:
        if should_stop is not None and should_stop():
            raise PrefillStopped(pos)
        began = time.perf_counter()
        n = want if seq is None else seq.prefill_chunk(start + pos, want)
        chunk = body[pos:pos + n]  # (L,)
        real = chunk.size
        final = pos + real == body.size
        pad = -real % PAD_TILE if final and pad_enabled else 0
        if pad:
            chunk = mx.concatenate([chunk, mx.repeat(chunk[-1:], pad)])  # (L + pad,) any valid id will do
        out = _forward(model, chunk, caches, start + pos, media)  # (1, L + pad, vocab)
        for c in each_layer_cache(caches) if pad else ():
            removed = c.trim(pad)
            assert removed == pad, f"{type(c).__name__} dropped {removed} of {pad} pad tokens"
        # a pipeline-parallel rank's caches do not need the hidden state it sends on: its outputs do
        mx.eval(cache_arrays(caches), *([out] if getattr(model, "eval_outputs", False) else []))
        pos += real
        if seq is not None:
            seq.commit()  # these positions are verified (paged: a snapshot due here is taken)
        if should_stop is not None:  # size the next chunk to the rate just measured
            rate = real / max(time.perf_counter() - began, 1e-6)
            want = max(1, min(step_size, int(rate * INTERRUPTIBLE_CHUNK_SECONDS)))
    if should_stop is not None and should_stop():
        raise PrefillStopped(pos)
    logits = _forward(model, tokens[-1:], caches, start + body.size, media)  # (1, 1, vocab)
    return logits[0, -1]  # (vocab,)


def _forward(model: Any, chunk: mx.array, caches: list, at: int, media: Sequence[Any]) -> mx.array:
    """``chunk`` ``(L,)`` at sequence position ``at`` through ``model``: as input embeddings where it holds image
    placeholders, else as token ids."""
    embeddings = chunk_embeddings(model, chunk, at, media) if media else None  # (1, L, hidden)
    if embeddings is None:
        return model(chunk[None], cache=caches)
    return model(chunk[None], cache=caches, input_embeddings=embeddings)
