"""Rotating (sliding-window) layout: ``keep`` sink tokens plus a ring of recent tokens.

Slots ``[0, keep)`` hold the first ``keep`` tokens for good. The ring (slots ``keep ..``) holds the last
``window + max_rewind`` tokens, token ``p`` in slot ``keep + (p - keep) % ring``; ``window =
max_size - keep`` of them are attended, the older ``max_rewind`` rows are the undo record that makes
``trim`` exact after the ring has wrapped (a rewind only moves the cursor back: nothing to copy).

Decoding writes one row into its slot in place and returns the window in mlx-lm's own ring order,
so logits match mlx-lm's RotatingKVCache bit for bit; once the window has wrapped that is a gathered
copy of the window (``max_size`` rows; the ring itself is never copied).

Visibility (every path, so chunked prefill equals token-by-token decoding): a query at ``q`` sees
the sinks and the keys ``k`` with ``q - k < window`` (and ``< window_size`` when the model passes one).
mlx-lm agrees wherever ``keep == 0`` (sliding-window layers) and for single-token decoding; for
multi-token updates past the window with ``keep > 0`` mlx-lm masks the sinks out progressively, we don't.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.kv.layouts.base import DEFAULT_MAX_REWIND, LayerCache
from mlxkv.kv.layouts.masks import visible


class RotatingKVCache(LayerCache):
    """Sliding-window cache (mlx-lm ``RotatingKVCache`` protocol) with exact rewind.

    Rewind: ``trim(n)`` is exact for any ``n <= max_rewind + 1`` at any time, and for any ``n`` while the
    ring has not wrapped (``offset <= keep + window + max_rewind``); beyond that it raises
    :class:`~mlxkv.kv.layouts.base.RewindError` (``rewindable()`` says how far it can go now).

    Memory: at most ``max_size + max_rewind`` rows, allocated ``step`` rows at a time.

    Args:
        max_size: tokens attended (sinks included), mlx-lm's ``max_size``.
        keep: sink tokens kept forever (mlx-lm uses 4 for ``max_kv_size`` caches, 0 for sliding windows).
        max_rewind: extra ring rows kept as the undo record (tokens always rewindable).
        step: growth granularity in rows.
    """

    #: mlx-lm's batch cache this layout merges into (set by :mod:`mlxkv.kv.layouts.mlx_lm_batch`).
    batch_class: type

    def __init__(self, max_size: int, keep: int = 0, max_rewind: int = DEFAULT_MAX_REWIND, step: int = 256):
        if not 0 <= keep < max_size:
            raise ValueError(f"need 0 <= keep < max_size, got keep={keep}, max_size={max_size}")
        if max_rewind < 0:
            raise ValueError(f"max_rewind must be >= 0, got {max_rewind}")
        self.max_size = max_size
        self.keep = keep
        self.max_rewind = max_rewind
        self._floor = keep  # oldest non-sink position whose row is still intact
        self._origin = keep  # mlx-lm's ring order: token p sits in its slot keep + (p - origin) % window
        super().__init__(step)

    @property
    def window(self) -> int:
        """Non-sink tokens attended."""
        return self.max_size - self.keep

    @property
    def ring(self) -> int:
        """Non-sink rows stored: the window plus the undo record."""
        return self.window + self.max_rewind

    def _max_rows(self) -> int:
        return self.keep + self.ring

    # -- positions and slots ------------------------------------------------------------------
    def _slot(self, p: int) -> int:
        return p if p < self.keep else self.keep + (p - self.keep) % self.ring

    def _slot_runs(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """Contiguous ``(position, slot, length)`` runs covering positions ``[a, b)`` in order."""
        runs: list[tuple[int, int, int]] = []
        while a < b:
            s = self._slot(a)
            end = self.keep if a < self.keep else self.keep + self.ring
            n = min(b - a, end - s)
            if runs and runs[-1][1] + runs[-1][2] == s:
                p0, s0, n0 = runs[-1]
                runs[-1] = (p0, s0, n0 + n)
            else:
                runs.append((a, s, n))
            a += n
        return runs

    def _write_positions(self, a: int, b: int, k: tuple, v: tuple, first: int) -> None:
        """Store positions ``[a, b)``, whose rows are ``k``/``v`` rows starting at position ``first``."""
        for p, s, n in self._slot_runs(a, b):
            r = p - first
            self._store.write(s, tuple(x[..., r:r + n, :] for x in k), tuple(x[..., r:r + n, :] for x in v))

    def _old_start(self) -> int:
        """Oldest non-sink position a multi-token update returns (enough for the first new query)."""
        return max(self.keep, self.offset - (self.window - 1))

    def _advance(self, n: int) -> None:
        self.offset += n
        self._floor = max(self._floor, self.offset - self.ring)

    def _ring_runs(self, end: int) -> list[tuple[int, int, int]]:
        """Slot runs of the sinks and the window of tokens before ``end`` in mlx-lm's ring order (token ``p``
        in its slot ``keep + (p - origin) % window``): what mlx-lm's buffer holds, in its order."""
        if end <= self.max_size:  # mlx-lm's ring is not full yet: every token, in order
            return self._slot_runs(0, end)
        a = end - 1 - ((end - 1 - self._origin) % self.window)  # the token in mlx-lm's slot `keep`
        return self._slot_runs(0, self.keep) + self._slot_runs(a, end) + self._slot_runs(end - self.window, a)

    def _decode_runs(self, last: int) -> list[tuple[int, int, int]]:
        """Slot runs of the rows a single-token update at ``last`` returns: sinks, then the window in
        mlx-lm's ring order, so attention sums exactly as mlx-lm's does."""
        return self._ring_runs(last + 1)

    # -- protocol -----------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        """Append ``(B, n_kv, L, D)`` rows; return the rows the new queries may attend.

        One token (in-place path): the row goes into its ring slot; returned are the sinks and the
        window in mlx-lm's ring order — a view where those rows are one run of slots (always before
        the window wraps), else a gathered copy of the window (never of the ring). Several tokens (or
        ``kv_inplace_write`` off): sinks + the last ``window - 1`` tokens + the new rows in temporal order,
        as mlx-lm returns them.
        """
        L = keys.shape[2]
        k, v = self._store.encode(keys), self._store.encode(values)
        if L == 1 and self._inplace:
            last = self.offset
            self._store.write(self._slot(last), k, v)
            self._advance(1)
            runs = self._decode_runs(last)
            if len(runs) == 1:  # one contiguous run of slots: a view, nothing copied
                return self._store.read(runs[0][1], runs[0][1] + runs[0][2])
            return self._store.gather([(s, s + n) for _, s, n in runs])
        runs = self._slot_runs(0, min(self.keep, self.offset)) + self._slot_runs(self._old_start(), self.offset)
        fetched = self._store.gather([(s, s + n) for _, s, n in runs], k, v)  # (B, n_kv, K, D)
        end = self.offset + L
        self._write_positions(self.offset, min(end, self.keep), k, v, self.offset)  # new sink rows
        self._write_positions(max(self.offset, self.keep, end - self.ring), end, k, v, self.offset)
        self._advance(L)
        # mlx-lm lays its ring out in temporal order after a multi-token update
        self._origin = end if end - self.keep >= self.window else self.keep
        return fetched

    def _fetch_positions(self, N: int) -> tuple[mx.array, int, int]:
        """For ``N`` new tokens: token positions of the rows ``update_and_fetch`` will return, the oldest
        non-sink position among them, and how many sink rows lead them."""
        if N == 1 and self._inplace:
            last = self.offset
            runs = self._decode_runs(last)
            pos = mx.concatenate([mx.arange(p, p + n) for p, _, n in runs])
            n_sink = min(self.keep, last + 1)
            oldest = max(self.keep, last - self.window + 1) if last >= self.keep else last
            return pos, oldest, n_sink
        n_sink = min(self.keep, self.offset)
        start = min(self._old_start(), self.offset)
        pos = mx.concatenate([mx.arange(n_sink), mx.arange(start, self.offset + N)])
        return pos, start, n_sink

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for ``N`` new queries over the rows ``update_and_fetch`` will return, shaped as mlx-lm's.

        Several queries: ``"causal"`` when every earlier returned row is visible (and ``return_array`` is
        off), else a boolean ``(N, K)`` array. One query (``return_array`` does not apply, as in mlx-lm):
        ``None`` when it sees every returned row, else a boolean ``(K,)`` array.
        """
        w = self.window if window_size is None else min(window_size, self.window)
        sinks = self.keep if window_size is None else 0
        pos, oldest, n_sink = self._fetch_positions(N)
        if n_sink and not sinks:
            oldest = 0  # sinks are ordinary (windowed) rows when the model passes its own window
        if (N == 1 or not return_array) and (self.offset + N - 1) - oldest < w:
            return None if N == 1 else "causal"
        mask = visible(mx.arange(self.offset, self.offset + N), pos, w, sinks)  # (N, K)
        return mask[0] if N == 1 else mask

    @classmethod
    def merge(cls, caches: list) -> Any:
        """mlx-lm's batching entry point: the caches (one per sequence, same ``max_size``) as one
        :class:`~mlxkv.kv.layouts.mlx_lm_batch.BatchRotatingKVCache` (a plain window: like mlx-lm's, it keeps no sinks);
        its ``extract(i)`` gives sequence ``i`` back as a ``RotatingKVCache``."""
        return cls.batch_class.merge(caches)

    def _temporal_order(self, v):
        """mlx-lm's helper (its ``BatchRotatingKVCache.merge`` calls it on ``cache.keys`` / ``cache.values``):
        the :meth:`size` rows of buffer ``v`` mlx-lm's cache would hand over, in temporal order. Right after a
        multi-token update mlx-lm's buffer holds every recent token: the last ``max_size`` (sinks included only
        if among them); else the sinks and the window."""
        last = self.offset - min(self.offset, self.max_size)
        if self._origin == self.offset and max(last, self.keep) >= self._floor:
            runs = self._slot_runs(last, self.offset)
        else:
            runs = self._slot_runs(0, min(self.keep, self.offset)) + self._slot_runs(
                max(self.keep, self._floor, self.offset - self.window), self.offset)
        return mx.concatenate([v[..., s: s + n, :] for _, s, n in runs], axis=2)  # (B, n_kv, size, D)

    def size(self) -> int:
        """Tokens held for attention: ``min(offset, max_size)`` as mlx-lm's (one fewer right after a trim to
        the rewind limit, whose oldest window row was overwritten)."""
        return min(self.offset, self.max_size, self.keep + self.offset - self._floor)

    def rewindable(self) -> int:
        if self._floor <= self.keep:
            return self.offset  # no non-sink row has been overwritten
        return max(0, self.offset - (self._floor + self.window - 1))

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens, restoring exactly the earlier state; returns the number removed.

        Raises:
            RewindError: when rows the earlier state needs have left the undo record.
        """
        n = self._check_rewind(n)
        self.offset -= n
        if self._origin > self.offset or self.offset - self.keep < self.window:
            # as if the last multi-token update had ended here (mlx-lm's ring order after it)
            self._origin = self.offset if self.offset - self.keep >= self.window else self.keep
        return n

    # -- state: mlx-lm's (keys, values, offset, keep, max_size, _idx) ----------------------------------
    # The rows are every intact token (sinks first). mlx-lm reads ``_idx`` as its ring's write index; with
    # ``_idx`` equal to the row count it takes the rows in temporal order (its state after a multi-token
    # update), and so do we, the ring then restarting at the next token. Once mlx-lm's window is full the
    # single-token order we return depends on where the ring started (``_origin``), so the state keeps it:
    # - rows exactly sinks + window: mlx-lm's own ring layout, ``_idx`` its write index;
    # - more rows (the undo record): temporal order and ``_idx = offset + 1 + (offset - origin)``. mlx-lm
    #   treats every ``_idx`` at or beyond both the row count and the offset alike (temporal rows; a
    #   single-token update keeps the last window), so it reads the file as before.
    def _state_runs(self) -> list[tuple[int, int, int]]:
        """Slot runs of every intact token, sinks first, in temporal order."""
        return self._slot_runs(0, min(self.keep, self.offset)) + self._slot_runs(
            max(self.keep, self._floor), self.offset)

    def _state_layout(self) -> tuple[list[tuple[int, int, int]], int]:
        """Slot runs of the state's rows, in the state's order, and the state's ``_idx``."""
        runs = self._state_runs()
        rows = sum(n for _, _, n in runs)
        if self.offset < self.max_size or self._origin == self.offset:
            return runs, rows  # no ring order yet, or the one temporal rows stand for
        if rows == self.max_size:
            phase = (self.offset - self._origin) % self.window  # tokens written since the ring's slot `keep`
            return self._ring_runs(self.offset), self.keep + (phase or self.window)
        return runs, 2 * self.offset + 1 - self._origin

    def _arrays_state(self) -> tuple:
        runs, _ = self._state_layout()
        if self._store.empty() or not runs:
            return (None, None)
        return self._store.gather([(s, s + n) for _, s, n in runs])

    def _scalars(self) -> tuple:
        idx = self._state_layout()[1] if not self._store.empty() else 0
        return (self.offset, self.keep, self.max_size, idx)

    def _state_origin(self, offset: int, rows: int, idx: int) -> int:
        """``_origin`` from a state's offset, row count and ``_idx`` (ours or mlx-lm's; see above)."""
        if offset < self.max_size:
            return self.keep
        if idx > rows:
            return 2 * offset + 1 - idx
        if rows == self.max_size:
            return offset - (idx - self.keep) % self.window
        return offset

    def _restore(self, arrays: tuple, scalars: tuple) -> None:
        offset, keep, max_size, idx = (int(s) for s in scalars)
        assert (keep, max_size) == (self.keep, self.max_size), "state is for another rotating layout"
        self.offset = offset
        keys, values = arrays
        if keys is None:
            self._store.clear()
            self._floor = self._origin = self.keep
            return
        k, v = self._planes(keys), self._planes(values)
        rows = k[0].shape[2]
        origin = self._state_origin(offset, rows, idx)
        if idx < rows:  # mlx-lm's ring order (or a buffer with unused rows): put it in temporal order first
            k, v = (tuple(self._temporal(x, idx, offset) for x in planes) for planes in (k, v))
            rows = k[0].shape[2]
        n_sink = min(self.keep, offset, rows)
        n_old = rows - n_sink
        if n_old > self.ring:
            self.max_rewind = n_old - self.window
        self._store = self._make_storage()
        self._write_positions(0, n_sink, k, v, 0)
        first = offset - n_old  # position of row n_sink
        self._write_positions(first, offset, tuple(x[..., n_sink:, :] for x in k),
                              tuple(x[..., n_sink:, :] for x in v), first)
        self._floor = max(self.keep, first)
        self._origin = origin

    def _temporal(self, x: mx.array, idx: int, offset: int) -> mx.array:
        if idx < offset:  # wrapped: sinks, then slots from the write index on, then the rest
            return mx.concatenate([x[..., : self.keep, :], x[..., idx:, :], x[..., self.keep: idx, :]], axis=2)
        return x[..., :idx, :]

    @classmethod
    def _blank(cls, scalars: tuple) -> RotatingKVCache:
        _, keep, max_size, _ = (int(s) for s in scalars)
        return cls(max_size, keep)
