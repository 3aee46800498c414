"""Every launch the Metal factories can emit, as the checks see it: one ``KernelCall`` per variant.

The variants are read from the factories' own tables (:data:`metal.SUPPORTED_DTYPES`,
:data:`metal.HEAD_DIMS`, :data:`metal.BLOCK_SIZES`, :func:`metal.max_gqa`,
:func:`metal.simdgroups_for`) and built by the factories' own ``*_call`` methods on zero inputs,
so a configuration the factories accept cannot skip the static check, the emulator or the Mac
report (``scripts/check_kernels.py``).

What distinguishes two launches to a compiler is the rendered signature: the element types, the
template values and, per input, the address space MLX picks (``constant`` below 8 elements, so
``context_lens`` and ``sinks`` switch space at batch / heads >= 8). Runtime parameters (window,
chunk, split count, the cascade's stacked heads) change no signature; they are covered by the
emulator and self-check cases. Integer template values enter the C++ only as loop bounds and array
sizes, so each axis is checked at its extremes and at the values that change the simdgroup count.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import metal, metal_quantized
from .geometry import plan_splits
from .metal_specs import MAX_CONSTANT_ARRAY_SIZE, ArgInfo, KernelSpec

# Batch sizes that put context_lens / block_tables in the constant and in the device address space.
BATCHES = (1, MAX_CONSTANT_ARRAY_SIZE)


@dataclass(frozen=True, slots=True)
class Variant:
    """One launch configuration: a readable label and the factory-built call (zero inputs)."""

    label: str
    call: metal.KernelCall

    @property
    def spec(self) -> KernelSpec:
        return self.call.spec

    def arg_infos(self) -> dict[str, ArgInfo]:
        """How MLX passes each input of this launch (element type, address space)."""
        return {name: ArgInfo.of(a) for name, a in self.call.inputs.items()}

    def signature_key(self) -> tuple:
        """What the rendered signature depends on (two variants with one key compile identically)."""
        infos = self.arg_infos()
        return (self.spec.name, tuple(sorted((n, i.dtype, i.space) for n, i in infos.items())),
                tuple(sorted((n, str(v)) for n, v in self.call.template.items())))


def gqa_values(head_dim: int) -> list[int]:
    """GQA ratios checked at ``head_dim``: 1, 2, the largest, and the first at each (head tile,
    simdgroup count) the factory picks."""
    top = metal.max_gqa(head_dim)
    chosen = {1, min(2, top), top}
    seen: set[tuple[int, int]] = set()
    for g in range(1, top + 1):
        ht = metal.heads_per_threadgroup(g, head_dim)
        shape = (ht, metal.simdgroups_for(ht, head_dim))
        if shape not in seen:
            seen.add(shape)
            chosen.add(g)
    return sorted(chosen)


def block_size_values() -> list[int]:
    """Block sizes checked: the smallest, 16 (the default) and the largest the factory accepts."""
    sizes = metal.BLOCK_SIZES
    return sorted({sizes[0], 16 if 16 in sizes else sizes[0], sizes[-1]})


def _zeros(shape, dtype) -> mx.array:
    return mx.zeros(shape, dtype=dtype)


def attention_variants(batches: tuple[int, ...] = BATCHES, scores: bool = False) -> list[Variant]:
    """Every (dtype, head_dim, block size, GQA, batch) attention partials launch. ``scores``: the attention-mass
    variants instead, at the default block size only (their one extra line, the score write, indexes with BS as
    the position stride, an expression the other sizes share with the body)."""
    out = []
    kv_heads = 2
    for dtype in metal.SUPPORTED_DTYPES:
        for D in metal.HEAD_DIMS:
            for bs in ([16] if scores else block_size_values()):
                for g in gqa_values(D):
                    assert metal.supports_attention(dtype, D, bs, g)
                    impl = metal.MetalPagedAttention(dtype, D, bs, kv_heads, g)
                    for B in batches:
                        pages = 3
                        call = impl.partials_call(
                            _zeros((B, kv_heads * g, 1, D), dtype),
                            _zeros((kv_heads, B * pages + 1, bs, D), dtype),
                            _zeros((kv_heads, B * pages + 1, bs, D), dtype),
                            _zeros((B, pages), mx.int32), _zeros((B,), mx.int32),
                            plan_splits(pages * bs, bs, num_splits=2),
                            scale=D**-0.5, window=None, chunk_size=None, scores=scores,
                        )
                        nsg = call.template["NSG"]
                        kind = "attention+scores" if scores else "attention"
                        out.append(Variant(f"{kind} {dtype} D={D} bs={bs} gqa={g} B={B} nsg={nsg}", call))
    return out


def quantized_attention_variants(batches: tuple[int, ...] = BATCHES, scores: bool = False) -> list[Variant]:
    """Every (bits, group size, head_dim) quantized-pages launch, the dtypes taking turns, at GQA 1 and the largest,
    both ``context_lens`` address spaces; block sizes at their extremes at the default head_dim 64. The quantized body
    differs from the unquantized one only in its K/V reads, whose shape depends on D, BITS and GS. ``scores``: the
    attention-mass variants, at the default block size only (as in :func:`attention_variants`)."""
    out = []
    kv_heads, pages = 2, 3
    combos = [(D, gs, bits) for D in metal.HEAD_DIMS for gs in metal_quantized.QUANTIZED_GROUP_SIZES
              if D % gs == 0 for bits in metal_quantized.QUANTIZED_BITS]
    for n, (D, gs, bits) in enumerate(combos):
        dtype = metal.SUPPORTED_DTYPES[n % len(metal.SUPPORTED_DTYPES)]
        sizes = block_size_values() if D == 64 and not scores else [16]
        for bs in sizes:
            for g in sorted({1, metal.max_gqa(D)}):
                assert metal_quantized.supports_quantized_attention(dtype, D, bs, g, bits, gs)
                impl = metal_quantized.MetalQuantizedPagedAttention(dtype, D, bs, kv_heads, g, bits, gs)
                for B in batches:
                    shape = (kv_heads, B * pages + 1, bs)
                    planes = (_zeros((*shape, D * bits // 32), mx.uint32), _zeros((*shape, D // gs), dtype),
                              _zeros((*shape, D // gs), dtype))
                    call = impl.partials_call(
                        _zeros((B, kv_heads * g, 1, D), dtype), planes, planes,
                        _zeros((B, pages), mx.int32), _zeros((B,), mx.int32),
                        plan_splits(pages * bs, bs, num_splits=2), scale=D**-0.5, window=None, chunk_size=None,
                        scores=scores,
                    )
                    label = f"quantized{'+scores' if scores else ''} {dtype} D={D} bits={bits} gs={gs} bs={bs} gqa={g} B={B} nsg={call.template['NSG']}"
                    out.append(Variant(label, call))
    return out


def merge_variants() -> list[Variant]:
    """Every (dtype, head_dim, sinks, heads) merge launch; small heads put sinks and lse in constant space."""
    out = []
    impl = metal.MetalPagedAttention(mx.float32, 64, 16, 1, 1)  # merge_call depends on its arguments only
    for dtype in metal.SUPPORTED_DTYPES:
        for D in metal.HEAD_DIMS:
            for H in (2, MAX_CONSTANT_ARRAY_SIZE):
                for sinks in (False, True):
                    S = 2
                    call = impl.merge_call(_zeros((1, H, S, D), mx.float32), _zeros((1, H, S), mx.float32),
                                           _zeros((H,), dtype) if sinks else None, dtype)
                    out.append(Variant(f"merge {dtype} D={D} H={H} sinks={sinks}", call))
    return out


def mass_pass_variants() -> list[Variant]:
    """Every (GQA, sinks, batch) launch of the mass pass (``paged_mass.metal``): ``sinks`` in constant (2 heads)
    and device memory (8 heads), ``context_lens`` and ``lse`` in both (batch 1 and 8)."""
    out = []
    kv_heads, pages, bs, S = 2, 3, 16, 2
    for g in (1, 4):
        impl = metal.MetalPagedAttention(mx.float32, 64, bs, kv_heads, g)  # mass_call reads kv_heads only
        H = kv_heads * g
        for sinks in (False, True):
            for B in BATCHES:
                call = impl.mass_call(_zeros((B, H, pages * bs), mx.float32), _zeros((B, H, S), mx.float32),
                                      _zeros((H,), mx.float32) if sinks else None, _zeros((B,), mx.int32),
                                      kv_heads=kv_heads, window=None, chunk_size=None)
                out.append(Variant(f"mass H={H} gqa={g} sinks={sinks} B={B}", call))
    return out


def all_variants() -> list[Variant]:
    """Every variant of every kernel, in spec order."""
    return (attention_variants() + merge_variants() + quantized_attention_variants()
            + attention_variants(scores=True) + quantized_attention_variants(scores=True) + mass_pass_variants())


def emulation_classes() -> list[Variant]:
    """The attention variants the CPU emulator runs (all of them would take minutes): the cheapest per
    (lanes per key, head tiling, ``context_lens`` address space), the dtypes taking turns so that every
    dtype meets every lanes-per-key value. The emulated C++ of one class differs only in loop bounds
    and array sizes."""
    every = attention_variants()
    keys = sorted({_class_key(v) for v in every})
    dtypes = metal.SUPPORTED_DTYPES
    chosen = []
    for lpk in sorted({k[0] for k in keys}):
        for n, key in enumerate(k for k in keys if k[0] == lpk):
            dtype = dtypes[n % len(dtypes)]
            members = [v for v in every if _class_key(v) == key and v.call.template["T"] == dtype]
            chosen.append(min(members, key=_cost))
    return chosen


def _class_key(v: Variant) -> tuple:
    t = v.call.template
    return t["LPK"], t["HT"] < t["G"], v.arg_infos()["context_lens"].space


def _cost(v: Variant) -> int:
    """Emulation work: row elements x heads x block size x threadgroups per kv head, squared."""
    t = v.call.template
    return t["D"] * t["HT"] * t["BS"] * (t["G"] // t["HT"]) ** 2
