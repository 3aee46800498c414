"""Recurrent-state snapshots, the arrays side: what is captured, where, and how a hit restores it.

The bookkeeping (keys, budget, eviction) is :mod:`mlxkv.kv.blocks.snapshots`; this module reads and writes the
recurrent layers' caches (mlx-lm's cache protocol: ``state`` get/set) of one paged sequence.

Where snapshots are taken (all at block boundaries, the only positions a snapshot can be keyed by):

* the end of the prompt: its last full block boundary before the last token (``(len - 1) // bs * bs``), so a
  repeated prompt recomputes at most ``block_size`` tokens (the last token is always recomputed anyway);
* every ``interval`` blocks of the prompt (``state_snapshot_interval``; 0: none), so prompts sharing a prefix
  (a system prompt, earlier chat turns) resume from the deepest shared multiple;
* the last boundary at or before each given mark (the server marks where each chat message of a templated
  prompt ends), so a shared system prompt or earlier turns resume there without an interval;
* the end of a sequence: the last block boundary it passed (prompt or generated tokens), stored when it is
  released or preempted, so the next turn of a conversation, or the resume, starts there.

Prefill chunks are cut at the first three kinds of position (:meth:`SnapshotRecorder.next_stop`): the state is
only ever seen between forwards. A captured state is a copy of the layer's arrays (a batched decode step
leaves each sequence a slice of the batch's state, which would otherwise keep the whole batch alive).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def _copy_state(value: Any) -> Any:
    """Containers rebuilt, arrays copied (a slice of a batched state must not pin the batch's buffer)."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_state(v) for v in value)
    return value


def _share_state(value: Any) -> Any:
    """Containers rebuilt, arrays shared: MLX arrays are values, and the models assign new state arrays to
    their caches (``cache[i] = x``), never write into the old ones, so a restored cache can share them."""
    if isinstance(value, (list, tuple)):
        return type(value)(_share_state(v) for v in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, mx.array):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def capture(caches: list, layers: list[int]) -> list:
    """The state of each recurrent layer in ``layers`` (copied arrays, one entry per layer)."""
    return [_copy_state(caches[i].state) for i in layers]


def restore(caches: list, layers: list[int], payload: list) -> None:
    """Put a captured ``payload`` back into fresh recurrent caches (arrays shared, not copied)."""
    assert len(payload) == len(layers), "snapshot does not match the model's recurrent layers"
    for i, state in zip(layers, payload):
        caches[i].state = _share_state(state)


def snapshot_bytes(payload: list) -> int:
    """Bytes of a captured payload."""
    return _nbytes(payload)


def probe_state(model: Any, caches: list, layers: list[int]) -> list:
    """A snapshot of ``layers`` after one probe token through the fresh ``caches``: its size and layout are
    every snapshot's (conv and SSM states have a fixed shape whatever the sequence length)."""
    model(mx.array([[1]], dtype=mx.uint32), cache=caches)
    payload = capture(caches, layers)
    mx.eval(payload)
    return payload


def probe_state_bytes(model: Any, caches: list, layers: list[int]) -> int:
    """Bytes one snapshot of ``layers`` takes (see :func:`probe_state`)."""
    return snapshot_bytes(probe_state(model, caches, layers))


def can_snapshot(cache: Any) -> bool:
    """Whether a recurrent layer's cache exposes its state through mlx-lm's ``state`` get/set protocol."""
    cls = type(cache)
    prop = getattr(cls, "state", None)
    return isinstance(prop, property) and prop.fset is not None


class SnapshotRecorder:
    """Takes one paged sequence's snapshots (see the module docstring for where).

    Args:
        manager: the block manager (stores snapshots: ``store_snapshot``).
        seq_id: the sequence's manager id; caches: its layer caches; layers: the recurrent ones.
        prompt_len: tokens it was opened with; start: tokens restored from a hit (no snapshot needed there).
        block_size: tokens per block; interval: blocks between periodic snapshots of the prompt (0: none).
        marks: prompt positions worth a snapshot too (chat message ends): taken at the last block boundary at
            or before each.
    """

    def __init__(self, manager: Any, seq_id: int, caches: list, layers: list[int], *, prompt_len: int, start: int,
                 block_size: int, interval: int, marks: tuple = ()):
        self.manager, self.seq_id, self.caches, self.layers = manager, seq_id, caches, layers
        self.block_size, self.interval = block_size, interval
        self.prompt_end = (prompt_len - 1) // block_size * block_size  # the prompt's last boundary before its last token
        self.last = start  # deepest boundary stored or known to be stored
        self.marks = sorted({p // block_size * block_size for p in marks} - {0})  # boundaries of marked positions
        self.pending: tuple[int, list] | None = None  # (boundary, payload): the last boundary passed, not stored

    def _wanted(self, n: int) -> bool:
        return n == self.prompt_end or n in self.marks or (self.interval > 0 and n <= self.prompt_end
                                                           and n % (self.interval * self.block_size) == 0)

    def next_stop(self, start: int) -> int | None:
        """The first position after ``start`` where a prefill chunk must end for a snapshot; None: none."""
        if start >= self.prompt_end:
            return None
        stop = self.prompt_end
        if self.interval > 0:
            step = self.interval * self.block_size
            stop = min(stop, (start // step + 1) * step)
        return min([stop, *(m for m in self.marks if m > start)])

    def on_commit(self, num_committed: int, num_tokens: int) -> None:
        """After a commit: at a block boundary with every written token verified, the recurrent caches hold
        the state after exactly ``num_committed`` tokens; store it where wanted, else keep it as pending."""
        bs = self.block_size
        if num_committed <= self.last or num_committed % bs or num_committed != num_tokens:
            return
        payload = capture(self.caches, self.layers)
        if self._wanted(num_committed):
            self.manager.store_snapshot(self.seq_id, num_committed // bs, payload)
            self.last, self.pending = num_committed, None
        else:
            self.pending = (num_committed, payload)

    def on_release(self) -> None:
        """Before the sequence's blocks are freed: store the last boundary it passed (the end of a finished
        sequence, or where a preempted one resumes)."""
        if self.pending is not None and self.pending[0] > self.last:
            n, payload = self.pending
            self.manager.store_snapshot(self.seq_id, n // self.block_size, payload)
        self.pending = None
