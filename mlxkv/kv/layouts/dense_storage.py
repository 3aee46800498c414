"""Dense K/V storage: the one object that owns a layer's cache buffers.

Layouts (standard, rotating, chunked) map token positions to *slots* and talk to storage only through
``encode`` / ``write`` / ``read`` / ``gather`` / ``drop_front`` / ``nbytes``; paged storage (page arrays
``[num_blocks, block_size, n_kv, D]`` behind a block table) can slot in under the same calls.

Rows are kept as *planes*: one plane per tensor for dense storage, three (packed uint32 words, scales,
biases, as ``mx.quantize`` makes them) for quantized storage. Buffers are ``(B, n_kv, capacity, width)``
and grow in ``step``-row increments, never per token.

In-place writes: ``write`` assigns rows into the resident buffer. MLX performs that assignment in place
(it donates the buffer) when nothing else holds the buffer or a view of it, so storage never keeps views
of its own buffers; the views ``read`` returns belong to the caller's forward pass and die with it.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.rules import KV_BITS, KV_GROUP_SIZES

Planes = tuple  # tuple[mx.array, ...]: one dense plane, or (packed, scales, biases)
Presented = mx.array | tuple  # what the model sees: an array (dense) or mlx-lm's quantized tuple


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


class DenseStorage:
    """Row storage for one layer's keys and values.

    Args:
        step: growth granularity in rows (capacity is always a multiple of ``step``, or ``max_rows``).
        bits: ``None`` for dense rows, 4 or 8 to store rows quantized (affine, per row along head_dim).
        group_size: quantization group along head_dim (32, 64 or 128); ignored when ``bits`` is None.
        max_rows: hard cap on capacity (a ring's size); ``None`` for unbounded.
    """

    def __init__(self, step: int = 256, bits: int | None = None, group_size: int = 64,
                 max_rows: int | None = None):
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if bits is not None and bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS} (or None), got {bits}")
        if bits is not None and group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {group_size}")
        self.step = step
        self.bits = bits
        self.group_size = group_size
        self.max_rows = max_rows
        self._k: Planes | None = None  # planes, each (B, n_kv, capacity, width)
        self._v: Planes | None = None

    # ------------------------------------------------------------------ encoding
    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def encode(self, x: mx.array) -> Planes:
        """Rows as stored: ``(x,)`` dense, or ``mx.quantize(x)`` planes (each row quantized on its own)."""
        if self.bits is None:
            return (x,)
        if x.shape[-1] % self.group_size:
            fits = [g for g in KV_GROUP_SIZES if x.shape[-1] % g == 0]
            hint = (f"pick one of {', '.join(map(str, fits))}" if fits else
                    f"no valid group size ({', '.join(map(str, KV_GROUP_SIZES))}) divides it, so this model "
                    "cannot use a quantized KV cache")
            raise ValueError(f"head_dim {x.shape[-1]} is not divisible by kv_group_size={self.group_size}: {hint}")
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def present(self, planes: Planes) -> Presented:
        """Planes in the form mlx-lm models expect from ``update_and_fetch``."""
        return planes[0] if self.bits is None else tuple(planes)

    # ------------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k[0].shape[2]

    def empty(self) -> bool:
        return self._k is None

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity rows, not only the filled ones)."""
        return sum(p.nbytes for p in self.arrays())

    def arrays(self) -> list[mx.array]:
        """The resident buffers (to ``mx.eval`` after a prefill chunk)."""
        return [*(self._k or ()), *(self._v or ())]

    # ------------------------------------------------------------------ whole buffers (mlx-lm attributes)
    def buffer(self, which: str) -> Presented | None:
        """The whole key (``"k"``) or value (``"v"``) buffer as presented, ``(B, n_kv, capacity, width)``; ``None``
        when empty. The resident array itself, not a copy (a slice of it kept across a write makes MLX copy)."""
        planes = self._k if which == "k" else self._v
        return None if planes is None else self.present(planes)

    def set_buffer(self, which: str, x: Presented | None) -> None:
        """Replace the key or value buffer with ``x`` (an array, or a quantized plane tuple; ``None`` empties it)."""
        planes = None if x is None else tuple(x) if isinstance(x, (tuple, list)) else (x,)
        if which == "k":
            self._k = planes
        else:
            self._v = planes

    def _grow(self, rows: int, k: Planes, v: Planes) -> None:
        cap = _round_up(rows, self.step)
        if self.max_rows is not None:
            assert rows <= self.max_rows, f"write past max_rows ({rows} > {self.max_rows})"
            cap = min(cap, self.max_rows)
        old = self.capacity
        if self._k is None:
            self._k = tuple(mx.zeros((*p.shape[:2], cap, p.shape[3]), p.dtype) for p in k)
            self._v = tuple(mx.zeros((*p.shape[:2], cap, p.shape[3]), p.dtype) for p in v)
            return

        def grow(buf: mx.array) -> mx.array:
            pad = mx.zeros((*buf.shape[:2], cap - old, buf.shape[3]), buf.dtype)
            return mx.concatenate([buf, pad], axis=2)  # (B, n_kv, cap, width)

        self._k = tuple(grow(p) for p in self._k)
        self._v = tuple(grow(p) for p in self._v)

    # ------------------------------------------------------------------ rows
    def write(self, slot: int, k: Planes, v: Planes) -> None:
        """Store encoded rows at slots ``[slot, slot + L)``, growing capacity in steps if needed."""
        end = slot + k[0].shape[2]
        if end > self.capacity:
            self._grow(end, k, v)
        # Slice assignment rebinds each buffer handle to the updated array; the old array is then held only
        # by the update itself, so MLX donates it (writes in place) when the update is scheduled.
        for buf, rows in zip((*self._k, *self._v), (*k, *v)):
            buf[..., slot:end, :] = rows

    def read(self, start: int, end: int) -> tuple[Presented, Presented]:
        """Rows ``[start, end)`` as views (the whole buffer when the range covers it)."""
        assert 0 <= start <= end <= self.capacity, f"read [{start}, {end}) outside capacity {self.capacity}"
        if start == 0 and end == self.capacity:
            return self.present(self._k), self.present(self._v)
        k = tuple(p[..., start:end, :] for p in self._k)  # (B, n_kv, end - start, width)
        v = tuple(p[..., start:end, :] for p in self._v)
        return self.present(k), self.present(v)

    def read_planes(self, start: int, end: int) -> tuple[Planes, Planes]:
        """Like :meth:`read` but always as plane tuples (for concatenation)."""
        k = tuple(p[..., start:end, :] for p in self._k)
        v = tuple(p[..., start:end, :] for p in self._v)
        return k, v

    def gather(self, ranges: list[tuple[int, int]], k_tail: Planes | None = None,
               v_tail: Planes | None = None) -> tuple[Presented, Presented]:
        """Slot ranges in order, then the encoded ``tail`` rows, concatenated (a new array, not a view)."""
        k_parts = [self.read_planes(a, b)[0] for a, b in ranges if b > a]
        v_parts = [self.read_planes(a, b)[1] for a, b in ranges if b > a]
        if k_tail is not None:
            k_parts.append(k_tail)
            v_parts.append(v_tail)
        assert k_parts, "gather of nothing"
        k = tuple(mx.concatenate([part[i] for part in k_parts], axis=2) for i in range(len(k_parts[0])))
        v = tuple(mx.concatenate([part[i] for part in v_parts], axis=2) for i in range(len(v_parts[0])))
        return self.present(k), self.present(v)

    def drop_front(self, n: int, used: int, capacity: int) -> None:
        """Move rows ``[n, used)`` to ``[0, used - n)`` in fresh buffers of ``capacity`` rows."""
        assert 0 < n <= used <= self.capacity and capacity >= used - n

        def move(buf: mx.array) -> mx.array:
            pad = mx.zeros((*buf.shape[:2], capacity - (used - n), buf.shape[3]), buf.dtype)
            return mx.concatenate([buf[..., n:used, :], pad], axis=2)  # (B, n_kv, capacity, width)

        self._k = tuple(move(p) for p in self._k)
        self._v = tuple(move(p) for p in self._v)

    def load(self, k: Planes, v: Planes) -> None:
        """Adopt rows (from a saved state) as the whole buffer; capacity = their row count."""
        self._k, self._v = tuple(k), tuple(v)

    def clear(self) -> None:
        self._k = self._v = None
