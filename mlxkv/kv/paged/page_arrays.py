"""Page arrays: the K/V storage every paged sequence of one model shares.

One pair of page arrays per attention layer, ``[kv_heads, num_blocks, block_size, head_dim]``, indexed by the
block ids of :mod:`mlxkv.kv.blocks` (block 0 is the null block, never read unmasked). A layer's arrays are
allocated at its first write, from that write's kv_heads / head_dim / dtype, so models whose keys and values
differ in width (MLA caches a latent and a rope key) work too.

They are *stored* in the same memory order seen as one dense cache of batch 1, ``(1, kv_heads, num_blocks *
block_size, head_dim)`` ("rows": slot ``s`` is row ``s``), which is what the CPU decode path touches every step:
a decode row is written with one slice update and consecutive pages are read with one slice, the operations
of a dense cache. The kernels get the page shape through :meth:`PagedStorage.pages` (a reshape, no copy).

Ownership: this object is the only holder of each page array, and rebinds it to every write's result, so a
decode write is O(rows) (MLX donates the buffer) — see :mod:`mlxkv.kernels.kv_write_ref`.

Size: ``num_blocks`` pages, the block ids the pool backs now. A growing pool (:mod:`mlxkv.kv.blocks.block_pool`)
calls :meth:`PagedStorage.resize` when it backs more ids (the arrays are extended with zero pages: one copy, into
a new sole-owned buffer) or gives the top ones back (the kept prefix copied into a smaller buffer). Block ids
never move, so every page keeps its index and its values.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.kernels import kv_write
from mlxkv.kernels.geometry import page_runs
from mlxkv.kernels.kv_write_ref import page_rows, scatter_rows, write_row_runs
from mlxkv.memory import release_free_memory

#: A gather of pages lying in at most this many runs of consecutive pages concatenates those slices (a few
#: contiguous copies) instead of indexing every page (measured ~1.8x faster for a 4K-row prefix + a few pages).
MAX_CONCAT_RUNS = 8


def _scatter(pages: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """Write ``rows`` ``(T, H, D)`` into flat ``slots`` of ``pages`` (for K/V pairs of unequal shapes)."""
    return scatter_rows(pages, page_rows(slots, pages.shape), rows)


class PagedStorage:
    """Per-layer page arrays over one block pool.

    Args:
        num_blocks: pages per layer (the null block included): the ids the pool backs now (:meth:`resize`).
        block_size: token rows per page.
        num_layers: model layers (recurrent layers simply never write).
    """

    quantized = False  # the quantized twin: mlxkv.kv.paged.quantized_pages.QuantizedPagedStorage

    def __init__(self, num_blocks: int, block_size: int, num_layers: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k_rows: list[mx.array | None] = [None] * num_layers  # (1, kv_heads, num_blocks * bs, D_k) once written
        self.v_rows: list[mx.array | None] = [None] * num_layers  # (1, kv_heads, num_blocks * bs, D_v)

    def allocated(self, layer: int) -> bool:
        return self.k_rows[layer] is not None

    def resize(self, num_blocks: int) -> None:
        """Hold pages ``[0, num_blocks)`` from now on: added pages are zeros, pages past it are dropped, the rest
        keep their values. Evaluated here, and freed memory handed back to the system now."""
        if num_blocks == self.num_blocks:
            return
        rows = num_blocks * self.block_size
        for store in (self.k_rows, self.v_rows):
            for layer, value in enumerate(store):
                if value is not None:
                    store[layer] = None  # the old buffer's last reference goes with the copy
                    store[layer] = (tuple(_resized(p, rows) for p in value) if isinstance(value, tuple)
                                    else _resized(value, rows))
        self.num_blocks = num_blocks
        mx.eval(self.arrays())
        release_free_memory()

    def pages(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's K and V pages ``(kv_heads, num_blocks, block_size, D)`` (views of the stored rows)."""
        return _as_pages(self.k_rows[layer], self.block_size), _as_pages(self.v_rows[layer], self.block_size)

    def _ensure(self, layer: int, heads: int, d_k: int, d_v: int, dtype: mx.Dtype) -> None:
        """Allocate the layer's pages at its first write."""
        if self.k_rows[layer] is None:
            n = self.num_blocks * self.block_size
            self.k_rows[layer] = mx.zeros((1, heads, n, d_k), dtype=dtype)  # (1, H, NB * bs, D_k)
            self.v_rows[layer] = mx.zeros((1, heads, n, d_v), dtype=dtype)  # (1, H, NB * bs, D_v)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Write rows ``k``/``v`` ``(T, kv_heads, D)`` into the flat ``slots`` (int32 ``(T,)``) of a layer
        through ``kv_write`` (the Metal kernel or the reference scatter)."""
        self._ensure(layer, k.shape[1], k.shape[2], v.shape[2], k.dtype)
        kp, vp = self.pages(layer)
        self.k_rows[layer] = self.v_rows[layer] = None  # keep the pages sole-owned while the write is built
        if kp.shape == vp.shape:
            kp, vp = kv_write(kp, vp, slots, k, v)
        else:
            kp, vp = _scatter(kp, slots, k), _scatter(vp, slots, v)
        self.k_rows[layer], self.v_rows[layer] = _as_rows(kp), _as_rows(vp)

    def write_runs(self, layer: int, runs: list[tuple[int, int, int]], k: mx.array, v: mx.array) -> None:
        """Write ``k``/``v`` ``(1, kv_heads, T, D)`` (a cache's own layout) at host-known slot ``runs``
        (:func:`mlxkv.kernels.kv_write_ref.slot_runs`) as static slice updates: the reference write's result
        with a dense append's cost."""
        self._ensure(layer, k.shape[1], k.shape[3], v.shape[3], k.dtype)
        kr, vr = self.k_rows[layer], self.v_rows[layer]
        self.k_rows[layer] = self.v_rows[layer] = None  # sole owner while the write is built (see write)
        self.k_rows[layer], self.v_rows[layer] = write_row_runs(kr, runs, k), write_row_runs(vr, runs, v)

    def copy_blocks(self, copies: list[tuple[int, int, int, int]]) -> None:
        """For each ``(layer, src, dst, num_tokens)``: copy rows ``[0, num_tokens)`` of page ``src`` into page
        ``dst`` of that layer (the CopyOps of one allocation, every layer of a group; one evaluation for all)."""
        bs = self.block_size
        sources = []
        for layer, src, dst, num_tokens in copies:
            if self.k_rows[layer] is None:
                continue  # nothing was ever written in this layer, so the source holds nothing either
            # Materialise the source rows into their own buffers first: a write whose source is a view of the
            # pages (``p[dst] = p[src]``) keeps the pages shared at the write, and MLX then copies the whole pool.
            a = src * bs
            k_rows = self.k_rows[layer][0, :, a:a + num_tokens].transpose(1, 0, 2) + 0  # (num_tokens, H, D_k)
            v_rows = self.v_rows[layer][0, :, a:a + num_tokens].transpose(1, 0, 2) + 0  # (num_tokens, H, D_v)
            sources.append((layer, dst, num_tokens, k_rows, v_rows))
        mx.eval([rows for source in sources for rows in source[3:]])
        for layer, dst, num_tokens, k_rows, v_rows in sources:
            slots = mx.arange(dst * bs, dst * bs + num_tokens, dtype=mx.int32)  # (num_tokens,)
            self.write(layer, slots, k_rows, v_rows)

    def gather(self, layer: int, block_ids: list[int], first: int, length: int,
               runs: list[tuple[int, int]] | None = None) -> tuple[mx.array, mx.array]:
        """Rows ``[first, first + length)`` of the concatenated pages ``block_ids``, as ``(1, kv_heads, length,
        D)`` keys and values. Pages that are consecutive in the pool come back as a zero-copy view, in exactly a
        dense cache's layout; pages in at most ``MAX_CONCAT_RUNS`` runs of consecutive pages as a lazy
        concatenation of those slices; others as a lazy ``mx.take`` (computed if used). The values are the same
        in every case. ``runs``: ``page_runs(block_ids)`` when the caller already has them."""
        if runs is None:
            runs = page_runs(block_ids)
        bs = self.block_size
        out = []
        for rows in (self.k_rows[layer], self.v_rows[layer]):  # (1, H, NB * bs, D)
            if is_view(runs):  # one slice of the rows, exactly a dense cache's read: no copy
                row = runs[0][0] * bs + first
                out.append(rows[:, :, row:row + length])  # (1, H, length, D)
            elif len(runs) <= MAX_CONCAT_RUNS:  # a few slices, copied once into one array
                parts = [rows[:, :, b * bs:(b + n) * bs] for b, n in runs]  # (1, H, n * bs, D) views
                out.append(mx.concatenate(parts, axis=2)[:, :, first:first + length])  # (1, H, length, D)
            else:
                p = mx.take(_as_pages(rows, bs), mx.array(block_ids, dtype=mx.int32), axis=1)  # (H, n, bs, D)
                out.append(p.reshape(1, p.shape[0], -1, p.shape[-1])[:, :, first:first + length])  # (1, H, length, D)
        return out[0], out[1]

    def arrays(self) -> list[mx.array]:
        """Every allocated page array (for ``mx.eval``)."""
        return [a for a in (*self.k_rows, *self.v_rows) if a is not None]

    def nbytes(self) -> int:
        """Bytes of the allocated page arrays (the whole pool share of every layer written so far)."""
        return sum(a.nbytes for a in self.arrays())

    # -- the secondary tier's form (the quantized twin packs its planes into the same two arrays) ----------
    def tier_rows(self, layer: int, block_ids: mx.array) -> list[mx.array]:
        """Blocks ``block_ids`` ``(n,)`` of a layer as ``[k, v]``, each ``(n, bs, kv_heads, D)`` (token-major)."""
        return [pages[:, block_ids].transpose(1, 2, 0, 3) for pages in self.pages(layer)]

    def tier_shapes(self, layer: int) -> list[tuple[int, int, mx.Dtype]]:
        """``(kv_heads, width, dtype)`` of the layer's K and V in :meth:`tier_rows` form."""
        return [(r.shape[1], r.shape[3], r.dtype) for r in (self.k_rows[layer], self.v_rows[layer])]

    def write_tier(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Write rows in :meth:`tier_rows` form, ``(T, kv_heads, width)``, at ``slots``."""
        self.write(layer, slots, k, v)


def is_view(runs: list[tuple[int, int]]) -> bool:
    """Whether pages in ``runs`` (:func:`page_runs`) are one run of real blocks: readable as one slice."""
    return len(runs) == 1 and runs[0][0] != 0


def _resized(rows: mx.array, n: int) -> mx.array:
    """``rows`` ``(1, H, N, w)`` as a new array of ``n`` rows: zero rows appended, or the first ``n`` copied."""
    _, H, N, w = rows.shape
    if n > N:
        return mx.concatenate([rows, mx.zeros((1, H, n - N, w), dtype=rows.dtype)], axis=2)  # (1, H, n, w)
    return mx.contiguous(rows[:, :, :n])  # a copy into its own buffer (the old one is freed with its last view)


def _as_pages(rows: mx.array, block_size: int) -> mx.array:
    """``(1, H, NB * bs, D)`` rows as ``(H, NB, bs, D)`` pages (a reshape of a contiguous array: no copy)."""
    _, H, n, D = rows.shape
    return rows.reshape(H, n // block_size, block_size, D)


def _as_rows(pages: mx.array) -> mx.array:
    """``(H, NB, bs, D)`` pages as ``(1, H, NB * bs, D)`` rows."""
    H, NB, bs, D = pages.shape
    return pages.reshape(1, H, NB * bs, D)
