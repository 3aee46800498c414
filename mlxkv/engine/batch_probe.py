"""Checks once, at engine start, that batch views give the same next tokens as one-by-one decoding, and that
batched prefill (:mod:`mlxkv.engine.prefill_batch`) gives the same logits as one-by-one prefill.

Some architectures read cache internals batch views do not have (e.g. mlx-lm's llama4 builds its chunk mask
from ``cache.start_position``), and batch views need mlxkv's attention hook. The probe runs two sequences of
different lengths through one batched decode forward and through separate forwards on copies of their
caches (paged pools: through their own sequences, under a probe-only cache salt, since paged caches share one
page array and cannot be copied); the engine batches only when the probe passes, and otherwise decodes
sequences one by one.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from mlxkv.engine.prefill_batch import prefill_together
from mlxkv.kv import CachePool, CacheRequest, cache_arrays, check_attended, make_batch_views

_PROMPTS = ([3, 17, 9, 41, 5], [11, 7, 23])  # different lengths, small ids valid in any vocabulary


def probe_batched_decode(model: Any, pool: CachePool) -> tuple[bool, str]:
    """Return ``(True, "ok")`` when a batched decode step matches per-sequence decoding, else
    ``(False, reason)``. Uses two pool sequences, released before returning."""
    if pool.max_sequences - len(pool) < 2:
        return False, "no room in the pool for the probe"
    if pool.is_paged:
        return _probe_paged(model, pool)
    seqs = []
    try:
        for prompt in _PROMPTS:
            seq = pool.open(prompt_length=len(prompt))
            seqs.append(seq)
            # the logits too: under pipeline parallelism only they need the hidden state a rank sends on
            mx.eval(model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=seq.caches))
        copies = [copy.deepcopy(s.caches) for s in seqs]
        last = mx.array([[p[-1]] for p in _PROMPTS], dtype=mx.uint32)  # (2, 1)
        views = make_batch_views([s.caches for s in seqs])
        batched = model(last, cache=views)[:, -1, :]  # (2, vocab)
        check_attended(views)
        single = mx.concatenate([model(last[b : b + 1], cache=c)[:, -1, :] for b, c in enumerate(copies)])
        mx.eval(batched, single)
        return _compare(batched, single)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not batch this model
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        for seq in seqs:
            pool.release(seq.id)


def _compare(batched: mx.array, single: mx.array) -> tuple[bool, str]:
    if batched.shape != single.shape:
        return False, f"batched logits have shape {batched.shape}, expected {single.shape}"
    if not mx.array_equal(mx.argmax(batched, axis=-1), mx.argmax(single, axis=-1)).item():
        return False, "the batched run picks different tokens than one-by-one runs"
    scale = mx.abs(single).max().item() + 1e-6
    err = mx.abs(batched.astype(mx.float32) - single.astype(mx.float32)).max().item()
    if err > 1e-2 * scale:
        return False, f"batched logits differ from one-by-one by {err:.3g} (scale {scale:.3g})"
    return True, "ok"


def _probe_paged(model: Any, pool: CachePool) -> tuple[bool, str]:
    """The probe over paged sequences: one by one first (each opened, decoded once, released), then both in
    one batched forward, each run under its own salt so no run reuses another's blocks."""
    last = mx.array([[p[-1]] for p in _PROMPTS], dtype=mx.uint32)  # (2, 1)
    seqs: list = []

    def open_prefilled(prompt: list[int], salt: str):
        seq = pool.open(prompt_length=len(prompt), prompt=prompt, cache_request=CacheRequest(salt=salt))
        seqs.append(seq)
        logits = model(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=seq.caches)  # (1, n, vocab)
        # the logits too: under pipeline parallelism only they need the hidden state a rank sends on
        mx.eval(cache_arrays(seq.caches), logits)
        seq.commit()
        seq.reserve_last()  # the pending last prompt token's slot, as the scheduler takes it
        return seq

    try:
        rows = []
        for b, prompt in enumerate(_PROMPTS):
            seq = open_prefilled(prompt, f"mlxkv-probe-single-{b}")
            rows.append(model(last[b : b + 1], cache=seq.caches)[:, -1, :])
            mx.eval(rows[-1])
            pool.release(seqs.pop().id)
        single = mx.concatenate(rows)  # (2, vocab)
        pair = [open_prefilled(p, f"mlxkv-probe-batch-{b}") for b, p in enumerate(_PROMPTS)]
        views = make_batch_views([s.caches for s in pair])
        batched = model(last, cache=views)[:, -1, :]  # (2, vocab)
        check_attended(views)
        mx.eval(batched)
        return _compare(batched, single)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not batch this model
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        for seq in seqs:
            pool.release(seq.id)


def probe_batched_prefill(model: Any, pool: CachePool) -> tuple[bool, str]:
    """Return ``(True, "ok")`` when prefilling two prompts of different lengths in one forward gives the last
    positions' logits of prefilling each alone, else ``(False, reason)``. Each run opens its own sequences (under
    probe-only cache salts on paged pools, so no run reuses another's blocks), released before returning."""
    if pool.max_sequences - len(pool) < 2:
        return False, "no room in the pool for the probe"
    seqs: list = []

    def opened(prompt: list[int], salt: str):
        seqs.append(pool.open(prompt_length=len(prompt), prompt=prompt, cache_request=CacheRequest(salt=salt)))
        return seqs[-1]

    try:
        rows = []
        for b, prompt in enumerate(_PROMPTS):
            seq = opened(prompt, f"mlxkv-probe-prefill-single-{b}")
            rows.append(model(mx.array(prompt, dtype=mx.uint32)[None], cache=seq.caches)[:, -1, :])  # (1, vocab)
            mx.eval(rows[-1])
            pool.release(seqs.pop().id)
        single = mx.concatenate(rows)  # (2, vocab)
        pair = [opened(p, f"mlxkv-probe-prefill-batch-{b}") for b, p in enumerate(_PROMPTS)]
        batched = prefill_together(model, [s.caches for s in pair], list(_PROMPTS))  # (2, vocab)
        return _compare(batched, single)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not batch prefills for this model
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        for seq in seqs:
            pool.release(seq.id)
