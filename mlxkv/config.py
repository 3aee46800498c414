"""Configuration: one dataclass per concern, validated on construction, and :class:`RunConfig`, which holds them
all for one run of ``mlxkv generate`` or ``mlxkv serve`` (the CLI builds it the same way for both). No MLX import
here: callers measure free memory themselves and pass it in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxkv import env, rules
from mlxkv.kv.blocks.hashing import HASH_ALGOS, xxhash_available
from mlxkv.kv.blocks.retention import MAX_PRIORITY, MIN_PRIORITY
from mlxkv.rules import check_field

DEFAULT_SECONDARY_DISK_BYTES = 16 << 30  # disk tier cap when a folder is given without a size
DEFAULT_IDLE_RELEASE_S = 300.0  # a growing paged pool gives its chunks back after this long with nothing open
MAX_IDLE_RELEASE_S = 7 * 24 * 3600.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class KvOverflowConfig:
    """What a sequence does when its context outgrows a per-sequence KV budget.

    policy: "preempt" (no per-sequence cap: the whole context is cached; a full paged pool preempts), "window"
        (the first ``sinks`` tokens and the last ``budget - sinks``: StreamingLLM), "h2o" (sinks, the last
        ``recent`` tokens and the rest of the budget by accumulated attention mass; evicted rows are dropped) or
        "offload" (as h2o, but evicted rows move to host memory and come back when their estimated attention
        share passes ``restore_threshold``).
    budget: tokens kept per sequence and layer (window, h2o, offload); None for preempt.
    sinks: the first tokens always kept.
    recent: h2o / offload: the last tokens always kept (None: half the budget, H2O's split).
    restore_threshold: offload: estimated attention share (0..1) at which a host row comes back.
    """

    policy: str = "preempt"
    budget: int | None = None
    sinks: int = 4
    recent: int | None = None
    restore_threshold: float = 0.01

    def __post_init__(self) -> None:
        check_field("kv_overflow", rules.KV_OVERFLOW, self.policy)
        check_field("kv_overflow_budget", rules.KV_OVERFLOW_BUDGET, self.budget, optional=True)
        check_field("kv_overflow_sinks", rules.KV_OVERFLOW_SINKS, self.sinks)
        check_field("kv_overflow_recent", rules.KV_OVERFLOW_RECENT, self.recent, optional=True)
        if self.policy == "preempt":
            if self.budget is not None or self.recent is not None:
                raise ValueError("kv_overflow_budget and kv_overflow_recent apply to kv_overflow window, h2o or "
                                 "offload (preempt caches the whole context)")
            return
        if not _is_int(self.budget):
            raise ValueError(f"kv_overflow={self.policy} needs kv_overflow_budget (tokens kept per sequence)")
        if self.policy == "window":
            if self.recent is not None:
                raise ValueError("kv_overflow_recent applies to h2o and offload (window keeps the last "
                                 "kv_overflow_budget - kv_overflow_sinks tokens)")
            if self.budget <= self.sinks:
                raise ValueError(f"kv_overflow_budget={self.budget} must be larger than kv_overflow_sinks={self.sinks}")
            return
        if self.budget <= self.sinks + self.recent_tokens:
            raise ValueError(f"kv_overflow_budget={self.budget} must be larger than kv_overflow_sinks + "
                             f"kv_overflow_recent ({self.sinks} + {self.recent_tokens}): room is needed for heavy hitters")
        t = self.restore_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1:
            raise ValueError(f"kv_overflow_restore_threshold={t!r}: expected a number in (0, 1)")

    @property
    def enabled(self) -> bool:
        """True for a per-sequence cap (window, h2o, offload)."""
        return self.policy != "preempt"

    @property
    def recent_tokens(self) -> int:
        """The recent tokens h2o / offload protect (``recent``, else half the budget)."""
        return self.recent if self.recent is not None else max(1, (self.budget or 0) // 2)

    def check_pages(self, block_size: int) -> None:
        """Raise ValueError when this policy cannot run on pages of ``block_size`` tokens (the paged backend
        evicts whole pages: :mod:`mlxkv.kv.paged.page_overflow`): a budget that leaves fewer than two evictable
        pages beside the protected ones (the sinks' pages; h2o and offload also the last ``recent`` tokens')."""
        if not self.enabled:
            return
        front = -(-self.sinks // block_size) * block_size
        recent = self.recent_tokens if self.policy != "window" else 0
        need = front + recent + 2 * block_size
        if self.budget < need:
            kept = f"the sinks' pages ({front} tokens)" + (f" and the last {recent} tokens" if recent else "")
            raise ValueError(f"kv_overflow_budget={self.budget} is too small for pages of {block_size} tokens: "
                             f"kv_overflow={self.policy} keeps {kept} and needs room for two more pages: at "
                             f"least {need}")


@dataclass(slots=True)
class KvCacheConfig:
    """How KV memory is laid out, sized and reused.

    backend: "dense" (contiguous per-sequence buffers) or "paged" (blocks from a shared pool).
    block_size: tokens per block, a power of two in 1..256 (paged).
    kv_cache_budget: bytes for KV blocks, or "auto" = free_memory_fraction × free memory.
    free_memory_fraction: share of free memory "auto" takes, in (0, 1].
    max_tokens: cap on cached tokens; with the memory budget the smaller wins.
    enable_block_reuse / enable_partial_reuse / copy_on_partial_reuse: prefix caching switches.
    hash_algo: block hash, one of "sha256", "builtin", "xxhash".
    secondary_offload_min_priority: evicted blocks go to the secondary tier only at or above this priority.
    kv_bits / kv_group_size: quantized KV storage (None, 4 or 8 bits; groups of 32, 64 or 128).
    max_kv_size: dense backend only: keep at most this many tokens (rotating); None for unbounded.
    layout: dense backend only: "mlxkv" (our layouts) or "mlx-lm" (mlx-lm's own caches, for comparison).
    secondary_memory_bytes: paged only: bytes of host memory for the secondary KV tier (0 = none).
    secondary_disk_dir: paged only: folder for the on-disk secondary tier (None = none); survives restarts.
    secondary_disk_bytes: paged only: byte cap of the on-disk tier (needs secondary_disk_dir; 0 with a folder
        means DEFAULT_SECONDARY_DISK_BYTES, 16 GiB).
    secondary_tenant_share: share of the disk tier one tenant (cache salt) keeps while others need room, in
        (0, 1] (1: no quota); a tenant alone may still fill it.
    primary_tenant_share: paged only: share of the KV block pool one tenant may hold cached before its free
        cached blocks are evicted ahead of the other tenants', in (0, 1] (1: no quota); a tenant alone may
        still fill the pool.
    secondary_write_interval_s: paged with a disk tier: cached blocks are written to disk behind the engine at
        most this many seconds after they are cached (what a crash can lose); 0 = only evicted blocks go to disk.
    secondary_shard: under ``--distributed``, this rank's shard of each block (e.g. ``"rank-1-of-2-tensor"``,
        see mlxkv/distributed/tier.py); part of the disk tier's fingerprint ("" when the process holds whole blocks).
    state_snapshot_interval: paged models with recurrent layers: also snapshot the recurrent state every this
        many blocks of a prompt (0 = only at the end of each prompt and of each sequence); see
        mlxkv/kv/paged/state_snapshots.py.
    overflow: the per-sequence budget policy (:class:`KvOverflowConfig`; default preempt, no cap); the paged
        backend runs window, h2o and offload in whole pages (:mod:`mlxkv.kv.paged.page_overflow`).
    preallocate: paged only: allocate the whole budget's page arrays at the first write (steady latency, all
        the memory at once) instead of growing them in chunks as blocks are needed (the default).
    idle_release_s: paged, growing pool: after this many seconds with no sequence open, the pool gives back
        every chunk above its first (their cached blocks evicted, to the secondary tier if any); 0 = never.
    """

    backend: str = "dense"
    block_size: int = 16
    kv_cache_budget: int | str = "auto"
    free_memory_fraction: float = 0.9
    max_tokens: int | None = None
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    hash_algo: str = "sha256"
    secondary_offload_min_priority: int = 35
    kv_bits: int | None = None
    kv_group_size: int = 64
    max_kv_size: int | None = None
    secondary_memory_bytes: int = 0
    secondary_disk_dir: str | None = None
    secondary_disk_bytes: int = 0
    secondary_tenant_share: float = 0.5
    primary_tenant_share: float = 1.0
    secondary_write_interval_s: float = 2.0
    secondary_shard: str = ""
    layout: str = "mlxkv"
    state_snapshot_interval: int = 0
    overflow: KvOverflowConfig = field(default_factory=KvOverflowConfig)
    preallocate: bool = False
    idle_release_s: float = DEFAULT_IDLE_RELEASE_S

    def __post_init__(self) -> None:
        check_field("layout", rules.KV_LAYOUT, self.layout)
        check_field("backend", rules.KV_BACKEND, self.backend)
        check_field("block_size", rules.KV_BLOCK_SIZE, self.block_size)
        budget = self.kv_cache_budget
        if not (budget == "auto" or (_is_int(budget) and budget > 0)):
            raise ValueError(f"kv_cache_budget={budget!r}: expected 'auto' or a number of bytes > 0")
        f = self.free_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"free_memory_fraction={f!r}: expected a number in (0, 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r}: expected None or an integer >= 1")
        for name in ("enable_block_reuse", "enable_partial_reuse", "copy_on_partial_reuse", "preallocate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")  # noqa: TRY004
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo={self.hash_algo!r}: expected one of {', '.join(HASH_ALGOS)}")
        if self.hash_algo == "xxhash" and not xxhash_available():
            raise ValueError("hash_algo='xxhash' needs the xxhash package (pip install xxhash); or use sha256/builtin")
        p = self.secondary_offload_min_priority
        if not _is_int(p) or not MIN_PRIORITY <= p <= MAX_PRIORITY:
            raise ValueError(
                f"secondary_offload_min_priority={p!r}: expected an integer in {MIN_PRIORITY}..{MAX_PRIORITY}"
            )
        check_field("kv_bits", rules.KV_BITS_RULE, self.kv_bits, optional=True)
        check_field("kv_group_size", rules.KV_GROUP_SIZE, self.kv_group_size)
        check_field("max_kv_size", rules.MAX_KV_SIZE, self.max_kv_size, optional=True)
        for name in ("secondary_memory_bytes", "secondary_disk_bytes"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name}={v!r}: expected an integer number of bytes >= 0 (0 = off)")
        d = self.secondary_disk_dir
        if d is not None and (not isinstance(d, str) or not d):
            raise ValueError(f"secondary_disk_dir={d!r}: expected None or a non-empty folder path")
        w = self.secondary_write_interval_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 3600:
            raise ValueError(f"secondary_write_interval_s={w!r}: expected seconds in 0..3600 (0 = off)")
        if self.secondary_disk_bytes and d is None:
            raise ValueError("secondary_disk_bytes needs secondary_disk_dir (the folder for the disk tier)")
        for name in ("secondary_tenant_share", "primary_tenant_share"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
                raise ValueError(f"{name}={t!r}: expected a number in (0, 1] (1 = no per-tenant quota)")
        check_field("state_snapshot_interval", rules.STATE_SNAPSHOT_INTERVAL, self.state_snapshot_interval)
        r = self.idle_release_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= MAX_IDLE_RELEASE_S:
            raise ValueError(f"idle_release_s={r!r}: expected seconds in 0..{MAX_IDLE_RELEASE_S} (0 = never)")
        if self.overflow.enabled:
            policy = f"kv_overflow={self.overflow.policy}"
            if self.backend == "paged":
                self.overflow.check_pages(self.block_size)
            if self.backend == "paged" and self.kv_bits is not None:
                raise ValueError(f"{policy} on the paged backend keeps full-precision pages: it does not combine "
                                 "with kv_bits (use --kv-backend dense for a quantized window)")
            if self.max_kv_size is not None:
                raise ValueError(f"{policy} and max_kv_size both cap the context: use kv_overflow_budget only")
            if self.layout != "mlxkv":
                raise ValueError(f"{policy} needs layout='mlxkv' (mlx-lm's caches have no overflow policies)")
            if self.kv_bits is not None and self.overflow.policy != "window":
                raise ValueError(f"{policy} keeps full-precision K/V: it does not combine with kv_bits")

    @property
    def secondary_enabled(self) -> bool:
        """True when any secondary-tier field is set (the paged backend then attaches the tier)."""
        return bool(self.secondary_memory_bytes or self.secondary_disk_dir or self.secondary_disk_bytes)

    @property
    def secondary_disk_cap(self) -> int:
        """Byte cap of the disk tier: ``secondary_disk_bytes``, or the default with a folder and no size;
        0 without a folder."""
        if self.secondary_disk_dir is None:
            return 0
        return self.secondary_disk_bytes or DEFAULT_SECONDARY_DISK_BYTES


def num_blocks_for_budget(config: KvCacheConfig, bytes_per_block: int, free_bytes: int | None = None) -> int:
    """Pool size in blocks (the null block included) for a config.

    Memory: ``kv_cache_budget`` bytes, or with "auto" ``free_memory_fraction × free_bytes``. When
    ``max_tokens`` is also set, the smaller of the two wins. Raises ValueError when "auto" lacks
    ``free_bytes`` or the result cannot hold even one block besides the null block.
    """
    if not _is_int(bytes_per_block) or bytes_per_block < 1:
        raise ValueError(f"bytes_per_block={bytes_per_block!r}: expected an integer >= 1")
    if config.kv_cache_budget == "auto":
        if free_bytes is None or free_bytes < 0:
            raise ValueError("kv_cache_budget='auto' needs free_bytes (the caller measures free memory)")
        budget = int(free_bytes * config.free_memory_fraction)
    else:
        budget = config.kv_cache_budget
    blocks = budget // bytes_per_block
    if config.max_tokens is not None:
        blocks = min(blocks, -(-config.max_tokens // config.block_size) + 1)
    if blocks < 2:
        raise ValueError(
            f"KV budget of {budget} bytes gives {blocks} blocks of {bytes_per_block} bytes: need at least 2 "
            "(raise kv_cache_budget / free_memory_fraction / max_tokens, or lower block_size)"
        )
    return blocks


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding of ``mlxkv generate``.

    draft_model: a second model (repo id, folder or GGUF) drafting tokens; prompt_lookup: draft by n-gram lookup
    over the prompt and output instead (no second model); num_draft_tokens: tokens drafted per round;
    ngram_size: n-gram length for prompt lookup.
    """

    draft_model: str | None = None
    prompt_lookup: bool = False
    num_draft_tokens: int = 3
    ngram_size: int = 3

    def __post_init__(self) -> None:
        if self.draft_model and self.prompt_lookup:
            raise ValueError("choose one drafting mode: --draft-model or --prompt-lookup, not both")
        if self.num_draft_tokens < 1 or self.ngram_size < 1:
            raise ValueError("--num-draft-tokens and --ngram-size must be >= 1")

    @property
    def enabled(self) -> bool:
        """Whether a drafting mode is on."""
        return bool(self.draft_model) or self.prompt_lookup


