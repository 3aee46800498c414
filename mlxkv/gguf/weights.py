"""GGUF tensors renamed and reordered into the Hugging Face layout mlx-lm's model classes load.

Quantized tensors stay quantized where MLX holds them exactly: each such block type arrives as MLX's affine
triplet (``weight`` packed uint32, ``scales``, ``biases``; groups of 32; see :mod:`mlxkv.gguf.kquants` for the bits
each type becomes), so each linear layer becomes an ``nn.QuantizedLinear`` with the bits its own tensor has, or
stays a float ``nn.Linear`` (a Q4_K_M file mixes 4-bit layers and its Q6_K layers as float).
"""

from __future__ import annotations

import re
from typing import Any

from mlxkv.gguf.config import PERMUTED_QK
from mlxkv.gguf.reader import GGUFError, GGUFFile

#: MLX group size of every quantized GGUF tensor (:data:`mlxkv.gguf.kquants.GROUP_SIZE`).
GROUP_SIZE = 32
#: The bit widths MLX's affine quantization packs.
AFFINE_BITS = (2, 3, 4, 5, 6, 8)

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Families whose GGUF block tensors are named differently from llama's (GGUF part -> Hugging Face module):
#: Gemma 2/3 have four norms per block (llama.cpp's ``ffn_norm`` is Gemma's *pre*-feed-forward norm), Phi-3 keeps
#: its fused q/k/v and gate/up projections as ``attn_qkv`` and ``ffn_up``.
_GEMMA_LAYER = {**_LAYER, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
LAYER_NAMES = {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER,
               "phi3": {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
#: Families whose RMSNorm computes ``x * (1 + w)``: llama.cpp's converter stores ``1 + w``, mlx-lm's model expects ``w``.
NORM_SHIFT = {"gemma2", "gemma3"}
_SUFFIXES = ("weight", "scales", "biases", "bias")
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(\w+)$")
_TOP = re.compile(r"^(\w+)\.(\w+)$")


def hf_name(name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name for a GGUF tensor name (``blk.3.attn_q.scales`` ->
    ``model.layers.3.self_attn.q_proj.scales``) in the family of GGUF architecture ``arch``.

    Raises:
        GGUFError: a tensor this mapping does not know (another architecture's, or a MoE expert tensor).
    """
    layer_names = LAYER_NAMES.get(arch, _LAYER)
    if m := _BLOCK.match(name):
        layer, part, suffix = m.groups()
        if part in layer_names and suffix in _SUFFIXES:
            return f"model.layers.{layer}.{layer_names[part]}.{suffix}"
    elif (m := _TOP.match(name)) and m.group(1) in _GLOBAL and m.group(2) in _SUFFIXES:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise GGUFError(f"GGUF tensor {name!r} has no counterpart in mlxkv's {arch or 'llama'}-family mapping")


def unpermute_rows(w: Any, heads: int) -> Any:
    """Undo llama.cpp's RoPE row permutation of a q or k projection.

    llama.cpp interleaves each head's two rotary halves; the Hugging Face layout keeps them as halves.
    Only rows move, so a packed quantized weight, its scales and biases, and a bias vector permute alike.
    """
    rows = w.shape[0]
    rest = w.shape[1:]
    # (heads, rows/head/2, 2, ...) -> (heads, 2, rows/head/2, ...)
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def hf_weights(gguf: GGUFFile, config: dict) -> dict[str, Any]:
    """Every tensor of ``gguf`` under its Hugging Face name, q/k rows in Hugging Face order."""
    permute = gguf.architecture in PERMUTED_QK
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    shift = gguf.architecture in NORM_SHIFT
    out: dict[str, Any] = {}
    for name, w in gguf.tensors.items():
        m = _BLOCK.match(name)
        if permute and m and m.group(2) in heads:
            w = unpermute_rows(w, heads[m.group(2)])
        if shift and name.endswith("norm.weight"):
            w = w - 1  # exact: the stored 1 + w lies in [1/2, 2] for any norm weight in [-1/2, 1]
        out[hf_name(name, gguf.architecture)] = w
    return out


def quantization(weights: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` config for these weights: the most common bit width as the default and
    one entry per layer that differs; ``None`` when nothing is quantized."""
    bits = {name[: -len(".scales")]: layer_bits(weights, name[: -len(".scales")])
            for name in weights if name.endswith(".scales")}
    if not bits:
        return None
    values = list(bits.values())
    default = max(set(values), key=values.count)
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default}
    for layer, b in sorted(bits.items()):
        if b != default:
            config[layer] = {"group_size": GROUP_SIZE, "bits": b}
    return config


def layer_bits(weights: dict[str, Any], layer: str) -> int:
    """Bits per weight of a quantized layer, from its packed width: 32-bit words hold 32 / bits values."""
    packed = weights[f"{layer}.weight"].shape[-1]
    columns = weights[f"{layer}.scales"].shape[-1] * GROUP_SIZE
    bits, rem = divmod(packed * 32, columns)
    if rem or bits not in AFFINE_BITS:
        raise GGUFError(f"quantized tensor {layer} has an unexpected packing ({packed} words for {columns} columns)")
    return bits
