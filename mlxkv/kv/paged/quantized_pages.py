"""Quantized page arrays: the paged pool's K/V kept in MLX's affine quantization (4 or 8 bits).

Each layer's keys and values are three *planes* apiece, as ``mx.quantize`` makes them: packed values (uint32
words), per-group scales and biases (the activations' dtype), groups of ``group_size`` along head_dim. Every plane
is stored as rows ``(1, kv_heads, num_blocks * block_size, width)``, the memory order of
:class:`~mlxkv.kv.paged.page_arrays.PagedStorage`, so slot ``s`` is row ``s`` of every plane.

A row is quantized once, when it is written (a decode step quantizes its one row; old rows are never
re-quantized), on its own along head_dim — exactly as the dense quantized layouts
(:mod:`mlxkv.kv.layouts.quantized`) quantize it, so the paged pool holds bit-for-bit the values a dense
quantized cache holds and attention over them (``mx.quantized_matmul``,
:func:`mlxkv.kv.layouts.dense_attention.quantized_attend`) matches dense-quantized up to float rounding.
Block copies (copy-on-write of a shared tail) and the secondary tier move the planes as they are.

The secondary tier keeps one array per K and per V (its format's rule): the planes side by side along the last
axis, the packed words reinterpreted (``view``, bit for bit) as the scales' dtype
(:meth:`QuantizedPagedStorage.tier_rows` / :meth:`QuantizedPagedStorage.write_tier`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxkv.kernels.geometry import page_runs
from mlxkv.kernels.kv_write_ref import page_rows, scatter_rows, write_row_runs
from mlxkv.kv.paged.page_arrays import MAX_CONCAT_RUNS, PagedStorage, _as_pages, is_view
from mlxkv.rules import KV_BITS, KV_GROUP_SIZES

Planes = tuple  # (packed uint32, scales, biases), each (..., rows, width)


def quantize_rows(x: mx.array, bits: int, group_size: int) -> Planes:
    """``x`` ``(..., D)`` as ``mx.quantize`` planes (each row on its own, groups along D).

    Raises:
        ValueError: D not divisible by ``group_size`` (one line naming the group sizes that fit).
    """
    D = x.shape[-1]
    if D % group_size:
        fits = [g for g in KV_GROUP_SIZES if D % g == 0]
        hint = (f"use --kv-group-size {' or '.join(map(str, fits))}" if fits else
                f"no valid group size ({', '.join(map(str, KV_GROUP_SIZES))}) divides it, so this model cannot "
                "use a quantized KV cache: run it without --kv-bits")
        raise ValueError(f"--kv-bits: the model's head_dim {D} is not divisible by the KV quantization group size "
                         f"{group_size}; {hint}")
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def quantized_block_bytes(model: Any, block_size: int, bits: int, group_size: int) -> list[int]:
    """Bytes one block of quantized pages takes in each layer (its planes: packed values, scales, biases; 0 for
    recurrent layers), from one probe token through dense caches (as ``backend.probe_block_bytes``).

    Raises:
        ValueError: ``group_size`` does not divide a layer's head_dim."""
    from mlxkv.kv.layouts import LayerCache, make_caches

    caches = make_caches(model)
    model(mx.array([[1]], dtype=mx.uint32), cache=caches)
    out = []
    for c in caches:
        if isinstance(c, LayerCache):
            rows = c.state[:2]  # (1, H, 1, D) each
            out.append(block_size * sum(x.shape[1] * sum(p.nbytes for p in quantize_rows(x[0, 0], bits, group_size))
                                        for x in rows))  # H heads x one row's planes
        else:
            out.append(0)
    return out


