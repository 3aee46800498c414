"""Building a single-sequence engine from user options (what `mlxkv generate` asks for)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlxkv.engine.direct import DirectEngine
from mlxkv.kv import CachePool, KvCacheConfig, paged_blocks_for


@dataclass(slots=True)
class EngineOptions:
    """KV-cache and speculation options of one `generate` run.

    Attributes:
        kv_backend: "dense" (per-sequence buffers) or "paged" (blocks of one pool, prefix caching).
        kv_block_size: tokens per block (paged).
        max_kv_size: cap on cached tokens per layer (dense: rotating past it).
        kv_bits / kv_group_size: quantized K/V (4 or 8 bits; groups of 32, 64, 128).
        draft_model: a second model (repo id or folder) drafting tokens for speculative decoding.
        prompt_lookup: draft by n-gram lookup over the prompt and output (no second model).
        num_draft_tokens / ngram_size: tokens drafted per round; n-gram length for prompt lookup.
        dequantize: load the draft model's quantized weights unquantized, as the target's were.
    """

    kv_backend: str = "dense"
    kv_block_size: int = 16
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    draft_model: str | None = None
    prompt_lookup: bool = False
    num_draft_tokens: int = 3
    ngram_size: int = 3
    dequantize: bool = False

    def __post_init__(self) -> None:
        if self.kv_backend not in ("dense", "paged"):
            raise ValueError(f"kv_backend must be one of dense, paged, got {self.kv_backend!r}")
        if self.kv_backend == "paged" and (self.max_kv_size is not None or self.kv_bits is not None):
            raise ValueError("--kv-backend paged does not support --max-kv-size or --kv-bits yet: use dense")
        if self.draft_model and self.prompt_lookup:
            raise ValueError("choose one drafting mode: --draft-model or --prompt-lookup, not both")
        if self.num_draft_tokens < 1 or self.ngram_size < 1:
            raise ValueError("--num-draft-tokens and --ngram-size must be >= 1")

    @property
    def speculative(self) -> bool:
        return bool(self.draft_model) or self.prompt_lookup


def _pool(model: Any, options: EngineOptions, context_tokens: int) -> CachePool:
    if options.kv_backend == "paged":
        # One sequence: size the pool for its context instead of a share of free memory.
        config = KvCacheConfig(backend="paged", block_size=options.kv_block_size)
        blocks = paged_blocks_for(model, options.kv_block_size, context_tokens)
        return CachePool(model, max_sequences=1, backend="paged", kv_config=config, num_blocks=blocks)
    return CachePool(model, max_sequences=1, max_kv_size=options.max_kv_size, kv_bits=options.kv_bits,
                     kv_group_size=options.kv_group_size)


def build_engine(loaded: Any, options: EngineOptions, context_tokens: int) -> DirectEngine:
    """A DirectEngine (or SpeculativeEngine when a drafting mode is set) over a one-sequence pool.

    ``context_tokens`` (prompt + new tokens) sizes a paged pool. Speculation works over either backend
    (the draft model's own pool is dense).

    Raises:
        ValueError: incompatible options, or a draft model whose vocabulary differs from the target's.
        mlxkv.models.ModelLoadError: the draft model cannot be loaded.
    """
    # A verify forward holds up to num_draft_tokens unverified positions past the context at once.
    spare = options.num_draft_tokens if options.speculative else 0
    pool = _pool(loaded.model, options, context_tokens + spare)
    if not options.speculative:
        return DirectEngine(loaded.model, loaded.tokenizer, pool=pool)
    from mlxkv.engine.drafters import DraftModelDrafter, PromptLookupDrafter
    from mlxkv.engine.speculative import SpeculativeEngine

    if options.prompt_lookup:
        drafter = PromptLookupDrafter(ngram_size=options.ngram_size)
    else:
        from mlxkv.models import load

        draft = load(options.draft_model, dequantize=options.dequantize)
        # The draft's caches stay dense (one sequence, rewound every round): no prefix caching to gain.
        dense = dataclasses.replace(options, kv_backend="dense")
        drafter = DraftModelDrafter(draft.model, pool=_pool(draft.model, dense, context_tokens))
    return SpeculativeEngine(loaded.model, loaded.tokenizer, drafter, num_draft_tokens=options.num_draft_tokens,
                             pool=pool)
