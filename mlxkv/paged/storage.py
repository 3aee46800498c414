"""Page arrays: the K/V storage every paged sequence of one model shares.

One pair of page arrays per attention layer, ``[kv_heads, num_blocks, block_size, head_dim]``, indexed by the
block ids of :mod:`mlxkv.blocks` (block 0 is the null block, never read unmasked). A layer's arrays are
allocated at its first write, from that write's kv_heads / head_dim / dtype, so models whose keys and values
differ in width (MLA caches a latent and a rope key) work too.

Ownership: this object is the only holder of each page array, and rebinds it to every write's result, so a
decode write is O(rows) (MLX donates the buffer) — see :mod:`mlxkv.kernels.kv_write_ref`.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.kernels import kv_write
from mlxkv.kernels.kv_write_ref import page_rows, scatter_rows


def _scatter(pages: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """Write ``rows`` ``(T, H, D)`` into flat ``slots`` of ``pages`` (for K/V pairs of unequal shapes)."""
    return scatter_rows(pages, page_rows(slots, pages.shape), rows)


class PagedStorage:
    """Per-layer page arrays over one block pool.

    Args:
        num_blocks: pages per layer (the null block included), the manager's pool size.
        block_size: token rows per page.
        num_layers: model layers (recurrent layers simply never write).
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys: list[mx.array | None] = [None] * num_layers  # (kv_heads, num_blocks, bs, D_k) once written
        self.values: list[mx.array | None] = [None] * num_layers

    def allocated(self, layer: int) -> bool:
        return self.keys[layer] is not None

    def _ensure(self, layer: int, k: mx.array, v: mx.array) -> None:
        if self.keys[layer] is None:
            NB, bs = self.num_blocks, self.block_size
            self.keys[layer] = mx.zeros((k.shape[1], NB, bs, k.shape[2]), dtype=k.dtype)  # (H, NB, bs, D_k)
            self.values[layer] = mx.zeros((v.shape[1], NB, bs, v.shape[2]), dtype=v.dtype)  # (H, NB, bs, D_v)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Write rows ``k``/``v`` ``(T, kv_heads, D)`` into the flat ``slots`` (int32 ``(T,)``) of a layer."""
        self._ensure(layer, k, v)
        kp, vp = self.keys[layer], self.values[layer]
        self.keys[layer] = self.values[layer] = None  # keep the pages sole-owned while the write is built
        if kp.shape == vp.shape:
            kp, vp = kv_write(kp, vp, slots, k, v)
        else:
            kp, vp = _scatter(kp, slots, k), _scatter(vp, slots, v)
        self.keys[layer], self.values[layer] = kp, vp

    def copy_block(self, layer: int, src: int, dst: int, num_tokens: int) -> None:
        """Copy rows ``[0, num_tokens)`` of page ``src`` into page ``dst`` (a CopyOp, for one layer)."""
        if self.keys[layer] is None:
            return  # nothing was ever written in this layer, so the source holds nothing either
        # Materialise the source rows into their own buffers first: a write whose source is a view of the
        # pages (``p[dst] = p[src]``) keeps the pages shared at the write, and MLX then copies the whole pool.
        k_rows = self.keys[layer][:, src, :num_tokens].transpose(1, 0, 2) + 0  # (num_tokens, H, D_k), a new buffer
        v_rows = self.values[layer][:, src, :num_tokens].transpose(1, 0, 2) + 0  # (num_tokens, H, D_v)
        mx.eval(k_rows, v_rows)
        first = dst * self.block_size
        slots = mx.arange(first, first + num_tokens, dtype=mx.int32)  # (num_tokens,)
        self.write(layer, slots, k_rows, v_rows)

    def gather(self, layer: int, block_ids: list[int], first: int, length: int,
               start: int | None = -1) -> tuple[mx.array, mx.array]:
        """Rows ``[first, first + length)`` of the concatenated pages ``block_ids``, as ``(1, kv_heads, length,
        D)`` keys and values. Pages that are consecutive in the pool (:func:`consecutive`) come back as a
        zero-copy view, in exactly a dense cache's layout; others as a lazy ``mx.take`` (computed if used).
        ``start``: ``consecutive(block_ids)`` when the caller already knows it."""
        if start == -1:
            start = consecutive(block_ids)
        out = []
        for pages in (self.keys, self.values):
            p = pages[layer]  # (H, NB, bs, D)
            if start is not None:
                p = p[:, start:start + len(block_ids)]  # (H, n, bs, D): a slice, no copy
            else:
                p = mx.take(p, mx.array(block_ids, dtype=mx.int32), axis=1)  # (H, n, bs, D)
            p = p.reshape(p.shape[0], -1, p.shape[-1])[:, first:first + length]  # (H, length, D)
            out.append(p[None])  # (1, H, length, D)
        return out[0], out[1]

    def arrays(self) -> list[mx.array]:
        """Every allocated page array (for ``mx.eval``)."""
        return [a for a in (*self.keys, *self.values) if a is not None]

    def nbytes(self) -> int:
        """Bytes of the allocated page arrays (the whole pool share of every layer written so far)."""
        return sum(a.nbytes for a in self.arrays())


def consecutive(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` are consecutive ascending real blocks (``b, b+1, ...``), else None."""
    if not block_ids or block_ids[0] == 0:
        return None
    first = block_ids[0]
    return first if block_ids == list(range(first, first + len(block_ids))) else None
