"""Writing GGUF files of the tiny test models the way llama.cpp's converter does, for the GGUF loader's tests.

Everything here comes from llama.cpp's own ``gguf`` package (its name map from Hugging Face tensor names,
its writer, its numpy quantizers), plus the one line of its converter that permutes llama's q/k rows; so
a loader test checks mlxkv's reading against an independent writer, not against mlxkv's own mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: mlx-lm model_type -> llama.cpp architecture.
ARCHES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3",
          "phi3": "PHI3"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: interleave each head's two rotary halves (rows only)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """What a weight becomes after a round trip through ``qtype_name`` (llama.cpp's numpy quantizers)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[qtype_name]
    if qtype_name == "F32":
        return w.astype(np.float32)
    return quants.dequantize(quants.quantize(w.astype(np.float32), qtype), qtype).astype(np.float32)


def write_gguf(folder: Path, out: Path, qtype: str = "F32", *, pre: str = "gpt2", tokenizer: bool = True,
               extra_tensors: dict[str, np.ndarray] | None = None, architecture: str | None = None,
               extra_metadata: dict[str, int] | None = None,
               blocks: dict[str, tuple[str, np.ndarray]] | None = None) -> Path:
    """Write the Hugging Face test model in ``folder`` as a GGUF file at ``out``.

    Matrices are stored as ``qtype`` (F32, F16, Q8_0, Q4_0, Q4_1), vectors as F32; llama's q/k rows are
    permuted as llama.cpp writes them. The tokenizer (byte-level BPE) is written from ``tokenizer.json`` with
    pre-tokenizer name ``pre``. ``extra_metadata`` adds uint32 keys (``general.alignment``: the value is
    only recorded; the file keeps the writer's own 32-byte alignment). ``blocks`` gives some tensors (by Hugging
    Face name) as ready ggml blocks instead: ``(type name, uint8 array of one row of blocks per weight row)``.
    """
    import gguf
    import mlx.core as mx
    from gguf import GGMLQuantizationType

    config = json.loads((folder / "config.json").read_text())
    arch = getattr(gguf.MODEL_ARCH, ARCHES[config["model_type"]])
    arch_name = architecture or gguf.MODEL_ARCH_NAMES[arch]
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_block_count(layers)
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    if config["model_type"] in ("gemma2", "gemma3_text"):  # llama.cpp's Gemma2Model / Gemma3Model parameters
        writer.add_sliding_window(config["sliding_window"])
    if config["model_type"] == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    for key, value in (extra_metadata or {}).items():
        writer.add_uint32(key, value)
    if tokenizer:
        _write_tokenizer(writer, folder, pre)

    weights = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    for hf, w in sorted(weights.items()):
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"llama.cpp's name map has no {hf}"
        kind = qtype if w.ndim == 2 else "F32"
        if config["model_type"] in ("gemma2", "gemma3_text") and hf.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w
        if hf in (blocks or {}):
            kind, w = blocks[hf]  # rows of blocks: the row permutation below moves them like float rows
        if config["model_type"] == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_permute(w, heads if ".attn_q." in name else kv_heads)
        if hf in (blocks or {}):
            writer.add_tensor(name, np.ascontiguousarray(w), raw_shape=w.shape, raw_dtype=GGMLQuantizationType[kind])
        else:
            _add(writer, name, w, kind)
    for name, w in (extra_tensors or {}).items():
        _add(writer, name, w, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def scalar_fields(path: Path) -> dict[str, tuple[int, str]]:
    """``{key: (byte offset of its value, struct format)}`` for every scalar metadata value of the GGUF file at
    ``path`` (read with llama.cpp's reader), so a test can patch a value in place (:func:`patched`)."""
    import gguf

    formats = {gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
               gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
               gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
               gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d"}
    fields = {}
    for name, field in gguf.GGUFReader(str(path)).fields.items():
        if len(field.types) == 1 and field.types[0] in formats and not name.startswith("GGUF."):
            fields[name] = (field.offset + 8 + len(name.encode()) + 4, formats[field.types[0]])
    return fields


def patched(data: bytes, fields: dict[str, tuple[int, str]], values: dict[str, int | float]) -> bytes:
    """``data`` (a GGUF file's bytes) with the scalar metadata ``values`` written over their own (same type)."""
    import struct

    out = bytearray(data)
    for key, value in values.items():
        offset, fmt = fields[key]
        struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


def _add(writer, name: str, w: np.ndarray, qtype: str) -> None:
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    data = w.astype(np.float16) if qtype == "F16" else w.astype(np.float32)
    if qtype not in ("F32", "F16"):
        data = quants.quantize(data, kind)
    writer.add_tensor(name, data, raw_dtype=kind)


def _write_tokenizer(writer, folder: Path, pre: str) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[settings["bos_token"]])
    writer.add_eos_token_id(vocab[settings["eos_token"]])
    writer.add_pad_token_id(vocab[settings["pad_token"]])
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    writer.add_chat_template(settings["chat_template"])
