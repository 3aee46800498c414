"""An mlx-lm ``config.json`` built from a GGUF file's metadata, for the architectures mlxkv maps.

GGUF spells a model's hyper-parameters as ``<arch>.<key>`` (``llama.block_count``, ``qwen2.rope.freq_base``);
this module renames them to the Hugging Face names mlx-lm's model classes read. Mistral models (Mistral-Nemo's
explicit ``head_dim`` included: ``llama.attention.key_length``) are written by llama.cpp with the ``llama``
architecture, so they load as llama.

Per family, what llama.cpp's converter writes and mlx-lm's model needs:

* ``gemma2`` / ``gemma3`` -> mlx-lm ``gemma2`` / ``gemma3_text``: ``key_length`` is ``head_dim``; the attention
  scale is not stored, llama.cpp derives it (``1/sqrt(head_dim)``, or ``1/sqrt(hidden/heads)`` for the 27B models,
  told apart by their layer count), so ``query_pre_attn_scalar`` is derived the same way; ``attention.sliding_window``
  is the window; Gemma 3's pattern is ``attention.sliding_window_pattern`` when present, else llama.cpp's fixed 6,
  its local layers' RoPE base ``rope.freq_base_swa`` or llama.cpp's fixed 10000; Gemma 2's soft caps are
  ``attn_logit_softcapping`` / ``final_logit_softcapping`` (mlx-lm's gemma2 attends globally in every layer).
* ``phi3`` -> mlx-lm ``phi3``: full-width RoPE only, no ``rope_factors_long`` / ``_short`` (LongRoPE) tensors.
"""

from __future__ import annotations

import math
from typing import Any

from mlxkv.gguf.bounds import check_hyperparameters
from mlxkv.gguf.reader import GGUFError, GGUFFile

#: GGUF architecture -> mlx-lm ``model_type``.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
               "phi3": "phi3"}
#: Layer counts of the Gemma models whose attention scale uses ``hidden / heads`` (the 27B ones), as llama.cpp has it.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

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
    if "rope_factors_long.weight" in gguf.tensors or "rope_factors_short.weight" in gguf.tensors:
        raise GGUFError("this GGUF carries LongRoPE factors (rope_factors_long / rope_factors_short, as Phi-3's 128K "
                        "models do), which mlxkv cannot map to mlx-lm's rope_scaling; use a 4K-context release instead")
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
    check_hyperparameters(arch, config, _checked_dims(arch, gguf.dims, config))
    rope_dims = _int(meta, arch, "rope.dimension_count", head_dim, required=False)
    if rope_dims != head_dim:
        raise GGUFError(f"partial RoPE ({rope_dims} of {head_dim} dimensions) is not supported for {arch}")
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in gguf.tensors
    config.update(_family(arch, meta, config))
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


def _family(arch: str, meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The config keys only ``arch``'s mlx-lm model reads (see the module docstring)."""
    if arch in ("gemma2", "gemma3"):
        hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
        out: dict[str, Any] = {
            "query_pre_attn_scalar": hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else config["head_dim"],
            "sliding_window": _int(meta, arch, "attention.sliding_window"),
        }
        if arch == "gemma2":
            out["attn_logit_softcapping"] = _positive(meta, arch, "attn_logit_softcapping", 50.0, required=False)
            out["final_logit_softcapping"] = _positive(meta, arch, "final_logit_softcapping", 30.0, required=False)
        else:
            pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise GGUFError(f"{arch}.attention.sliding_window_pattern is {str(pattern)[:40]!r}: mlxkv maps a "
                                "repeating pattern given as one integer (a global layer every N)")
            if pattern > config["num_hidden_layers"]:  # mlx-lm's gemma3_text indexes the first global layer's cache
                raise GGUFError(f"{arch}.attention.sliding_window_pattern is {pattern} (llama.cpp's default 6 when "
                                f"absent), more than the {config['num_hidden_layers']} layers mlx-lm's gemma3_text needs")
            out["sliding_window_pattern"] = pattern
            out["rope_local_base_freq"] = _positive(meta, arch, "rope.freq_base_swa", 10000.0, required=False)
        return out
    if arch == "phi3":
        if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
            raise GGUFError(f"phi3.attention.key_length is {config['head_dim']}: mlx-lm's phi3 needs hidden_size / heads")
        return {"rope_traditional": False}
    return {}


def _checked_dims(arch: str, dims: dict[str, tuple[int, ...]], config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``dims`` as :func:`check_hyperparameters` reads them (separate q / k / up projections): Phi-3's fused
    ``attn_qkv`` and ``ffn_up`` (gate and up) are checked here, in every block, and split into the shapes their
    parts have."""
    if arch != "phi3":
        return dims
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, ffn = config["head_dim"], config["intermediate_size"]
    split = dict(dims)
    blocks = sorted({name.split(".")[1] for name in dims if name.startswith("blk.")}, key=int)
    for block in blocks:
        for tensor, rows in (("attn_qkv", (heads + 2 * kv) * head_dim), ("ffn_up", 2 * ffn)):
            name = f"blk.{block}.{tensor}.weight"
            shape = dims.get(name, ())
            if shape != (hidden, rows):
                raise GGUFError(f"{name} is {list(shape)}, not [{hidden}, {rows}] as the phi3 metadata implies")
        split.update({f"blk.{block}.attn_q.weight": (hidden, heads * head_dim),
                      f"blk.{block}.attn_k.weight": (hidden, kv * head_dim),
                      f"blk.{block}.ffn_up.weight": (hidden, ffn)})
    return split