class QuantizedPagedStorage(PagedStorage):
    """Per-layer quantized page planes over one block pool (the :class:`PagedStorage` interface).

    ``k_rows[layer]`` / ``v_rows[layer]`` hold plane tuples instead of arrays; :meth:`gather` returns plane
    tuples (mlx-lm's quantized ``update_and_fetch`` form), which the paged layer caches attend with
    ``mx.quantized_matmul``. :meth:`pages` is not available (the paged-attention kernels read unquantized
    pages); :meth:`planes` gives the page-shaped planes.

    Args:
        num_blocks, block_size, num_layers: as :class:`PagedStorage`.
        bits: 4 or 8; group_size: 32, 64 or 128 (must divide head_dim).
    """

    quantized = True

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, *, bits: int, group_size: int):
        if bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS}, got {bits}")
        if group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {group_size}")
        super().__init__(num_blocks, block_size, num_layers)
        self.bits = bits
        self.group_size = group_size

    def encode(self, x: mx.array) -> Planes:
        """Rows ``(..., D)`` as stored (quantized planes)."""
        return quantize_rows(x, self.bits, self.group_size)

    def pages(self, layer: int):
        raise TypeError("quantized pages have no unquantized page arrays: use planes()")

    def planes(self, layer: int) -> tuple[Planes, Planes]:
        """The layer's K and V planes as pages ``(kv_heads, num_blocks, block_size, width)`` (views)."""
        bs = self.block_size
        return (tuple(_as_pages(p, bs) for p in self.k_rows[layer]),
                tuple(_as_pages(p, bs) for p in self.v_rows[layer]))

    def _ensure(self, layer: int, heads: int, d_k: int, d_v: int, dtype: mx.Dtype) -> None:
        if self.k_rows[layer] is None:
            n = self.num_blocks * self.block_size
            for name, d in (("k_rows", d_k), ("v_rows", d_v)):
                probe = self.encode(mx.zeros((1, d), dtype=dtype))  # one row: the planes' widths and dtypes
                getattr(self, name)[layer] = tuple(
                    mx.zeros((1, heads, n, p.shape[-1]), dtype=p.dtype) for p in probe)  # (1, H, NB * bs, w)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Quantize rows ``k``/``v`` ``(T, kv_heads, D)`` and write them into the flat ``slots`` ``(T,)``."""
        self._ensure(layer, k.shape[1], k.shape[2], v.shape[2], k.dtype)
        self.write_planes(layer, slots, self.encode(k), self.encode(v))

    def write_planes(self, layer: int, slots: mx.array, k: Planes, v: Planes) -> None:
        """Write already-quantized rows (planes ``(T, kv_heads, w)``) into the flat ``slots`` (no re-quantization)."""
        for name, new in (("k_rows", k), ("v_rows", v)):
            store = getattr(self, name)
            rows = store[layer]
            store[layer] = None  # sole owner while the scatter is built (PagedStorage.write)
            out = []
            for plane, part in zip(rows, new, strict=True):
                pages = _as_pages(plane, self.block_size)  # (H, NB, bs, w)
                pages = scatter_rows(pages, page_rows(slots, pages.shape), part)
                out.append(pages.reshape(plane.shape))  # (1, H, NB * bs, w)
            store[layer] = tuple(out)

    def write_runs(self, layer: int, runs: list[tuple[int, int, int]], k: mx.array, v: mx.array) -> None:
        """Quantize ``k``/``v`` ``(1, kv_heads, T, D)`` and write them at host-known slot ``runs`` (static slice
        updates of every plane: a decode row is quantized and written alone)."""
        self._ensure(layer, k.shape[1], k.shape[3], v.shape[3], k.dtype)
        for name, new in (("k_rows", self.encode(k)), ("v_rows", self.encode(v))):
            store = getattr(self, name)
            rows = store[layer]
            store[layer] = None
            store[layer] = tuple(write_row_runs(plane, runs, part) for plane, part in zip(rows, new, strict=True))

    def copy_blocks(self, copies: list[tuple[int, int, int, int]]) -> None:
        """As :meth:`PagedStorage.copy_blocks`: the rows' planes are copied as stored."""
        bs = self.block_size
        sources = []
        for layer, src, dst, num_tokens in copies:
            if self.k_rows[layer] is None:
                continue
            a = src * bs
            k = tuple(p[0, :, a:a + num_tokens].transpose(1, 0, 2) + 0 for p in self.k_rows[layer])  # (n, H, w)
            v = tuple(p[0, :, a:a + num_tokens].transpose(1, 0, 2) + 0 for p in self.v_rows[layer])
            sources.append((layer, dst, num_tokens, k, v))
        mx.eval([p for source in sources for planes in source[3:] for p in planes])
        for layer, dst, num_tokens, k, v in sources:
            self.write_planes(layer, mx.arange(dst * bs, dst * bs + num_tokens, dtype=mx.int32), k, v)

    def gather(self, layer: int, block_ids: list[int], first: int, length: int,
               runs: list[tuple[int, int]] | None = None) -> tuple[Planes, Planes]:
        """As :meth:`PagedStorage.gather`, plane by plane: ``(k_planes, v_planes)``, each plane ``(1, kv_heads,
        length, w)`` (a zero-copy view when the pages are consecutive)."""
        if runs is None:
            runs = page_runs(block_ids)
        bs = self.block_size
        out = []
        for planes in (self.k_rows[layer], self.v_rows[layer]):
            parts = []
            for rows in planes:  # (1, H, NB * bs, w)
                if is_view(runs):
                    row = runs[0][0] * bs + first
                    parts.append(rows[:, :, row:row + length])  # (1, H, length, w)
                elif len(runs) <= MAX_CONCAT_RUNS:
                    pieces = [rows[:, :, b * bs:(b + n) * bs] for b, n in runs]
                    parts.append(mx.concatenate(pieces, axis=2)[:, :, first:first + length])
                else:
                    p = mx.take(_as_pages(rows, bs), mx.array(block_ids, dtype=mx.int32), axis=1)  # (H, n, bs, w)
                    parts.append(p.reshape(1, p.shape[0], -1, p.shape[-1])[:, :, first:first + length])
            out.append(tuple(parts))
        return out[0], out[1]

    def arrays(self) -> list[mx.array]:
        return [p for planes in (*self.k_rows, *self.v_rows) if planes is not None for p in planes]

    # -- the secondary tier's form: one array per K and per V --------------------------------------------
    def tier_rows(self, layer: int, block_ids: mx.array) -> list[mx.array]:
        """Blocks ``block_ids`` ``(n,)`` of a layer as ``[k, v]``, each ``(n, bs, kv_heads, W)``: the packed words
        (viewed as the scales' dtype), scales and biases side by side."""
        out = []
        for planes in self.planes(layer):
            packed, scales, biases = (p[:, block_ids].transpose(1, 2, 0, 3) for p in planes)  # (n, bs, H, w)
            out.append(mx.concatenate([mx.contiguous(packed).view(scales.dtype), scales, biases], axis=-1))
        return out

    def tier_shapes(self, layer: int) -> list[tuple[int, int, mx.Dtype]]:
        """``(kv_heads, W, dtype)`` of the layer's K and V in :meth:`tier_rows` form (the layout the tier checks)."""
        out = []
        for planes in (self.k_rows[layer], self.v_rows[layer]):
            packed, scales, biases = planes
            view = packed.shape[-1] * packed.dtype.size // scales.dtype.size
            out.append((packed.shape[1], view + scales.shape[-1] + biases.shape[-1], scales.dtype))
        return out

    def _head_dim(self, rows: mx.array) -> int:
        """head_dim of rows in tier form ``(T, H, W)``: ``W = D * (bits / 8 / itemsize + 2 / group_size)``.

        Raises:
            ValueError: no head_dim gives this width (the rows were not written with these bits / groups)."""
        W, size, g = rows.shape[-1], rows.dtype.size, self.group_size
        D = round(W * 8 * size * g / (self.bits * g + 16 * size))
        if D <= 0 or D % g or D * self.bits // (8 * size) + 2 * D // g != W:
            raise ValueError(f"tier rows of width {W} are not {self.bits}-bit K/V in groups of {g}")
        return D

    def write_tier(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Write rows in :meth:`tier_rows` form, ``(T, kv_heads, W)``, at ``slots`` (their planes as they are)."""
        if self.k_rows[layer] is None:  # a restore into a layer this process has not written yet
            self._ensure(layer, k.shape[1], self._head_dim(k), self._head_dim(v), k.dtype)
        decoded = []
        for rows, planes in zip((k, v), (self.k_rows[layer], self.v_rows[layer]), strict=True):
            packed, scales, _ = planes
            view = packed.shape[-1] * packed.dtype.size // scales.dtype.size
            g = scales.shape[-1]
            rows = rows.astype(scales.dtype) if rows.dtype != scales.dtype else rows
            decoded.append((mx.contiguous(rows[..., :view]).view(packed.dtype), rows[..., view:view + g],
                            rows[..., view + g:]))  # (T, H, w) each
        self.write_planes(layer, slots, *decoded)
