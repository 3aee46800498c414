"""PagedSequence: one sequence's bridge between its layer caches, the block manager and the page arrays.

The manager works per sequence (slots, commits, trims); mlx-lm calls the layer caches one by one. This
object holds what the layers of one sequence share for a model step (:class:`~mlxkv.kv.paged.step_context.SequenceStep`:
the slot mapping of the positions being written, the block tables, checked on the host), built when the slots are
allocated before the forward (``feed``, ``reserve``) or by the first layer that writes prompt positions nobody
reserved, and the copy instructions to apply before any write.

Slots for *prompt* tokens are allocated on demand (the manager knows the prompt from ``open``), so plain
chunked prefill needs no engine help. Decode tokens must be announced with :meth:`feed` before the model
step (the manager hashes verified blocks by their token ids), and :meth:`commit` marks them verified after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxkv.kv.blocks import CopyOp, KVCacheManager
from mlxkv.kv.paged.page_arrays import PagedStorage
from mlxkv.kv.paged.sequence_attention import attention_for
from mlxkv.kv.paged.step_context import SequenceStep

#: The manager's id for a fed token whose value an overlapped step is still computing (named before commit).
PLACEHOLDER = -1


class PagedPoolExhausted(RuntimeError):
    """The block pool has no free block for the next tokens (raise the KV budget or run fewer sequences)."""


class PagedSequence:
    """A sequence registered with the manager.

    Args:
        manager: the block manager.
        storage: the page arrays.
        group_layers: per manager group, the layers whose pages it addresses.
        seq_id: the manager's id; num_cached: prompt tokens served by the prefix cache.
        layer_block_bytes: bytes one block takes in each layer (for ``nbytes``).
    """

    def __init__(self, manager: KVCacheManager, storage: PagedStorage, group_layers: list[list[int]],
                 seq_id: int, num_cached: int, layer_block_bytes: list[int]):
        self.manager = manager
        self.storage = storage
        self.group_layers = group_layers
        self.seq_id = seq_id
        self.num_cached = num_cached
        self.layer_block_bytes = layer_block_bytes
        self.attention = attention_for(storage)  # its layers' attention backend (one per storage kind)
        self.released = False
        self._step: SequenceStep | None = None  # this step's metadata (a new one once the slots change)
        self.recorder = None  # models with recurrent layers: takes state snapshots (state_snapshots.py)
        self.overflow: dict = {}  # full-attention group -> its PageOverflow (--kv-overflow window|h2o|offload)

    # -- manager state ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Positions with a slot (written, or being written by the current step)."""
        return self.manager.num_tokens(self.seq_id)

    def _changed(self) -> None:
        self._step = None

    def apply_copies(self, copies: Sequence[CopyOp]) -> None:
        """Copy-on-write / partial-reuse instructions from the manager, applied to every layer of the group."""
        if copies:
            self.storage.copy_blocks([(layer, op.src_block, op.dst_block, op.num_tokens)
                                      for op in copies for layer in self.group_layers[op.group_id]])

    def _allocate(self, n: int | None = None, token_ids: Sequence[int] | None = None) -> None:
        alloc = self.manager.allocate_slots(self.seq_id, n, token_ids)
        if alloc is None:
            raise PagedPoolExhausted(
                f"no free KV blocks for {n if token_ids is None else len(token_ids)} more tokens of sequence "
                f"{self.seq_id} ({self.manager.pool.num_free_blocks} free); raise kv_cache_budget or open fewer "
                "sequences")
        self._changed()
        self.apply_copies(alloc.copies)

    def feed(self, token_ids: Sequence[int]) -> None:
        """Announce the tokens the next model step appends (decode input, drafts): allocates their slots and
        builds the step's metadata (:attr:`step`, checked on the host) before the forward."""
        self._allocate(token_ids=[int(t) for t in token_ids])
        _ = self.step

    def feed_placeholder(self) -> int:
        """Allocate the slot of one token whose id is still being computed; returns its position, to name with
        :meth:`name_token` before :meth:`commit` (ids are hashed only at commit)."""
        self.feed([PLACEHOLDER])
        return self.num_tokens - 1

    def name_token(self, position: int, token_id: int) -> None:
        """The id of the token fed at ``position`` by :meth:`feed_placeholder`."""
        self.manager.set_token(self.seq_id, position, token_id)

    def reserve(self, start: int, end: int) -> None:
        """Allocate the slots of prompt positions ``[start, end)`` now (before the model step writes them), so a
        room check made meanwhile for another sequence sees them taken; the step's metadata is built with them."""
        self.slots(0, start, end)

    @property
    def num_committed(self) -> int:
        """Positions written and verified (cached once their block is full)."""
        return self.manager.num_committed(self.seq_id)

    def commit(self, num_tokens: int | None = None) -> None:
        """After a model step: mark written tokens verified (default: all); full blocks become cached."""
        self.manager.commit(self.seq_id, num_tokens)
        self._changed()
        if self.recorder is not None:
            self.recorder.on_commit(self.num_committed, self.num_tokens)
        for state in self.overflow.values():  # past the budget: drop whole pages (page_overflow.py)
            if state.evict(self, self.num_committed):
                self._changed()
            if state.arrays():
                mx.async_eval(*state.arrays())  # fold this step's mass without waiting for it

    def next_stop(self, start: int) -> int | None:
        """The first position after ``start`` where a prefill chunk must end (a recurrent-state snapshot is
        taken there); None when there is none."""
        return None if self.recorder is None else self.recorder.next_stop(start)

    def trim_to(self, target: int) -> int:
        """Drop positions from ``target`` on (the manager may stop short for windowed groups); returns the
        new length."""
        n = self.num_tokens - target
        if n > 0:
            self.manager.trim(self.seq_id, n)
            self._changed()
        return self.num_tokens

    # -- what the layer caches ask -----------------------------------------------------------------
    @property
    def step(self) -> SequenceStep:
        """This step's metadata (block tables, slots, page runs), shared by every layer of the sequence."""
        if self._step is None:
            self._step = SequenceStep(self.manager, self.seq_id, self.storage.block_size, self.storage.num_blocks)
        return self._step

    def _cover(self, start: int, end: int) -> None:
        """Allocate pending prompt positions up to ``end`` (the first time a step writes them)."""
        have = self.num_tokens
        if end > have:
            if start != have:
                raise RuntimeError(f"paged cache: write at {start} but the sequence has {have} positions")
            pending = len(self.manager.token_ids(self.seq_id)) - have
            if end - start > pending:
                raise RuntimeError(
                    "paged cache: no slots for the new tokens; call feed(token_ids) (CachePool: "
                    "Sequence.feed) before the model step")
            self._allocate(end - start)

    def slots(self, group: int, start: int, end: int) -> mx.array:
        """Flat slots (int32 ``(end - start,)``) of positions ``[start, end)`` in ``group``; allocates
        pending prompt positions the first time a layer writes them."""
        self._cover(start, end)
        return self.step.slots(group, start, end)

    def host_slots(self, group: int, start: int, end: int) -> list[int]:
        """The slots of :meth:`slots` as Python ints (allocating as it does; do not modify)."""
        self._cover(start, end)
        return self.step.host_slots(group, start, end)

    def blocks_held(self, group: int) -> int:
        """Real (non-null) blocks in this sequence's table of ``group``."""
        return sum(1 for b in self.manager.block_tables(self.seq_id)[group] if b != 0)

    def release(self) -> None:
        """Free every block (tail first; verified content stays cached). Idempotent."""
        if not self.released:
            if self.recorder is not None:
                self.recorder.on_release()
                self.recorder = None
            self.manager.free(self.seq_id)
            for state in self.overflow.values():
                state.release()  # offload: host pages freed with the blocks
            self.released = True
            self._changed()
