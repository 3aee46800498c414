"""CachePool: the store of one model's sequences; :class:`Sequence` (sequence.py) is the handle of one.

The engine talks to the KV cache through these two only. The pool opens a sequence (a paged one takes its prefix
hit), tells whether more tokens fit, picks whom to preempt, preempts and resumes, forks (parallel samples share a
paged prompt's blocks) and releases; the handle carries one id for the sequence's whole life, its layer caches for
the model, and the per-step protocol: ``feed`` the tokens a step appends before it, ``commit`` after it.

Where the K/V lives is the pool's :class:`~mlxkv.kv.storage.Storage`: :class:`~mlxkv.kv.storage.DenseStorage`
(per-sequence buffers: no blocks, so everything fits and nothing is shared) or
:class:`~mlxkv.kv.storage_paged.PagedKVStorage` (pages of one block pool, prefix caching); the pool keeps the
sequences and delegates the rest. Its figures are collected in :mod:`mlxkv.kv.storage_stats`; the secondary tier's
I/O between steps is :attr:`CachePool.tier`.

Not thread-safe, by design: the engine that owns the pool is its only caller (the server's engine thread,
or the direct engine's loop). Callers on other threads talk to the engine, never to the pool.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterator

from mlxkv.kv.blocks.cache_request import CacheRequest
from mlxkv.kv.sequence import Sequence, SequenceId
from mlxkv.kv.storage import DenseStorage, Storage, TierIO
from mlxkv.rules import KV_BACKENDS as BACKENDS
from mlxkv.rules import KV_BITS
from mlxkv.rules import KV_LAYOUTS as LAYOUTS

if TYPE_CHECKING:
    from mlxkv.kv.blocks.events import EventBatch

__all__ = ["BACKENDS", "LAYOUTS", "CachePool", "CacheRequest", "PoolFullError", "Sequence", "SequenceId"]

CacheFactory = Callable[[Any], list]


class PoolFullError(RuntimeError):
    """Opening a sequence would exceed ``max_sequences``."""


class CachePool:
    """The store of every sequence of one model: dense buffers per sequence, or pages of one block pool.

    Args:
        model: the mlx-lm model whose layers the caches serve.
        max_sequences: most sequences open at once (``open`` raises :class:`PoolFullError` past it).
        layout: ``"mlxkv"`` (our layouts, default) or ``"mlx-lm"`` (mlx-lm's caches, for comparison).
        max_kv_size: cap on cached tokens per layer (full-attention layers become rotating caches).
        kv_bits: quantize K/V to 4 or 8 bits (``None``: full precision).
        kv_group_size: quantization group size.
        cache_factory: overrides ``layout``: ``factory(model) -> list`` of layer caches.
        backend: ``"dense"`` (per-sequence buffers, default) or ``"paged"`` (blocks of one shared pool, with
            prefix caching: :class:`mlxkv.kv.paged.PagedBackend`; ``open`` then takes the prompt tokens).
        kv_config: paged backend: block size, budget and reuse settings (default ``KvCacheConfig()``).
        num_blocks: paged backend: pool size in blocks, overriding the budget.
        model_path: paged backend: the model's folder, for the secondary KV tier's model fingerprint
            (``kv_config.secondary_*``); optional.
        overflow: a :class:`mlxkv.config.KvOverflowConfig`: the per-sequence budget policy of every sequence
            opened without its own (``open(overflow=...)``); dense ``mlxkv`` layout only.
        grow_blocks: paged backend: the least its page arrays grow by, in blocks (default: 32 MiB worth, at most a
            sixteenth of the pool).
    """

    def __init__(self, model: Any, *, max_sequences: int = 16, layout: str = "mlxkv",
                 max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64,
                 cache_factory: CacheFactory | None = None, backend: str = "dense", kv_config: Any = None,
                 num_blocks: int | None = None, model_path: str | None = None, overflow: Any = None,
                 grow_blocks: int | None = None):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if kv_bits is not None and kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} or None, got {kv_bits}")
        if max_kv_size is not None and max_kv_size < 1:
            raise ValueError(f"max_kv_size must be >= 1, got {max_kv_size}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.model = model
        self.max_sequences = max_sequences
        self.layout = layout
        self.backend = backend
        self.max_kv_size, self.kv_bits = max_kv_size, kv_bits
        self.storage: Storage = _storage(model, backend, layout=layout, max_kv_size=max_kv_size, kv_bits=kv_bits,
                                         kv_group_size=kv_group_size, cache_factory=cache_factory,
                                         kv_config=kv_config, num_blocks=num_blocks, model_path=model_path,
                                         grow_blocks=grow_blocks)
        self.paged = self.storage.paged  # the PagedBackend (None: dense)
        self.tier: TierIO = self.storage.tier  # the secondary tier's I/O (NO_TIER: none)
        self.overflow = None  # the default policy (None: preempt, the plain caches)
        if overflow is not None and overflow.enabled:
            self.check_overflow(overflow)
            self.overflow = overflow
        self._ids = itertools.count(1)
        self._sequences: dict[SequenceId, Sequence] = {}

    @property
    def is_paged(self) -> bool:
        """Whether sequences live in pages of one block pool (prefix caching, preemption, shared forks)."""
        return self.storage.is_paged

    def check_overflow(self, overflow: Any) -> None:
        """Raise ValueError, naming the conflict, when this pool cannot run ``overflow`` (a
        :class:`mlxkv.config.KvOverflowConfig` with a per-sequence cap) for a sequence."""
        self.storage.check_overflow(overflow)

    # ---- opening and ending -------------------------------------------------------------------------------
    def open(self, prompt_length: int = 0, *, prompt: list[int] | None = None,
             cache_request: CacheRequest | None = None) -> Sequence:
        """Start a sequence with fresh, empty layer caches.

        Paged backend: ``prompt`` (token ids) is required; the sequence is registered with the block manager
        and takes its prefix hit (``seq.num_cached`` tokens need no compute). ``cache_request``: its salt,
        per-range salts, snapshot marks, retention, preemption rank and overflow policy (:class:`CacheRequest`;
        an overflow of ``None`` takes the pool's default), kept whole for the sequence's life.

        Raises:
            PoolFullError: ``max_sequences`` sequences are already open.
            ValueError: paged backend without ``prompt``; an ``overflow`` policy this pool cannot run.
        """
        cache_request = cache_request or CacheRequest()
        overflow = cache_request.overflow
        if overflow is None:
            overflow = self.overflow
        elif overflow.enabled:
            self.check_overflow(overflow)
        else:
            overflow = None
        if len(self) >= self.max_sequences:
            raise PoolFullError(
                f"the cache pool is full: {self.max_sequences} sequences open (max_sequences={self.max_sequences})"
            )
        seq = Sequence(id=SequenceId(next(self._ids)), caches=[], prompt_length=prompt_length,
                       cache_request=dataclasses.replace(cache_request, overflow=overflow))
        self.storage.attach(seq, prompt)
        self._sequences[seq.id] = seq
        return seq

    def get(self, seq_id: SequenceId) -> Sequence:
        """The open sequence ``seq_id`` (KeyError if it is not open)."""
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise KeyError(f"{seq_id} is not open in this pool") from None

    def release(self, seq_id: SequenceId) -> None:
        """Drop a sequence (open or preempted) and its caches (KeyError if it is not in the pool)."""
        seq = self.get(seq_id)
        del self._sequences[seq_id]
        self.storage.detach(seq)

    def preempt(self, seq_id: SequenceId) -> None:
        """Free a sequence's caches to make room; its verified blocks stay cached, so :meth:`resume` finds them
        as a prefix hit. The handle stays (same id) and no longer counts against ``max_sequences``."""
        seq = self.get(seq_id)
        self.storage.detach(seq)
        seq.preempted = True

    def resume(self, seq_id: SequenceId, tokens: list[int]) -> Sequence:
        """Give a preempted sequence caches again, over ``tokens`` (what it holds so: prompt and generated
        tokens); paged: the prefix still cached is a hit (``seq.num_cached``), the rest is to be recomputed.

        Raises:
            PoolFullError: ``max_sequences`` sequences are open; ValueError: it is not preempted.
        """
        seq = self.get(seq_id)
        if not seq.preempted:
            raise ValueError(f"{seq_id} is not preempted")
        if len(self) >= self.max_sequences:
            raise PoolFullError(f"the cache pool is full: {self.max_sequences} sequences open")
        self.storage.attach(seq, tokens)
        seq.preempted = False
        return seq

    def fork(self, seq_id: SequenceId, n: int) -> list[Sequence]:
        """``n`` new sequences continuing from ``seq_id``'s current state (best-of-n, parallel sampling), each
        with the parent's cache request.

        Paged backend: the children share every block of the parent (copy-on-write on a shared partial tail),
        so n samples of one prompt hold the prompt's K/V once; fork after the model step that wrote the parent's
        slots. Dense backend: the caches are copied.

        Raises:
            PoolFullError: the children would exceed ``max_sequences``; KeyError: ``seq_id`` is not open.
        """
        parent = self.get(seq_id)
        if n < 1:
            raise ValueError(f"fork n must be >= 1, got {n}")
        if len(self) + n > self.max_sequences:
            raise PoolFullError(f"forking {n} would exceed max_sequences={self.max_sequences}")
        children = [Sequence(id=SequenceId(next(self._ids)), caches=[], prompt_length=parent.prompt_length,
                             cache_request=parent.cache_request) for _ in range(n)]
        self.storage.fork(parent, children)
        for child in children:
            self._sequences[child.id] = child
        return children

    # ---- room ---------------------------------------------------------------------------------------------
    def can_extend(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens of ``seq`` fit now without preempting anyone (dense: always)."""
        return self.storage.can_extend(seq, num_tokens)

    def victim_for(self, seq: Sequence) -> Sequence | None:
        """The open sequence to preempt so ``seq`` can grow: one ranking strictly below it (lower priority, then
        newer); None when there is none (or the pool is dense)."""
        return self.storage.victim_for(seq)

    def admission_cost(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds at most (dense: 0), to weigh against
        :meth:`free_capacity` when admitting."""
        return self.storage.admission_cost(num_tokens)

    def free_capacity(self) -> int:
        """Free blocks (dense: 0; admission then never waits for blocks)."""
        return self.storage.free_capacity()

    def has_decode_headroom(self, num_sequences: int) -> bool:
        """Whether ``num_sequences`` sequences can each take one more token without preempting: at most one new
        block per group and one copy-on-write block each (dense: always)."""
        return self.storage.has_decode_headroom(num_sequences)

    def max_sequence_tokens(self) -> int | None:
        """The longest sequence the whole block pool holds alone (dense: None, no limit here)."""
        return self.storage.max_sequence_tokens()

    # ---- what the pool holds --------------------------------------------------------------------------------
    @property
    def state_snapshots(self) -> bool:
        """Whether recurrent-state snapshots are taken (paged, a model with recurrent layers, prefix caching on):
        then positions marked at ``open(snapshot_at=...)`` are worth computing."""
        return self.storage.state_snapshots

    @property
    def prefix_caching(self) -> bool:
        """Whether verified blocks are kept for later prefix hits (paged; a model with recurrent layers through
        state snapshots, unless its layers expose no state)."""
        return self.storage.prefix_caching

    def evict_cached(self, salt: str | None = None) -> int:
        """Drop every cached block no sequence holds (to the secondary tier when one takes it); returns how many
        (dense: 0). ``salt``: only the blocks of chains begun under that cache salt; None: every block, and when
        no sequence holds any block the whole prefix cache is then empty and an ``AllBlocksCleared`` event says so
        (else each evicted block's ``BlockRemoved`` does)."""
        return self.storage.evict_cached(salt)

    def release_due_in(self) -> float | None:
        """Seconds until :meth:`release_unused` is due (a growing paged pool idle for ``idle_release_s``); None
        when nothing is to be given back (dense, preallocated, sequences open, nothing above the first chunk)."""
        return self.storage.release_due_in()

    def release_unused(self) -> int:
        """Give back the paged pool's chunks above its first that no sequence holds (their cached blocks evicted,
        to the secondary tier when one takes them); returns how many blocks (dense: 0)."""
        return self.storage.release_unused()

    def kv_events(self, since: int = 0) -> EventBatch | None:
        """KV events numbered above ``since`` (safe from any thread; dense: None): an
        :class:`~mlxkv.kv.blocks.events.EventBatch` of ``(number, event)`` pairs, the cursor (newest number) and
        how many were missed (their JSON form: :meth:`mlxkv.engine.batch.BatchEngine.kv_events`)."""
        return self.storage.kv_events(since)

    def block_stats(self) -> dict:
        """The block pool's figures for stats and metrics (paged: :func:`mlxkv.kv.storage_stats.paged_stats`;
        dense: empty)."""
        return self.storage.stats()

    def block_map(self) -> dict | None:
        """Each block's state and owner and the prefix tree (:func:`mlxkv.kv.blocks.block_map.block_map`;
        paged; dense: None)."""
        return self.storage.block_map()

    # ---- the secondary tier's I/O (paged with a tier; otherwise no-ops): :attr:`tier` -----------------------
    def tier_due_in(self) -> float | None:
        """Seconds until the tier's next write-behind sweep (None: nothing to write): the engine's idle wait."""
        return self.tier.due_in()

    def tier_ready(self, prompt: list[int], cache_request: CacheRequest | None = None) -> bool:
        """Whether opening a sequence for ``prompt`` finds the blocks its prefix hit takes from the disk tier
        already in host memory. When not, they are being read on the tier's read-ahead thread: keep the request
        queued and ask again at a later step (dense pools and pools without a disk tier are always ready). The
        prefix lookup made here (hashes, primary hit, what is on the host and on disk) is the one the open uses."""
        return not prompt or self.tier.ready(prompt, cache_request or CacheRequest())

    def wait_tier_reads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a disk-tier read ahead to finish (an engine with nothing else to run)."""
        self.tier.wait_reads(timeout)

    def persist_tier(self) -> int:
        """Run the write-behind sweep when it is due (engine thread, between steps); blocks queued."""
        return self.tier.persist()

    def flush_tier(self, timeout: float) -> dict | None:
        """Write every cached block worth keeping to the disk tier within ``timeout`` seconds (shutdown)."""
        return self.tier.flush(timeout)

    def check_invariants(self) -> None:
        """Assert pool consistency (tests): paged: manager invariants, open sequences == manager sequences."""
        self.storage.check_invariants(list(self._sequences.values()))

    def memory_usage_bytes(self) -> int:
        """Bytes allocated by the K/V buffers (and recurrent state) of every open sequence."""
        return sum(seq.nbytes() for seq in self._sequences.values())

    def __len__(self) -> int:
        """Open sequences (preempted ones do not count)."""
        return sum(1 for s in self._sequences.values() if not s.preempted)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._sequences

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._sequences.values()))


def _storage(model: Any, backend: str, *, layout: str, max_kv_size: int | None, kv_bits: int | None,
             kv_group_size: int, cache_factory: CacheFactory | None, kv_config: Any, num_blocks: int | None,
             model_path: str | None, grow_blocks: int | None) -> Storage:
    """The storage a pool's arguments name (validated by :class:`CachePool`)."""
    if backend == "paged":
        from mlxkv.config import KvCacheConfig
        from mlxkv.kv.paged import PagedBackend
        from mlxkv.kv.storage_paged import PagedKVStorage

        if layout != "mlxkv" or cache_factory is not None:
            raise ValueError("backend='paged' builds its own caches: use layout='mlxkv' and no cache_factory")
        return PagedKVStorage(PagedBackend(model, kv_config or KvCacheConfig(backend="paged"), num_blocks=num_blocks,
                                           model_path=model_path, grow_blocks=grow_blocks))
    overflow_factory = None  # our layouts: caches under a per-sequence overflow policy
    if cache_factory is None:
        from mlxkv.kv.layouts import check_kv_group_size, make_caches, mlx_lm_caches

        if kv_bits is not None:
            check_kv_group_size(model, kv_group_size)
        build = make_caches if layout == "mlxkv" else mlx_lm_caches
        cache_factory = functools.partial(build, max_kv_size=max_kv_size, kv_bits=kv_bits, kv_group_size=kv_group_size)
        if layout == "mlxkv":
            overflow_factory = functools.partial(make_caches, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return DenseStorage(model, cache_factory, overflow_factory, max_kv_size, kv_bits)
