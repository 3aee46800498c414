"""One entry point per kernel: Metal when available and self-checked, else the pure-MLX reference.

``MLXKV_PAGED_KERNEL`` (:func:`mlxkv.env.paged_kernel`) decides:

- ``reference``: always the reference.
- ``auto`` (default): on a Metal device, the first call at each new shape class (dtype, head
  dim, block size, kv heads, GQA ratio, window and chunk size, sinks present) runs the kernel against the
  reference on small random inputs with the per-dtype tolerance; on a mismatch (or an exception)
  it warns once and that shape class uses the reference from then on. Without Metal, or for a
  configuration the kernel does not cover, the reference.
- ``metal``: the kernel, self-checked the same way; a mismatch, an uncovered configuration or a
  machine without Metal raises ``RuntimeError`` instead of falling back.

KV writes use MLX's scatter in every mode: a custom Metal kernel cannot write into its input
buffer, so it would rewrite the whole pool, while the scatter is O(rows) when the pool is donated
(see :mod:`mlxkv.kernels.kv_write_ref`).

Quantized KV pages (``--kv-bits``, :mod:`mlxkv.kv.paged.quantized_pages`) go through
:meth:`KernelDispatch.quantized_paged_attention`: a Metal variant (the decode body with the row read of
``paged_attention_quantized.metal``) reads the packed planes and dequantizes in-kernel, chosen and self-checked exactly as above per
:class:`QuantizedAttentionClass` (the shape class plus bits and group size) against
:mod:`mlxkv.kernels.quantized_paged_ref`. The paged layer caches and batch views call it only where the kernel may
run (``metal`` mode, or ``auto`` on a Metal device); elsewhere they attend the planes on the pure-MLX path with
``mx.quantized_matmul``. The quantized variant has been checked by the static check and the CPU emulator only.

``with_mass=True`` (both entry points) also returns the attention mass per cached position that the heavy-hitter
KV-overflow policies rank by (:mod:`mlxkv.kernels.paged_mass_ref`): the Metal mass variants (the decode kernel
writing its logits, then ``paged_mass.metal``) are chosen and self-checked as above under their own shape class
(``AttentionClass.mass``), comparing output and mass; checked by the static check and the CPU emulator only.

The factories and the Metal probe are constructor arguments of :class:`KernelDispatch`, so tests
inject a deliberately wrong kernel and pretend Metal is present to exercise the fallback on CPU.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from mlxkv import env

from . import metal, metal_quantized
from .cascade import PrefixGroup, cascade_attention
from .geometry import check_paged_inputs, check_table_contents
from .kv_write_ref import check_kv_write_inputs, kv_write_reference
from .paged_attention_ref import REFERENCE, run_paged_attention
from .quantized_paged_ref import (
    Planes,
    ReferenceQuantizedPagedAttention,
    check_quantized_inputs,
    run_quantized_paged_attention,
)
from .selfcheck import check_attention_impl, check_quantized_attention_impl


@dataclass(frozen=True, slots=True)
class AttentionClass:
    """What a compiled attention kernel and its self-check depend on."""

    dtype: mx.Dtype
    head_dim: int
    block_size: int
    kv_heads: int
    gqa: int
    window: int | None
    chunk_size: int | None
    sinks: bool
    mass: bool = False  # the attention-mass variant (its own kernel and self-check)


@dataclass(frozen=True, slots=True)
class QuantizedAttentionClass:
    """What the quantized-pages kernel and its self-check depend on: the shape class and the quantization."""

    attention: AttentionClass
    bits: int
    group_size: int


class KernelDispatch:
    """Chooses and caches the implementation per shape class; not thread-safe (engine-owned).

    Args:
        attention_factory: ``(dtype, head_dim, block_size, kv_heads, gqa) -> impl | None``.
        quantized_attention_factory: ``(dtype, head_dim, block_size, kv_heads, gqa, bits, group_size) -> impl |
            None`` (quantized pages).
        metal_available: ``() -> bool``.
        mode: ``() -> "auto" | "metal" | "reference"``.
    """

    def __init__(
        self,
        *,
        attention_factory: Callable = metal.paged_attention_kernel,
        quantized_attention_factory: Callable = metal_quantized.quantized_paged_attention_kernel,
        metal_available: Callable[[], bool] = mx.metal.is_available,
        mode: Callable[[], str] = lambda: env.flags().paged_kernel,
    ):
        self.attention_factory = attention_factory
        self.quantized_attention_factory = quantized_attention_factory
        self.metal_available = metal_available
        self.mode = mode
        self._attention: dict[tuple[str, AttentionClass], object] = {}
        # The last (block_tables, context_lens, num_blocks) checked: the layers of one step share the arrays.
        self._checked: tuple[mx.array, mx.array, int] | None = None

    # -- choice ---------------------------------------------------------------------------
    def _require_metal(self, what: str) -> None:
        if not self.metal_available():
            raise RuntimeError(
                f"MLXKV_PAGED_KERNEL=metal but Metal is not available on this machine ({what}); "
                "use MLXKV_PAGED_KERNEL=auto or reference"
            )

    def attention_impl(self, cls: AttentionClass):
        """The implementation for one shape class (chosen, self-checked and cached on first use)."""
        mode = self.mode()
        if mode == "reference":
            return REFERENCE
        key = (mode, cls)
        if key not in self._attention:
            self._attention[key] = self._choose_attention(mode, cls)
        return self._attention[key]

    def _choose_attention(self, mode: str, cls: AttentionClass):
        return self._choose(
            mode, cls, "paged-attention", REFERENCE,
            lambda: self.attention_factory(cls.dtype, cls.head_dim, cls.block_size, cls.kv_heads, cls.gqa),
            lambda impl: check_attention_impl(
                impl, dtype=cls.dtype, head_dim=cls.head_dim, block_size=cls.block_size,
                kv_heads=cls.kv_heads, gqa=cls.gqa, window=cls.window, chunk_size=cls.chunk_size,
                sinks=cls.sinks, mass=cls.mass,
            ),
        )

    def quantized_attention_impl(self, qcls: QuantizedAttentionClass):
        """The implementation for one quantized shape class (chosen, self-checked and cached on first use)."""
        mode = self.mode()
        reference = ReferenceQuantizedPagedAttention(qcls.bits, qcls.group_size)
        if mode == "reference":
            return reference
        key = (mode, qcls)
        if key not in self._attention:
            cls = qcls.attention
            self._attention[key] = self._choose(
                mode, qcls, "quantized paged-attention", reference,
                lambda: self.quantized_attention_factory(cls.dtype, cls.head_dim, cls.block_size, cls.kv_heads,
                                                         cls.gqa, qcls.bits, qcls.group_size),
                lambda impl: check_quantized_attention_impl(
                    impl, dtype=cls.dtype, head_dim=cls.head_dim, block_size=cls.block_size,
                    kv_heads=cls.kv_heads, gqa=cls.gqa, bits=qcls.bits, group_size=qcls.group_size,
                    window=cls.window, chunk_size=cls.chunk_size, sinks=cls.sinks, mass=cls.mass,
                ),
            )
        return self._attention[key]

    def _choose(self, mode: str, cls, what: str, reference, build: Callable, check: Callable):
        """The kernel ``build()`` returns if it passes ``check``; else ``reference`` (auto, with a warning on a
        mismatch) or ``RuntimeError`` (metal)."""
        if mode == "metal":
            self._require_metal(what.replace("-", " "))
        elif not self.metal_available():
            return reference
        impl = build()
        if impl is None:
            if mode == "metal":
                raise RuntimeError(f"MLXKV_PAGED_KERNEL=metal: no Metal {what} kernel for {cls}")
            return reference
        ok, err = check(impl)
        if ok:
            return impl
        message = f"Metal {what} kernel disagrees with the reference for {cls} (max abs error {err:.3g})"
        if mode == "metal":
            raise RuntimeError(message)
        warnings.warn(message + "; using the pure-MLX reference for this shape class", RuntimeWarning, stacklevel=5)
        return reference

    def reference_on_views(self) -> bool:
        """Whether a decode step over *physically consecutive* pages should run dense SDPA on a zero-copy
        view of them instead of the paged kernel: true where the kernel would be the pure-MLX reference
        (``reference`` mode, or ``auto`` without Metal), which could only copy those rows first."""
        mode = self.mode()
        return mode == "reference" or (mode == "auto" and not self.metal_available())

    # -- entry points ---------------------------------------------------------------------
    def paged_attention(
        self,
        queries: mx.array,
        k_pages: mx.array,
        v_pages: mx.array,
        block_tables: mx.array,
        context_lens: mx.array,
        *,
        scale: float | None = None,
        window: int | None = None,
        chunk_size: int | None = None,
        sinks: mx.array | None = None,
        num_splits: int | None = None,
        max_context_len: int | None = None,
        prefix_groups: list[PrefixGroup] | None = None,
        with_mass: bool = False,
        host_checked: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """Paged decode attention (arguments as ``paged_attention_reference``).

        ``with_mass``: ``(out, mass)``, mass the attention mass per cached position ``(B, kv_heads,
        max_blocks_per_seq * block_size)`` float32 (:mod:`mlxkv.kernels.paged_mass_ref`) for the heavy-hitter
        KV-overflow policies: the Metal mass variant where its own self-check passed, else the reference. Off by
        default: without it the same kernels run as before. It runs the flat path (no cascade: the mass is per
        sequence, and the cascade's shared-prefix pass attends for several sequences at once).

        Raises ``ValueError`` for a table entry outside the pool or a context longer than its table
        row (checked once per distinct pair of table arrays, so the layers of a step pay one sync).
        ``host_checked``: the caller built ``block_tables`` and ``context_lens`` from host lists it checked
        against this pool (:func:`~mlxkv.kernels.geometry.check_host_tables`; the paged caches' per-step
        metadata does): no device check, no sync.

        ``prefix_groups`` (computed once per step for all layers, see
        :func:`~mlxkv.kernels.cascade.worth_cascading`): sequences sharing those whole-page
        prefixes go through cascade attention (full-attention layers only).
        """
        B, H, D, bs, kv_heads, gqa = check_paged_inputs(
            queries, k_pages, v_pages, block_tables, context_lens, window, chunk_size, sinks
        )
        if not host_checked:
            self._check_tables(block_tables, context_lens, k_pages.shape[1], bs)

        def impl_for(g: int):
            if queries.dtype != k_pages.dtype:  # the kernel reads both as one type T
                return REFERENCE
            return self.attention_impl(
                AttentionClass(k_pages.dtype, D, bs, kv_heads, g, window, chunk_size, sinks is not None, with_mass)
            )

        if prefix_groups and window is None and chunk_size is None and not with_mass:
            return cascade_attention(
                impl_for, queries, k_pages, v_pages, block_tables, context_lens, prefix_groups,
                scale=scale, sinks=sinks, num_splits=num_splits,
            )
        return run_paged_attention(
            impl_for(gqa), queries, k_pages, v_pages, block_tables, context_lens,
            scale=scale, window=window, chunk_size=chunk_size, sinks=sinks,
            num_splits=num_splits, max_context_len=max_context_len, with_mass=with_mass,
        )

    def quantized_paged_attention(
        self,
        queries: mx.array,
        k_planes: Planes,
        v_planes: Planes,
        block_tables: mx.array,
        context_lens: mx.array,
        *,
        bits: int,
        group_size: int,
        host_checked: bool = False,
        **options,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """Paged decode attention over quantized pages (arguments, and the keyword ``options`` scale, window,
        chunk_size, sinks, num_splits, max_context_len and with_mass, as
        :func:`~mlxkv.kernels.quantized_paged_ref.quantized_paged_attention_reference`; ``with_mass`` as in
        :meth:`paged_attention`).

        Raises ``ValueError`` for planes that do not follow the layout, a table entry outside the pool or a
        context longer than its table row (``host_checked`` as in :meth:`paged_attention`)."""
        D = check_quantized_inputs(queries, k_planes, v_planes, bits=bits, group_size=group_size)
        KVH, num_blocks, bs, _ = k_planes[1].shape
        if not host_checked:
            self._check_tables(block_tables, context_lens, num_blocks, bs)
        dtype = k_planes[1].dtype  # the scales' dtype: the activations' (the kernel reads queries as it)
        if queries.dtype != dtype or queries.shape[1] % KVH:
            impl = ReferenceQuantizedPagedAttention(bits, group_size)
        else:
            cls = AttentionClass(dtype, D, bs, KVH, queries.shape[1] // KVH, options.get("window"),
                                 options.get("chunk_size"), options.get("sinks") is not None,
                                 bool(options.get("with_mass")))
            impl = self.quantized_attention_impl(QuantizedAttentionClass(cls, bits, group_size))
        return run_quantized_paged_attention(
            impl, queries, k_planes, v_planes, block_tables, context_lens, bits=bits, group_size=group_size,
            **options)

    def _check_tables(self, block_tables: mx.array, context_lens: mx.array, num_blocks: int, bs: int) -> None:
        """Refuse inconsistent tables before any launch, once per distinct pair of arrays (one sync a step)."""
        last = self._checked
        if last is not None and last[0] is block_tables and last[1] is context_lens and last[2] == num_blocks:
            return
        check_table_contents(block_tables, context_lens, num_blocks, bs)
        self._checked = (block_tables, context_lens, num_blocks)

    def kv_write(
        self, k_pages: mx.array, v_pages: mx.array, slot_mapping: mx.array, k_new: mx.array, v_new: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write new rows into their page slots (arguments and ownership rule as ``kv_write_reference``)."""
        check_kv_write_inputs(k_pages, v_pages, slot_mapping, k_new, v_new)
        return kv_write_reference(k_pages, v_pages, slot_mapping, k_new, v_new)


DEFAULT_DISPATCH = KernelDispatch()


def paged_attention(*args, **kwargs) -> mx.array | tuple[mx.array, mx.array]:
    """:meth:`KernelDispatch.paged_attention` on the process-wide dispatcher (``with_mass=True``: ``(out, mass)``)."""
    return DEFAULT_DISPATCH.paged_attention(*args, **kwargs)


def quantized_paged_attention(*args, **kwargs) -> mx.array | tuple[mx.array, mx.array]:
    """:meth:`KernelDispatch.quantized_paged_attention` on the process-wide dispatcher (``with_mass=True``: ``(out,
    mass)``)."""
    return DEFAULT_DISPATCH.quantized_paged_attention(*args, **kwargs)


def reference_on_views() -> bool:
    """:meth:`KernelDispatch.reference_on_views` on the process-wide dispatcher."""
    return DEFAULT_DISPATCH.reference_on_views()


def kv_write(*args, **kwargs) -> tuple[mx.array, mx.array]:
    """:meth:`KernelDispatch.kv_write` on the process-wide dispatcher."""
    return DEFAULT_DISPATCH.kv_write(*args, **kwargs)
