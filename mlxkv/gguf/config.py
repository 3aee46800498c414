"""An mlx-lm ``config.json`` built from a GGUF file's metadata, for the architectures mlxkv maps.

GGUF spells a model's hyper-parameters as ``<arch>.<key>`` (``llama.block_count``, ``qwen2.rope.freq_base``);
this module renames them to the Hugging Face names mlx-lm's model classes read. Mistral models are written by
llama.cpp with the ``llama`` architecture, so they load as llama.
"""

from __future__ import annotations

import math
from typing import Any

from mlxkv.gguf.bounds import check_hyperparameters
from mlxkv.gguf.reader import GGUFError, GGUFFile

#: GGUF architecture -> mlx-lm ``model_type``.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

#: Architectures whose q/k projection rows llama.cpp's converter permutes for its RoPE ("normal" rope
#: type, rotating adjacent pairs); the NeoX-style ones (qwen2, qwen3) are written unpermuted.
PERMUTED_QK = {"llama"}


def _get(meta: dict[str, Any], arch: str, key: str, default: Any = None, *, required: bool = True) -> Any:
    name = f"{arch}.{key}"
    if name in meta:
        return meta[name]
    if default is None and required:
        raise GGUFError(f"the GGUF metadata has no {name}, which a {arch} model needs")
    return default


def build_config(gguf: GGUFFile) -> dict[str, Any]:
    """The mlx-lm config dict for the model in ``gguf`` (quantization settings are added by the weights).

    Raises:
        GGUFError: an architecture mlxkv does not map, or metadata that mlx-lm's model cannot express.
    """
    meta, arch = gguf.metadata, gguf.architecture
    if arch not in MODEL_TYPES:
        raise GGUFError(
            f"GGUF architecture {arch or '(none)'!r} is not supported; mlxkv loads GGUF files of the "
            f"{', '.join(sorted(MODEL_TYPES))} architectures (or convert the original model to MLX with mlx_lm.convert)"
        )
    if "rope_freqs.weight" in gguf.tensors:
        raise GGUFError(
            "this GGUF carries per-frequency RoPE factors (rope_freqs, as Llama 3.1+ files do), which mlxkv cannot "
            "map to mlx-lm's rope_scaling; use the model's MLX or safetensors release instead"
        )
    if "token_embd.weight" not in gguf.tensors:
        raise GGUFError("this GGUF file has no token embedding tensor (token_embd.weight)")
    heads = _int(meta, arch, "attention.head_count")
    hidden = _int(meta, arch, "embedding_length")
    head_dim = _int(meta, arch, "attention.key_length", hidden // heads if heads > 0 else 0, required=False)
    vocab = gguf.tensors["token_embd.weight"].shape[0]  # the embedding's rows, whatever the tokenizer lists
    config: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": _int(meta, arch, "block_count"),
        "intermediate_size": _int(meta, arch, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, arch, "attention.head_count_kv", heads, required=False),
        "head_dim": head_dim,
        "rms_norm_eps": _positive(meta, arch, "attention.layer_norm_rms_epsilon"),
        "vocab_size": vocab,
        "max_position_embeddings": _int(meta, arch, "context_length", 4096, required=False),
        "rope_theta": _positive(meta, arch, "rope.freq_base", 10000.0, required=False),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    check_hyperparameters(arch, config, gguf.dims)
    rope_dims = _int(meta, arch, "rope.dimension_count", head_dim, required=False)
    if rope_dims != head_dim:
        raise GGUFError(f"partial RoPE ({rope_dims} of {head_dim} dimensions) is not supported for {arch}")
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in gguf.tensors
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{meta_key}")
        if value is not None:
            config[key] = _token_id(value, f"tokenizer.ggml.{meta_key}", vocab)
    eos = [_token_id(e, "tokenizer.ggml.eos_token_id", vocab) for e in end_of_turn_ids(meta)]
    if len(eos) > 1:
        config["eos_token_id"] = eos
    return config


def _int(meta: dict[str, Any], arch: str, key: str, default: Any = None, *, required: bool = True) -> int:
    value = _get(meta, arch, key, default, required=required)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{arch}.{key} is {str(value)[:40]!r}: an integer is needed")
    return value


def _positive(meta: dict[str, Any], arch: str, key: str, default: Any = None, *, required: bool = True) -> float:
    value = _get(meta, arch, key, default, required=required)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise GGUFError(f"{arch}.{key} is {str(value)[:40]!r}: a finite number above 0 is needed")
    return float(value)


def _token_id(value: Any, key: str, vocab: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise GGUFError(f"{key} is {str(value)[:40]!r}: a token id below the vocabulary's {vocab} is needed")
    return value


def end_of_turn_ids(meta: dict[str, Any]) -> list[int]:
    """Every token id the metadata says ends generation: EOS, end-of-turn and end-of-message."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise GGUFError(f"tokenizer.ggml.{key} is {str(value)[:40]!r}: a token id is needed")
        if value is not None and value not in ids:
            ids.append(value)
    return ids


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"type": "linear", "factor": float(factor)}
    raise GGUFError(f"RoPE scaling {kind!r} in this GGUF is not supported for {arch}")
