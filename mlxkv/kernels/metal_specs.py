"""What each Metal kernel looks like to ``mx.fast.metal_kernel``: names, sources, signatures.

One :class:`KernelSpec` per kernel over the body-only sources in ``metal_kernels/``; the two decode kernels
share one body and differ in their K/V row read (:func:`with_kv_read`, so they cannot drift apart). The factories in
:mod:`mlxkv.kernels.metal` build kernels from these specs, and :func:`render_kernel` writes the
full source MLX would compile (generated signature + body), which the C++ syntax test feeds to
``g++ -fsyntax-only`` through a shim header because no Metal compiler exists off macOS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

# MLX passes inputs with fewer elements than this in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# Type names MLX's generated signature uses (mlx get_type_string).
TYPE_NAMES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.bool_: "bool",
}

# Thread-position attributes MLX adds to the signature when the body mentions them.
METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint",
    "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3",
    "grid_origin": "uint3",
    "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint",
    "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """A body-only kernel: its MLX name, source file, argument names and template parameters."""

    name: str  # mx.fast.metal_kernel name
    source_file: str  # in metal_kernels/
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    template_params: tuple[tuple[str, str], ...]  # (name, "typename" | "int" | "bool"), in order
    # In metal_kernels/: the K/V row read that replaces the body's KV_ROW_READ line (kernels sharing one body).
    kv_read_file: str | None = None
    # In metal_kernels/: the score write that replaces the body's SCORE_WRITE line (the attention-mass variants);
    # None deletes that line, so a variant built without mass is the body exactly as it is without the line.
    score_write_file: str | None = None

    def source(self, texts: dict[str, str] | None = None) -> str:
        """The body text with this kernel's K/V row read and score write (or none) in place; ``texts`` maps a
        file name of this kernel to the text to use instead of the shipped one (the static check of a file)."""
        texts = texts or {}

        def text(name: str) -> str:
            return texts[name] if name in texts else read_source(name)

        body = text(self.source_file)
        if self.kv_read_file is not None:
            body = with_kv_read(body, text(self.kv_read_file))
        if SCORE_WRITE in body:  # the decode body: the mass variant's write, or nothing
            body = with_line(body, SCORE_WRITE, "" if self.score_write_file is None else text(self.score_write_file))
        return body

    def files(self) -> tuple[str, ...]:
        """The ``metal_kernels/`` files this kernel's source is generated from."""
        return tuple(f for f in (self.source_file, self.kv_read_file, self.score_write_file) if f is not None)


# The line of a shared body that stands for the K/V row read (see paged_attention.metal).
KV_ROW_READ = "MLXKV_KV_ROW_READ"
# The line of the decode body that stands for the mass variant's score write (paged_attention_scores.metal).
SCORE_WRITE = "MLXKV_SCORE_WRITE"


def with_kv_read(body: str, kv_read: str) -> str:
    """``body`` with its one ``KV_ROW_READ`` line replaced by ``kv_read``, indented as that line."""
    return with_line(body, KV_ROW_READ, kv_read)


def with_line(body: str, marker: str, text: str) -> str:
    """``body`` with its one line reading ``marker`` replaced by ``text`` (indented as that line; an empty
    ``text`` deletes the line)."""
    lines = body.splitlines(keepends=True)
    at = [n for n, line in enumerate(lines) if line.strip() == marker]
    assert len(at) == 1, f"a shared body needs exactly one {marker} line, found {len(at)}"
    line = lines[at[0]]
    indent = line[: len(line) - len(line.lstrip())]
    read = "".join(indent + r if r.strip() else r for r in text.splitlines(keepends=True))
    return "".join(lines[: at[0]]) + read + "".join(lines[at[0] + 1:])


PAGED_ATTENTION = KernelSpec(
    name="mlxkv_paged_attention",
    source_file="paged_attention.metal",
    input_names=("queries", "k_pages", "v_pages", "block_tables", "context_lens", "params", "scale"),
    output_names=("o_part", "lse"),
    template_params=(("T", "typename"), ("D", "int"), ("BS", "int"), ("KVH", "int"), ("G", "int"),
                     ("HT", "int"), ("LPK", "int"), ("NSG", "int")),
    kv_read_file="paged_attention_dense.metal",
)
PAGED_MERGE = KernelSpec(
    name="mlxkv_paged_merge",
    source_file="paged_merge.metal",
    input_names=("o_part", "lse", "sinks", "params"),
    output_names=("out",),
    template_params=(("T", "typename"), ("D", "int"), ("HAS_SINKS", "bool")),
)
PAGED_ATTENTION_QUANTIZED = KernelSpec(
    name="mlxkv_paged_attention_quantized",
    source_file="paged_attention.metal",  # the decode body above, with the quantized row read
    input_names=("queries", "k_packed", "k_scales", "k_biases", "v_packed", "v_scales", "v_biases",
                 "block_tables", "context_lens", "params", "scale"),
    output_names=("o_part", "lse"),
    template_params=(*PAGED_ATTENTION.template_params, ("BITS", "int"), ("GS", "int")),
    kv_read_file="paged_attention_quantized.metal",
)

