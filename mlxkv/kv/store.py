"""CachePool: the store of one model's sequences; :class:`Sequence` (sequence.py) is the handle of one.

The engine talks to the KV cache through these two only. The pool opens a sequence (a paged one takes its prefix
hit), tells whether more tokens fit, picks whom to preempt, preempts and resumes, forks (parallel samples share a
paged prompt's blocks) and releases; the handle carries one id for the sequence's whole life, its layer caches for
the model, and the per-step protocol: ``feed`` the tokens a step appends before it, ``commit`` after it. Dense
and paged storage answer the same calls (dense: no blocks, so everything fits and nothing is shared).

Not thread-safe, by design: the engine that owns the pool is its only caller (the server's engine thread,
or the direct engine's loop). Callers on other threads talk to the engine, never to the pool.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterator

from mlxkv.kv.blocks.block_map import block_map
from mlxkv.kv.blocks.cache_request import CacheRequest
from mlxkv.kv.sequence import Sequence, SequenceId
from mlxkv.rules import KV_BACKENDS as BACKENDS
from mlxkv.rules import KV_BITS
from mlxkv.rules import KV_LAYOUTS as LAYOUTS

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
        self.paged = None
        self.max_kv_size, self.kv_bits = max_kv_size, kv_bits
        self._overflow_factory: Callable[..., list] | None = None  # dense mlxkv layout: caches under a policy
        if backend == "paged":
            from mlxkv.config import KvCacheConfig
            from mlxkv.kv.paged import PagedBackend

            if layout != "mlxkv" or cache_factory is not None:
                raise ValueError("backend='paged' builds its own caches: use layout='mlxkv' and no cache_factory")
            self.paged = PagedBackend(model, kv_config or KvCacheConfig(backend="paged"), num_blocks=num_blocks,
                                      model_path=model_path, grow_blocks=grow_blocks)
        if cache_factory is None:
            from mlxkv.kv.layouts import check_kv_group_size, make_caches, mlx_lm_caches

            if kv_bits is not None:
                check_kv_group_size(model, kv_group_size)

            build = make_caches if layout == "mlxkv" else mlx_lm_caches
            cache_factory = functools.partial(build, max_kv_size=max_kv_size, kv_bits=kv_bits,
                                              kv_group_size=kv_group_size)
            if layout == "mlxkv":
                self._overflow_factory = functools.partial(make_caches, kv_bits=kv_bits, kv_group_size=kv_group_size)
        self._factory = cache_factory
        self.overflow = None  # the default policy (None: preempt, the plain caches)
        if overflow is not None and overflow.enabled:
            self.check_overflow(overflow)
            self.overflow = overflow
        self._ids = itertools.count(1)
        self._sequences: dict[SequenceId, Sequence] = {}
        self._by_manager_id: dict[int, Sequence] = {}  # paged: the manager's id of each open sequence

    @property
    def is_paged(self) -> bool:
        """Whether sequences live in pages of one block pool (prefix caching, preemption, shared forks)."""
        return self.paged is not None

    def check_overflow(self, overflow: Any) -> None:
        """Raise ValueError, naming the conflict, when this pool cannot run ``overflow`` (a
        :class:`mlxkv.config.KvOverflowConfig` with a per-sequence cap) for a sequence."""
        if self.paged is not None:
            self.paged.check_overflow(overflow)
            return
        policy = f"kv_overflow {overflow.policy}"
        if self._overflow_factory is None:
            raise ValueError(f"{policy} needs the mlxkv cache layout (mlx-lm's caches have no overflow policies)")
        if self.max_kv_size is not None:
            raise ValueError(f"{policy} and --max-kv-size both cap the context: use the overflow budget only")
        if self.kv_bits is not None and overflow.policy != "window":
            raise ValueError(f"{policy} keeps full-precision K/V: it does not combine with --kv-bits")
        self._overflow_factory(self.model, overflow=overflow)  # raises where the model's attention cannot (MLA)

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
        self._attach(seq, prompt)
        self._sequences[seq.id] = seq
        return seq

    def _attach(self, seq: Sequence, tokens: list[int] | None) -> None:
        """Give ``seq`` caches: paged, registered with the manager over ``tokens`` (prefix hit taken)."""
        if self.paged is None:
            seq.caches = (self._factory(self.model) if seq.overflow is None
                          else self._overflow_factory(self.model, overflow=seq.overflow))
            return
        if not tokens:
            raise ValueError("backend='paged': open() needs the prompt token ids (prompt=[...])")
        seq.caches, seq.paged = self.paged.open(tokens, seq.cache_request)
        seq.prompt_length = seq.prompt_length or len(tokens)
        self._by_manager_id[seq.paged.seq_id] = seq

    def get(self, seq_id: SequenceId) -> Sequence:
        """The open sequence ``seq_id`` (KeyError if it is not open)."""
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise KeyError(f"{seq_id} is not open in this pool") from None

    def _detach(self, seq: Sequence) -> None:
        seq.caches = []  # drop our references so MLX can free the buffers
        if seq.paged is not None:
            self._by_manager_id.pop(seq.paged.seq_id, None)
            self.paged.release(seq.paged)  # blocks back to the pool, tail first; verified ones stay cached
            seq.paged = None

    def release(self, seq_id: SequenceId) -> None:
        """Drop a sequence (open or preempted) and its caches (KeyError if it is not in the pool)."""
        seq = self.get(seq_id)
        del self._sequences[seq_id]
        self._detach(seq)

    def preempt(self, seq_id: SequenceId) -> None:
        """Free a sequence's caches to make room; its verified blocks stay cached, so :meth:`resume` finds them
        as a prefix hit. The handle stays (same id) and no longer counts against ``max_sequences``."""
        seq = self.get(seq_id)
        self._detach(seq)
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
        self._attach(seq, tokens)
        seq.preempted = False
        return seq

    def fork(self, seq_id: SequenceId, n: int) -> list[Sequence]:
        """``n`` new sequences continuing from ``seq_id``'s current state (best-of-n, parallel sampling).

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
        if parent.paged is not None:
            pairs = self.paged.fork(parent.paged, parent.caches, n)
        else:
            pairs = [(copy.deepcopy(parent.caches), None) for _ in range(n)]
        children = []
        for caches, paged in pairs:
            child = Sequence(id=SequenceId(next(self._ids)), caches=caches, prompt_length=parent.prompt_length,
                             paged=paged, cache_request=parent.cache_request)
            self._sequences[child.id] = child
            if paged is not None:
                self._by_manager_id[paged.seq_id] = child
            children.append(child)
        return children

    # ---- room ---------------------------------------------------------------------------------------------
    def can_extend(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens of ``seq`` fit now without preempting anyone (dense: always)."""
        return self.paged is None or self.paged.manager.can_allocate(seq.paged.seq_id, num_tokens)

    def victim_for(self, seq: Sequence) -> Sequence | None:
        """The open sequence to preempt so ``seq`` can grow: one ranking strictly below it (lower priority, then
        newer); None when there is none (or the pool is dense)."""
        if self.paged is None:
            return None
        victim = self.paged.manager.choose_victim(requester=seq.paged.seq_id)
        return None if victim is None else self._by_manager_id[victim]

    def admission_cost(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds at most (dense: 0), to weigh against
        :meth:`free_capacity` when admitting."""
        if self.paged is None:
            return 0
        from mlxkv.kv.admission import blocks_needed

        return blocks_needed(self.paged.manager.specs, self.paged.block_size, num_tokens)

    def free_capacity(self) -> int:
        """Free blocks (dense: 0; admission then never waits for blocks)."""
        return self.paged.manager.pool.num_free_blocks if self.paged is not None else 0

    def has_decode_headroom(self, num_sequences: int) -> bool:
        """Whether ``num_sequences`` sequences can each take one more token without preempting: at most one new
        block per group and one copy-on-write block each (dense: always)."""
        if self.paged is None:
            return True
        return self.free_capacity() >= num_sequences * 2 * len(self.paged.manager.specs)

    def max_sequence_tokens(self) -> int | None:
        """The longest sequence the whole block pool holds alone (dense: None, no limit here)."""
        if self.paged is None:
            return None
        from mlxkv.kv.admission import max_paged_tokens

        return max_paged_tokens(self.paged.manager)

    # ---- what the pool holds --------------------------------------------------------------------------------
    @property
    def state_snapshots(self) -> bool:
        """Whether recurrent-state snapshots are taken (paged, a model with recurrent layers, prefix caching on):
        then positions marked at ``open(snapshot_at=...)`` are worth computing."""
        return self.paged is not None and self.paged.manager.snapshots is not None

    @property
    def prefix_caching(self) -> bool:
        """Whether verified blocks are kept for later prefix hits (paged; a model with recurrent layers through
        state snapshots, unless its layers expose no state)."""
        return self.paged is not None and self.paged.manager.pool.enable_caching

    def evict_cached(self, salt: str | None = None) -> int:
        """Drop every cached block no sequence holds (to the secondary tier when one takes it); returns how many
        (dense: 0). ``salt``: only the blocks of chains begun under that cache salt; None: every block, and when
        no sequence holds any block the whole prefix cache is then empty and an ``AllBlocksCleared`` event says so
        (else each evicted block's ``BlockRemoved`` does)."""
        if self.paged is None:
            return 0
        pool = self.paged.manager.pool
        if salt is None:
            n = pool.evict_cached(pool.stats().evictable)
            pool.reset_prefix_cache()  # refused (no event) while blocks are in use
            return n
        return pool.evict_cached(pool.stats().evictable, where=lambda b: b.tenant == salt)  # tenant: chain's salt

    def release_due_in(self) -> float | None:
        """Seconds until :meth:`release_unused` is due (a growing paged pool idle for ``idle_release_s``); None
        when nothing is to be given back (dense, preallocated, sequences open, nothing above the first chunk)."""
        return None if self.paged is None else self.paged.release_due_in()

    def release_unused(self) -> int:
        """Give back the paged pool's chunks above its first that no sequence holds (their cached blocks evicted,
        to the secondary tier when one takes them); returns how many blocks (dense: 0)."""
        return 0 if self.paged is None else self.paged.release_unused()

    def kv_events(self, since: int = 0) -> dict | None:
        """KV events numbered above ``since`` in their JSON form (safe from any thread; dense: None):
        ``{"events": [{"seq": n, "type": ..., ...}], "cursor": newest number, "dropped": events missed}``."""
        if self.paged is None:
            return None
        from mlxkv.kv.blocks.events import event_to_json

        batch = self.paged.manager.events.read(since)
        return {"events": [{"seq": n, **event_to_json(e)} for n, e in batch.events], "cursor": batch.cursor,
                "dropped": batch.dropped}

    def block_stats(self) -> dict:
        """The block pool's figures for stats and metrics (paged; dense: empty)."""
        if self.paged is None:
            return {}
        manager = self.paged.manager
        m = manager.stats()
        p = m.pool
        stats = {
            "kv_blocks": {"paged": True, "total": p.num_blocks, "used": p.used, "free": p.free, "cached": p.cached,
                          "allocated": p.allocated, "preallocated": self.paged.config.preallocate,
                          "allocated_bytes": self.paged.storage.nbytes(),  # the page arrays as they are now
                          "budget_bytes": p.num_blocks * self.paged.bytes_per_block,
                          "evictable": p.evictable, "block_size": manager.block_size,
                          "capacity_tokens": self.max_sequence_tokens(),
                          "cached_by_priority": {str(k): v for k, v in p.cached_by_priority.items()},
                          "overflow_dropped": manager.tables.dropped_blocks,
                          "overflow_restored": manager.tables.restored_blocks,
                          "overflow_host_bytes": self.paged.overflow_host_bytes()},
            "evictions": p.evictions,
            "manager": {"prompt_tokens": m.prompt_tokens, "hit_tokens": m.hit_tokens, "running": m.running},
            "tier": self.paged.tier_stats(),
            "state_snapshots": self.paged.snapshot_stats(),
        }
        stats["kv_blocks"].update(self._kv_quantization())
        return stats

    def block_map(self) -> dict | None:
        """Each block's state and owner and the prefix tree (:func:`mlxkv.kv.blocks.block_map.block_map`;
        paged; dense: None)."""
        return None if self.paged is None else block_map(self.paged.manager.pool)

    def _kv_quantization(self) -> dict:
        """How the pages store K/V: ``kv_bits`` (None: unquantized) and ``kv_group_size`` (None then too), and
        ``bytes_per_block`` (every layer's share of one block, as the budget counts it)."""
        storage = self.paged.storage
        return {"kv_bits": storage.bits if storage.quantized else None,
                "kv_group_size": storage.group_size if storage.quantized else None,
                "bytes_per_block": self.paged.bytes_per_block}

    # ---- secondary tier's write-behind (paged with a disk tier; otherwise no-ops) --------------------------
    def _bridge(self) -> Any:
        return None if self.paged is None else self.paged.tier

    def tier_due_in(self) -> float | None:
        """Seconds until the tier's next write-behind sweep (None: nothing to write): the engine's idle wait."""
        bridge = self._bridge()
        return None if bridge is None else bridge.due_in()

    def tier_ready(self, prompt: list[int], cache_request: CacheRequest | None = None) -> bool:
        """Whether opening a sequence for ``prompt`` finds the blocks its prefix hit takes from the disk tier
        already in host memory. When not, they are being read on the tier's read-ahead thread: keep the request
        queued and ask again at a later step (dense pools and pools without a disk tier are always ready)."""
        bridge = self._bridge()
        if bridge is None or not prompt:
            return True
        cache_request = cache_request or CacheRequest()
        return bridge.read_ahead(prompt, cache_request.salt, spans=cache_request.spans)

    def wait_tier_reads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a disk-tier read ahead to finish (an engine with nothing else to run)."""
        bridge = self._bridge()
        if bridge is not None and bridge.tier.ahead is not None:
            bridge.tier.ahead.wait(timeout)

    def persist_tier(self) -> int:
        """Run the write-behind sweep when it is due (engine thread, between steps); blocks queued."""
        bridge = self._bridge()
        return 0 if bridge is None else bridge.persist()

    def flush_tier(self, timeout: float) -> dict | None:
        """Write every cached block worth keeping to the disk tier within ``timeout`` seconds (shutdown)."""
        bridge = self._bridge()
        return None if bridge is None else bridge.flush(timeout)

    def check_invariants(self) -> None:
        """Assert pool consistency (tests): paged: manager invariants, open sequences == manager sequences."""
        if self.paged is not None:
            self.paged.check_invariants()
            open_ids = sorted(s.paged.seq_id for s in self._sequences.values() if s.paged is not None)
            assert open_ids == sorted(self.paged.sequences) == sorted(self._by_manager_id)

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
