"""PagedBackend: paged K/V for every sequence of one model — groups, manager, page arrays, sequences.

Layer layouts come from :func:`mlxkv.kv.layouts.make_caches` (the model's own cache structure): standard layers
form the "full" group, sliding-window layers a "sliding" group per window, Llama-4 chunked layers a
"chunked" group per chunk size (:class:`~mlxkv.kv.blocks.KVCacheGroupSpec`). Recurrent layers (ArraysCache)
keep mlx-lm's placeholders, created fresh per sequence.

Models with recurrent layers get prefix caching through recurrent-state snapshots at block boundaries
(:mod:`mlxkv.kv.blocks.snapshots`, :mod:`mlxkv.kv.paged.state_snapshots`): a hit ends where the attention
blocks and a snapshot both exist, and the snapshot is restored into the sequence's fresh recurrent caches.
A snapshot costs ``blocks_per_snapshot`` pool blocks (its state bytes over one block's bytes, rounded up).
Where a recurrent layer's state cannot be read (no ``state`` setter), prefix caching is off and a warning
says so. The secondary tier offloads and restores snapshots with the blocks (:mod:`mlxkv.kv.tier.state_tier`).

Memory: the budget (``kv_cache_budget`` / ``max_tokens`` / ``num_blocks``) is the pool's capacity — what
admission, preemption and every capacity figure count — but the page arrays grow in chunks as blocks are first
needed (at least :data:`GROW_BYTES` or a sixteenth of a smaller budget, and a quarter of what is held) and,
after ``idle_release_s`` with no sequence open, give back every chunk above the first
(:meth:`PagedBackend.release_unused`); ``preallocate`` allocates the whole budget at the first write instead.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxkv.config import KvCacheConfig, num_blocks_for_budget
from mlxkv.kv.blocks import KVCacheGroupSpec, KVCacheManager
from mlxkv.kv.blocks.cache_request import CacheRequest
from mlxkv.kv.layouts import (
    ChunkedKVCache,
    KVCache,
    LayerCache,
    RotatingKVCache,
    check_kv_group_size,
    make_caches,
)
from mlxkv.kv.layouts.latent_cache import LatentCache
from mlxkv.kv.paged.latent_pages import LatentPagedCache
from mlxkv.kv.paged.layer_cache import PagedLayerCache
from mlxkv.kv.paged.page_arrays import PagedStorage
from mlxkv.kv.paged.page_overflow import PageOverflow
from mlxkv.kv.paged.paged_sequence import PagedSequence
from mlxkv.kv.paged.quantized_pages import QuantizedPagedStorage, quantized_block_bytes
from mlxkv.kv.paged.state_snapshots import SnapshotRecorder, can_snapshot, probe_state, restore, snapshot_bytes

log = logging.getLogger(__name__)

#: The least a growing pool's page arrays grow by (every layer's share together), and the reserve an idle
#: pool keeps: small next to the weights, and enough for a few thousand tokens of a small model.
GROW_BYTES = 32 << 20


def _group_key(cache: Any) -> tuple | None:
    """The manager group a dense layout maps to; None for recurrent state."""
    if isinstance(cache, RotatingKVCache):
        if cache.keep:
            raise ValueError("the paged backend supports sliding windows without sink tokens (keep=0); "
                             f"this layer keeps {cache.keep}: use backend='dense'")
        return ("sliding", cache.max_size)
    if isinstance(cache, ChunkedKVCache):
        return ("chunked", cache.chunk_size)
    if isinstance(cache, (KVCache, LatentCache)):  # absorbed MLA: latent pages, full attention
        return ("full",)
    if isinstance(cache, LayerCache):
        raise ValueError(f"the paged backend has no layout for {type(cache).__name__}; use backend='dense'")  # noqa: TRY004
    if hasattr(cache, "update_and_fetch") and not hasattr(cache, "__getitem__"):
        raise ValueError(f"the paged backend cannot page {type(cache).__name__} layers; use backend='dense'")
    return None


def _spec(key: tuple, layers: list[int]) -> KVCacheGroupSpec:
    if key[0] == "sliding":
        return KVCacheGroupSpec("sliding", window=key[1], layer_ids=tuple(layers))
    if key[0] == "chunked":
        return KVCacheGroupSpec("chunked", chunk_size=key[1], layer_ids=tuple(layers))
    return KVCacheGroupSpec("full", layer_ids=tuple(layers))


def probe_block_bytes(model: Any, block_size: int) -> list[int]:
    """Bytes one block takes in each layer (0 for recurrent layers), from one probe token through dense caches."""
    caches = make_caches(model)
    model(mx.array([[1]], dtype=mx.uint32), cache=caches)
    out = []
    for c in caches:
        if isinstance(c, (LayerCache, LatentCache)):
            k, v = c.state[:2]  # (1, H, 1, D) each; latent caches: (1, 1, 1, kv_lora_rank), (1, 1, 1, rope_dim)
            out.append(block_size * (k.shape[1] * k.shape[3] * k.itemsize + v.shape[1] * v.shape[3] * v.itemsize))
        else:
            out.append(0)
    return out


def free_memory_bytes() -> int:
    """Free memory for ``kv_cache_budget='auto'``: Metal's recommended working set less active memory, else
    the system's available physical memory."""
    if mx.metal.is_available():
        info = mx.metal.device_info()
        return max(0, int(info["max_recommended_working_set_size"]) - mx.get_active_memory())
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PagedBackend:
    """Paged storage for one model: ``open`` a sequence (prefix hit included), ``release`` it.

    Args:
        model: the mlx-lm model.
        config: block size, budget and reuse settings (``backend`` is not read here).
        num_blocks: pool size overriding the budget (tests, benchmarks).
        grow_blocks: the least the page arrays grow by, in blocks (default: :data:`GROW_BYTES` worth, at most a
            sixteenth of the budget).
        free_bytes: free memory for ``kv_cache_budget='auto'`` (default: measured).
        model_path: the model's folder (config.json + safetensors), for the secondary tier's model
            fingerprint; without it the fingerprint samples the weights.

    With any ``secondary_*`` field of ``config`` set, a secondary tier (host memory and/or disk,
    :func:`mlxkv.kv.tier.bridge.attach_tier`) sits behind the pool: evicted blocks are offloaded to it and
    ``open`` restores a prompt's blocks from it before taking the prefix hit (``self.tier``; None without).

    Raises:
        ValueError: a layer layout the paged backend cannot hold (sink tokens, CacheList), or ``kv_bits`` with a
            ``kv_group_size`` that does not divide head_dim.
    """

    def __init__(self, model: Any, config: KvCacheConfig, *, num_blocks: int | None = None,
                 free_bytes: int | None = None, model_path: str | None = None, grow_blocks: int | None = None):
        if config.max_kv_size is not None:
            raise ValueError("max_kv_size applies to the dense backend only; the paged backend is bounded by "
                             "kv_cache_budget / max_tokens")
        if config.kv_bits is not None:  # one line at start, as the dense backend's: MLA refused, group size checked
            make_caches(model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)
            check_kv_group_size(model, config.kv_group_size)
        self.model = model
        self.config = config
        template = make_caches(model)
        keys = [_group_key(c) for c in template]
        order: dict[tuple, list[int]] = {}
        for layer, key in enumerate(keys):
            if key is not None:
                order.setdefault(key, []).append(layer)
        if not order:
            raise ValueError("the model has no attention layer to page")
        self.group_keys = list(order)
        self.specs = [_spec(k, layers) for k, layers in order.items()]
        self.layer_group = [None if k is None else self.group_keys.index(k) for k in keys]
        self.recurrent_layers = [i for i, k in enumerate(keys) if k is None]
        self.recurrent = bool(self.recurrent_layers)
        self.layer_class = [LatentPagedCache if isinstance(c, LatentCache) else PagedLayerCache for c in template]
        self.block_size = config.block_size
        self.layer_block_bytes = (probe_block_bytes(model, config.block_size) if config.kv_bits is None else
                                  quantized_block_bytes(model, config.block_size, config.kv_bits, config.kv_group_size))
        self.bytes_per_block = sum(self.layer_block_bytes)
        self.snapshot_bytes = self.blocks_per_snapshot = 0  # recurrent-state snapshots (module docstring)
        self.snapshot_probe: list | None = None  # one snapshot's arrays: the layout every snapshot has
        reuse = config.enable_block_reuse
        if self.recurrent and reuse:
            if all(can_snapshot(template[i]) for i in self.recurrent_layers):
                self.snapshot_probe = probe_state(model, make_caches(model), self.recurrent_layers)
                self.snapshot_bytes = snapshot_bytes(self.snapshot_probe)
                self.blocks_per_snapshot = max(1, math.ceil(self.snapshot_bytes / self.bytes_per_block))
            else:
                names = sorted({type(template[i]).__name__ for i in self.recurrent_layers})
                log.warning("prefix caching is off for this model: its recurrent layers (%s) expose no state to "
                            "snapshot, so a prefix hit could not restore them", ", ".join(names))
                reuse = False
        if num_blocks is None:
            if config.kv_cache_budget == "auto" and free_bytes is None:
                free_bytes = free_memory_bytes()
            num_blocks = num_blocks_for_budget(config, self.bytes_per_block, free_bytes)
        # a chunk: GROW_BYTES worth, or a sixteenth of a smaller pool's budget
        self.grow_blocks = grow_blocks or max(1, min(GROW_BYTES // max(1, self.bytes_per_block), num_blocks // 16))
        initial = None if config.preallocate else 1  # growing: nothing but the null block until a block is needed
        # one block id = one page in every layer, so a block costs bytes_per_block whichever group holds it
        self.manager = KVCacheManager(
            num_blocks, config.block_size, self.specs,
            enable_block_reuse=reuse,
            enable_partial_reuse=config.enable_partial_reuse, copy_on_partial_reuse=config.copy_on_partial_reuse,
            hash_algo=config.hash_algo, tenant_share=config.primary_tenant_share,
            state_snapshot_blocks=self.blocks_per_snapshot, initial_blocks=initial, grow_blocks=self.grow_blocks,
        )
        allocated = self.manager.pool.allocated
        if config.kv_bits is None:
            self.storage = PagedStorage(allocated, config.block_size, len(keys))
        else:  # quantized pages (kv_bits, groups of kv_group_size along head_dim): quantized_pages.py
            self.storage = QuantizedPagedStorage(allocated, config.block_size, len(keys), bits=config.kv_bits,
                                                 group_size=config.kv_group_size)
        self.manager.pool.add_resize_hook(self.storage.resize)
        self._active_at = time.monotonic()  # last open or release: the idle release counts from here
        self.sequences: dict[int, PagedSequence] = {}
        self.tier = None
        if config.secondary_enabled:
            from mlxkv.kv.tier.bridge import attach_tier

            self.tier = attach_tier(self, memory_bytes=config.secondary_memory_bytes,
                                    disk_dir=config.secondary_disk_dir, disk_bytes=config.secondary_disk_cap,
                                    model_path=model_path)

    @property
    def num_blocks(self) -> int:
        """The pool's capacity in blocks (the null block included): the budget, allocated or not."""
        return len(self.manager.pool.blocks)

    @property
    def allocated_blocks(self) -> int:
        """Blocks whose pages exist now (the null block included): ``num_blocks`` once grown to the budget."""
        return self.storage.num_blocks

    def set_grow_blocks(self, grow_blocks: int) -> None:
        """Grow by at least ``grow_blocks`` from now on (ranks of one distributed pool agree on it before use)."""
        self.grow_blocks = self.manager.pool.grow_blocks = max(1, grow_blocks)

    def release_due_in(self) -> float | None:
        """Seconds until :meth:`release_unused` is due (``idle_release_s`` after the last sequence closed); None
        while a sequence is open, with nothing above the first chunk to give back, or with the release off."""
        period = self.config.idle_release_s
        pool = self.manager.pool
        if self.config.preallocate or self.sequences or not period or pool.allocated <= 1 + self.grow_blocks:
            return None
        return max(0.0, self._active_at + period - time.monotonic())

    def release_unused(self) -> int:
        """Give back the chunks above the first that no sequence holds (cached blocks there are evicted: to the
        secondary tier when one is attached); returns how many blocks were given back."""
        self._active_at = time.monotonic()  # the next idle release is a whole period away
        return self.manager.pool.release_tail(keep=1 + self.grow_blocks)

    def check_overflow(self, config: Any) -> None:
        """Raise ValueError when sequences of this backend cannot run ``config`` (a
        :class:`mlxkv.config.KvOverflowConfig` with a per-sequence cap; :mod:`mlxkv.kv.paged.page_overflow`)."""
        policy = f"kv_overflow {config.policy}"
        config.check_pages(self.block_size)
        if self.storage.quantized:
            raise ValueError(f"{policy} on the paged backend keeps full-precision pages: it does not combine with "
                             "--kv-bits (use --kv-backend dense for a quantized window)")
        if self.recurrent or any(cls is LatentPagedCache for cls in self.layer_class):
            raise ValueError(f"{policy} on the paged backend serves models with standard attention layers only "
                             "(this one has recurrent or latent layers)")
        if not any(spec.is_full for spec in self.specs):
            raise ValueError(f"{policy}: this model has no full-attention layer to bound")

    def _attach_overflow(self, seq: PagedSequence, config: Any) -> None:
        if config is not None and config.enabled:
            seq.overflow = {g: PageOverflow(config, g, self.block_size, list(spec.layer_ids))
                            for g, spec in enumerate(self.specs) if spec.is_full}

    def open(self, prompt: Sequence[int], request: CacheRequest | None = None) -> tuple[list, PagedSequence]:
        """Register a sequence with its prompt (taking its prefix hit) and build its layer caches.

        Args:
            prompt: its token ids.
            request: its :class:`~mlxkv.kv.blocks.cache_request.CacheRequest`: salt and per-range salts (hashed into its
                blocks), snapshot marks (prompt positions where recurrent layers' state is also snapshot, at the
                last block boundary at or before each), retention, preemption rank, overflow policy (checked by
                :meth:`check_overflow`; ``None``: the whole context stays paged).

        Returns:
            ``(caches, seq)``: one cache per model layer (paged, or the model's recurrent placeholder), and
            the sequence (``seq.num_cached`` prompt tokens need no compute; prefill from there).
        """
        request = request or CacheRequest()
        self._active_at = time.monotonic()
        salt, spans = request.salt, request.spans
        hashes = hit = None
        if self.tier is not None:  # the prompt's lookup (made when it was queued, if it was): hashed once
            lookup = self.tier.lookup_for_open(prompt, salt, spans=spans)
            self.tier.restore(prompt, salt, spans=spans, lookup=lookup)  # tier blocks extending the hit come back
            hashes, hit = lookup.hashes, self.tier.hit_for_open(lookup)
        res = self.manager.open(prompt, salt=salt, spans=spans, retention=request.retention,
                                priority=request.preemption_rank, block_hashes=hashes, hit=hit)
        seq = PagedSequence(self.manager, self.storage, [list(s.layer_ids) for s in self.specs],
                            res.seq_id, res.num_cached_tokens, self.layer_block_bytes)
        seq.apply_copies(res.copies)
        self._attach_overflow(seq, request.overflow)
        self.sequences[seq.seq_id] = seq
        caches = []
        for layer, c in enumerate(make_caches(self.model)):
            g = self.layer_group[layer]
            caches.append(c if g is None else self.layer_class[layer](seq, layer, g, self.specs[g]))
        if res.state is not None:
            restore(caches, self.recurrent_layers, res.state)  # the paged layers start at num_cached already
        self._record(seq, caches, len(prompt), res.num_cached_tokens, request.snapshot_at)
        return caches, seq

    def _record(self, seq: PagedSequence, caches: list, prompt_len: int, start: int, marks: tuple = ()) -> None:
        """Attach the snapshot recorder of a sequence (models with recurrent layers and snapshots on)."""
        if self.manager.snapshots is not None:
            seq.recorder = SnapshotRecorder(self.manager, seq.seq_id, caches, self.recurrent_layers,
                                            prompt_len=prompt_len, start=start, block_size=self.block_size,
                                            interval=self.config.state_snapshot_interval, marks=marks)

    def fork(self, parent: PagedSequence, parent_caches: list, n: int) -> list[tuple[list, PagedSequence]]:
        """``n`` children sharing every block of ``parent`` (ref counts, no K/V copied); a shared partial
        tail block is copied on a child's first write. Recurrent placeholders are deep-copied (their state is
        per sequence). Call after the step that wrote the parent's slots.

        Returns:
            One ``(caches, seq)`` per child, positioned where the parent is.
        """
        import copy

        offset = next((c.offset for c in parent_caches if isinstance(c, PagedLayerCache)), 0)
        children = []
        for child_id in self.manager.fork(parent.seq_id, n):
            seq = PagedSequence(self.manager, self.storage, parent.group_layers, child_id, parent.num_cached,
                                self.layer_block_bytes)
            seq.overflow = {g: state.clone() for g, state in parent.overflow.items()}
            self.sequences[child_id] = seq
            caches = []
            for layer, c in enumerate(parent_caches):
                if isinstance(c, PagedLayerCache):
                    child = type(c)(seq, layer, c.group, c.spec)
                    child.offset = offset
                    caches.append(child)
                else:
                    caches.append(copy.deepcopy(c))
            if parent.recorder is not None:  # the parent's snapshots are the children's: record from here on
                self._record(seq, caches, parent.recorder.prompt_end + 1, parent.num_committed)
            children.append((caches, seq))
        return children

    def release(self, seq: PagedSequence) -> None:
        """Free the sequence's blocks tail first (verified blocks stay cached for later hits)."""
        seq.release()
        self.sequences.pop(seq.seq_id, None)
        self._active_at = time.monotonic()

    def overflow_host_bytes(self) -> int:
        """Host memory the open sequences' offloaded pages hold (``--kv-overflow offload``)."""
        return sum(state.host.host_nbytes for seq in self.sequences.values() for state in seq.overflow.values()
                   if state.host is not None)

    def tier_stats(self) -> dict:
        """Prefix-hit figures for ``/v1/cache/stats`` and metrics: blocks of prompts seen, hits served by the
        primary pool vs by the secondary tier, and the tier's own counters under ``secondary`` (None
        without a tier; the hit figures are then the manager's, in tokens)."""
        if self.tier is not None:
            return {"enabled": True, **self.tier.stats()}
        st = self.manager.stats()
        return {"enabled": False, "prompt_tokens": st.prompt_tokens, "primary_hit_tokens": st.hit_tokens,
                "secondary_hit_blocks": 0, "secondary": None}

    def snapshot_stats(self) -> dict | None:
        """Recurrent-state snapshots for stats (None for models without recurrent layers): bytes each, the
        blocks each costs, how many are stored and the hits they served."""
        snaps = self.manager.snapshots
        if not self.recurrent:
            return None
        if snaps is None:
            return {"enabled": False}
        return {"enabled": True, "bytes_each": self.snapshot_bytes, "interval_blocks": self.config.state_snapshot_interval,
                **snaps.stats()}

    def flush_cached(self) -> int:
        """Evict every cached block no sequence holds (offloading it to the secondary tier, when attached
        and its priority allows): e.g. before shutting down so a restart finds the blocks on disk. Returns
        how many blocks were evicted."""
        pool = self.manager.pool
        return pool.evict_cached(len(pool.blocks))

    def check_invariants(self) -> None:
        """Manager invariants plus: every open sequence is registered, nothing else holds blocks."""
        self.manager.check_invariants()
        assert sorted(self.manager.sequences()) == sorted(self.sequences), "manager and backend disagree"