# The attention-mass variants (off by default): the decode kernels plus a `scores` output [B, H, max_blocks * BS]
# float holding each visible token's scaled logit per query head, and the pass that turns those logits into the
# per-position mass once the splits' log-sum-exps are merged (paged_mass.metal).
def _with_scores(spec: KernelSpec) -> KernelSpec:
    return replace(spec, name=spec.name + "_scores", output_names=(*spec.output_names, "scores"),
                   score_write_file="paged_attention_scores.metal")


PAGED_ATTENTION_SCORES = _with_scores(PAGED_ATTENTION)
PAGED_ATTENTION_QUANTIZED_SCORES = _with_scores(PAGED_ATTENTION_QUANTIZED)
PAGED_MASS = KernelSpec(
    name="mlxkv_paged_mass",
    source_file="paged_mass.metal",
    input_names=("scores", "lse", "sinks", "context_lens", "params"),
    output_names=("mass",),
    template_params=(("KVH", "int"), ("G", "int"), ("HAS_SINKS", "bool")),
)
ALL_SPECS = (PAGED_ATTENTION, PAGED_MERGE, PAGED_ATTENTION_QUANTIZED, PAGED_ATTENTION_SCORES,
             PAGED_ATTENTION_QUANTIZED_SCORES, PAGED_MASS)


def read_source(filename: str) -> str:
    """Read a ``.metal`` body from the installed package data, or from the source tree."""
    try:
        from mlxkv import metal_kernels as package  # installed: package-dir mapping
    except ImportError:
        package = None
    if package is None:
        try:
            import metal_kernels as package  # source checkout on sys.path
        except ImportError:
            path = Path(__file__).resolve().parents[2] / "metal_kernels" / filename
            return path.read_text(encoding="utf-8")
    return package.read_source(filename)


@dataclass(frozen=True, slots=True)
class ArgInfo:
    """How MLX passes one input: element type, 0-d (by reference) or small (constant space)."""

    dtype: mx.Dtype
    scalar: bool = False  # ndim == 0 -> `const constant T& name`
    small: bool = False  # size < 8 -> constant address space

    @classmethod
    def of(cls, a: mx.array) -> ArgInfo:
        """How MLX passes ``a``."""
        return cls(a.dtype, scalar=a.ndim == 0, small=a.size < MAX_CONSTANT_ARRAY_SIZE)

    @property
    def space(self) -> str:
        """The address space of the argument: ``constant`` or ``device``."""
        return "constant" if (self.scalar or self.small) else "device"


def render_kernel(
    spec: KernelSpec,
    inputs: dict[str, ArgInfo],
    output_dtypes: dict[str, mx.Dtype],
    template: dict[str, object],
    header: str = "",
    *,
    body: str | None = None,
    func_name: str | None = None,
) -> str:
    """The full source MLX generates for ``spec``: header, templated signature, body, instantiation.

    Mirrors ``write_signature`` in MLX's ``mlx/backend/metal/custom_kernel`` (shape/stride
    buffers for ``<name>_shape``/``_strides``/``_ndim`` mentions, attributes the body mentions),
    plus an explicit instantiation with ``template`` so a C++ compiler checks the body's types.
    ``body`` replaces the source text (tests plant typos); ``func_name`` renames the function so
    several instantiations with different argument types can share one translation unit.
    """
    body = spec.source() if body is None else body
    params = []
    index = 0
    for name in spec.input_names:
        info = inputs[name]
        space = info.space
        ref = "&" if info.scalar else "*"
        params.append(f"  const {space} {TYPE_NAMES[info.dtype]}{ref} {name} [[buffer({index})]]")
        index += 1
        if info.scalar:
            continue
        for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                              ("_ndim", "const constant int&")):
            if name + suffix in body:
                params.append(f"  {ctype} {name}{suffix} [[buffer({index})]]")
                index += 1
    for name in spec.output_names:
        params.append(f"  device {TYPE_NAMES[output_dtypes[name]]}* {name} [[buffer({index})]]")
        index += 1
    for attr, ctype in METAL_ATTRIBUTES.items():
        if attr in body:
            params.append(f"  {ctype} {attr} [[{attr}]]")
    fname = func_name or f"custom_kernel_{spec.name}"
    tparams = ", ".join(f"{kind} {name}" for name, kind in spec.template_params)
    targs = []
    for name, kind in spec.template_params:
        value = template[name]
        if kind == "typename":
            targs.append(TYPE_NAMES[value])
        elif kind == "bool":
            targs.append("true" if value else "false")
        else:
            targs.append(str(int(value)))
    arg_types = ", ".join(p.split(" [[")[0].rsplit(" ", 1)[0].strip() for p in params)
    return (
        f"{header}\n"
        f"template <{tparams}>\n[[kernel]] void {fname}(\n" + ",\n".join(params) + ") {\n"
        f"{body}\n}}\n"
        f"template void {fname}<{', '.join(targs)}>({arg_types});\n"
    )
