"""Building engines and their KV store from a :class:`~mlxkv.config.RunConfig` — the same way for ``mlxkv
generate`` (one sequence) and ``mlxkv serve`` (a batch engine)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mlxkv.config import KvCacheConfig, RunConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.kv import CachePool, paged_blocks_for

#: Share of free memory a served paged pool may take when no ``--kv-cache-budget`` is given.
AUTO_FREE_FRACTION = 0.5


def build_pool(model: Any, kv: KvCacheConfig, *, max_sequences: int, context_tokens: int | None) -> CachePool:
    """The KV store of ``model`` for ``max_sequences`` sequences of up to ``context_tokens`` tokens each.

    Paged without a byte budget: one sequence gets the blocks its context needs; several share a pool of
    ``max_sequences`` full contexts, at most ``AUTO_FREE_FRACTION`` of free memory.

    Raises:
        ValueError: options that apply to the other backend.
    """
    if kv.backend == "dense":
        return CachePool(model, max_sequences=max_sequences, layout=kv.layout, max_kv_size=kv.max_kv_size,
                         kv_bits=kv.kv_bits, kv_group_size=kv.kv_group_size, overflow=kv.overflow)
    if kv.max_kv_size is not None or kv.layout != "mlxkv":
        raise ValueError("--max-kv-size and --cache-layout apply to the dense backend: add --kv-backend dense")
    num_blocks = None
    if kv.kv_cache_budget == "auto" and kv.max_tokens is None:
        if max_sequences == 1 and context_tokens:  # one sequence: its context, not a share of free memory
            num_blocks = paged_blocks_for(model, kv.block_size, context_tokens)
        elif max_sequences > 1:
            kv = dataclasses.replace(kv, max_tokens=max_sequences * context_tokens if context_tokens else None,
                                     free_memory_fraction=min(kv.free_memory_fraction, AUTO_FREE_FRACTION))
    return CachePool(model, max_sequences=max_sequences, backend="paged", kv_config=kv, num_blocks=num_blocks,
                     overflow=kv.overflow)


def load_draft_model(run: RunConfig, target: Any, *, progress: bool = False) -> Any:
    """``run.speculative.draft_model`` loaded (``run.dequantize`` as the target's) and checked against the ``target``
    model: a draft proposes the target's token ids, so both must have one vocabulary.

    Raises:
        ValueError: the draft's vocabulary differs from the target's.
        mlxkv.models.ModelLoadError: it cannot be loaded.
    """
    from mlxkv.engine.batch import vocab_size_of
    from mlxkv.models import load

    draft = load(run.speculative.draft_model, progress=progress, dequantize=run.dequantize)
    ours, theirs = vocab_size_of(draft.model), vocab_size_of(target)
    if ours != theirs:
        raise ValueError(f"the draft model's vocabulary has {ours} entries, the target's {theirs}: a draft model "
                         "must share the target's tokenizer and vocabulary")
    return draft


def draft_model_rows(draft_model: Any, run: RunConfig, *, target_tokens: int, max_sequences: int) -> Any:
    """The draft model's rows for speculation on the engine step (``mlxkv serve``, ``generate`` and ``chat``
    ``--draft-model``): ``draft_model`` over a paged pool of its own, full-precision pages with prefix caching,
    holding ``target_tokens`` (what the target's store holds, so that admission decided on the target's never
    waits for the draft's) plus each of ``max_sequences`` sequences' unverified drafts: a
    :class:`~mlxkv.engine.draft_rows.DraftModelRows`.

    Raises:
        ValueError: the draft's layers cannot rewind exactly (sliding-window, chunked or recurrent).
    """
    from mlxkv.engine.draft_rows import DraftModelRows, draft_pool_blocks
    from mlxkv.engine.speculation import check_pool

    spec = run.speculative
    kv = KvCacheConfig(backend="paged", block_size=run.kv.block_size, hash_algo=run.kv.hash_algo)
    pool = CachePool(draft_model, max_sequences=max_sequences * 2, backend="paged", kv_config=kv,
                     num_blocks=draft_pool_blocks(target_tokens, max_sequences, spec.num_draft_tokens, kv.block_size))
    check_pool(pool, whose="the draft model's")
    return DraftModelRows(draft_model, pool)


def build_engine(loaded: Any, run: RunConfig, context_tokens: int, *, seeded_sampling: bool = False) -> DirectEngine:
    """A DirectEngine over a one-sequence store sized for ``context_tokens`` (prompt + new tokens).

    ``--prompt-lookup`` and ``--draft-model`` speculate on the engine step, as ``mlxkv serve`` does (the draft model
    over its own paged pool, :func:`draft_model_rows`). Over layers the step cannot rewind (recurrent state,
    windows; the target's or the draft's) and for ``seeded_sampling`` (the step's rows draw a seeded stream one
    token at a time; distributed ranks always sample from a shared seed), a
    :class:`~mlxkv.engine.speculative.SpeculativeEngine` drafts and verifies in rounds instead (it snapshots and
    replays recurrent state, and draws every round from the one seeded stream).

    Raises:
        ValueError: incompatible options, or a draft model whose vocabulary differs from the target's.
        mlxkv.models.ModelLoadError: the draft model cannot be loaded.
    """
    spec = run.speculative
    # A verify forward holds up to num_draft_tokens unverified positions past the context at once.
    spare = spec.num_draft_tokens if spec.enabled else 0
    pool = build_pool(loaded.model, run.kv, max_sequences=1, context_tokens=context_tokens + spare)
    if not spec.enabled:
        return DirectEngine(loaded.model, loaded.tokenizer, pool=pool)
    from mlxkv.engine.drafters import DraftModelDrafter, PromptLookupDrafter
    from mlxkv.engine.speculation import Speculation, check_pool
    from mlxkv.engine.speculative import SpeculativeEngine

    draft = load_draft_model(run, loaded.model) if spec.draft_model else None
    if not seeded_sampling:
        try:
            check_pool(pool)
            rows = None if draft is None else draft_model_rows(draft.model, run, target_tokens=context_tokens + spare,
                                                               max_sequences=1)
        except ValueError:  # caches the step cannot rewind: the rounds replay recurrent state (and refuse the rest)
            pass
        else:
            speculation = Speculation(num_draft_tokens=spec.num_draft_tokens, ngram_size=spec.ngram_size, draft=rows)
            return DirectEngine(loaded.model, loaded.tokenizer, pool=pool, speculation=speculation)
    if draft is None:
        drafter: Any = PromptLookupDrafter(ngram_size=spec.ngram_size)
    else:
        # The rounds' draft caches stay dense (one sequence, rewound every round): no prefix caching to gain.
        dense = dataclasses.replace(run.kv, backend="dense")
        drafter = DraftModelDrafter(draft.model, pool=build_pool(draft.model, dense, max_sequences=1,
                                                                 context_tokens=context_tokens))
    return SpeculativeEngine(loaded.model, loaded.tokenizer, drafter, num_draft_tokens=spec.num_draft_tokens,
                             pool=pool)