@dataclass(slots=True)
class EngineConfig:
    """Batch engine settings of ``mlxkv serve``.

    max_sequences: most sequences decoding or prefilling at once (a request with ``n`` choices takes ``n``).
    max_queue_depth: most requests waiting for admission; one more is refused (HTTP 429).
    prefill_chunk_size: most prompt tokens prefilled per engine step.
    batched_decode: ``None`` probes the model at start (batch views vs one-by-one, same tokens); ``False``
        always decodes sequences one by one; ``True`` requires batch views.
    batched_prefill: prefill the short chunks of sequences admitted together in one forward where batched
        decode works and a start-up probe matches one-by-one prefill. Off by default: on the CPU backend it
        measured no better time to first token, since each request's first token then waits for the whole batch.
    """

    max_sequences: int = 8
    max_queue_depth: int = 64
    prefill_chunk_size: int = 512
    batched_decode: bool | None = None
    batched_prefill: bool = False

    def __post_init__(self) -> None:
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.max_queue_depth < 1:  # every request passes through the queue, if only for one step
            raise ValueError(f"max_queue_depth must be >= 1, got {self.max_queue_depth}")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")


#: ``apply_chat_template`` arguments the server sets itself: a request's ``chat_template_kwargs`` may not.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: object) -> dict:
    """``kwargs`` if it is a dict of extra chat-template variables (string keys, none reserved); raises ValueError."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k for k in kwargs):
        raise ValueError(f"chat_template_kwargs must be an object with non-empty string keys, got {kwargs!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them)")
    return kwargs


@dataclass(slots=True)
class SamplingDefaults:
    """The sampling options of ``mlxkv generate`` and ``mlxkv chat``, and the server-wide defaults of ``mlxkv serve``
    (a request's own value, not ``null``, wins there).

    temp: temperature (OpenAI's default 1.0; 0 is greedy); top_p, top_k, min_p: the filters (off by default);
    repetition_penalty: None for none (mlx-lm's multiplicative penalty, > 0); max_tokens: None for the route's own
    default (chat: the rest of the context; completions: 16); chat_template_kwargs: extra variables for every chat
    template rendering (a request's own keys win).
    """

    temp: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_field("temp", rules.TEMP, self.temp)
        check_field("top_p", rules.TOP_P, self.top_p)
        check_field("top_k", rules.TOP_K, self.top_k)
        check_field("min_p", rules.MIN_P, self.min_p)
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}: expected None or a number > 0")
        check_field("max_tokens", rules.MAX_TOKENS, self.max_tokens, optional=True)
        check_template_kwargs(self.chat_template_kwargs)


@dataclass(slots=True)
class RunConfig:
    """Everything one run of ``mlxkv generate`` or ``mlxkv serve`` is configured with.

    model: repo id, folder or GGUF file (None: the embedded demo model); dequantize: run quantized weights
    unquantized; kv: the KV cache; speculative: drafting (generate); engine: the batch engine (serve); sampling:
    the server's sampling defaults (serve); flags: the ``MLXKV_*`` environment flags, parsed once
    (:func:`mlxkv.env.flags`); chat_template: a Jinja chat template file used instead of the model's;
    tool_parser: the mlx-lm tool parser reading the model's tool calls (None: the one mlx-lm infers from the
    template; names are checked when the model loads); adapter_path: a LoRA adapter folder in mlx-lm's format applied
    over the model's weights (checked when the model loads).
    """

    model: str | None = None
    dequantize: bool = False
    kv: KvCacheConfig = field(default_factory=KvCacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    flags: env.Flags = field(default_factory=env.flags)
    chat_template: str | None = None
    tool_parser: str | None = None
    adapter_path: str | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise ValueError(f"chat_template={self.chat_template!r}: no such file")
        if self.tool_parser is not None and (not isinstance(self.tool_parser, str) or not self.tool_parser):
            raise ValueError(f"tool_parser={self.tool_parser!r}: expected None or a parser name")
