"""A GGUF file as an mlx-lm model and tokenizer, loaded in place or written out as a Hugging Face folder.

Both paths share one translation (config from metadata, tensors renamed and q/k rows unpermuted, tokenizer
rebuilt), so ``mlxkv generate -m model.gguf`` runs exactly the model that ``mlxkv convert`` writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxkv.gguf.config import build_config, end_of_turn_ids
from mlxkv.gguf.reader import GGUFError, first_line, read
from mlxkv.gguf.tokenizer import build_tokenizer
from mlxkv.gguf.weights import hf_weights, quantization


@dataclass
class Translated:
    """A GGUF file in Hugging Face terms: mlx-lm config, weights by HF name, a transformers tokenizer."""

    config: dict[str, Any]
    weights: dict[str, Any]
    tokenizer: Any
    eos_token_ids: list[int]


def translate(path: str | Path, *, dequantize: bool = False) -> Translated:
    """Read ``path`` and translate it (nothing is written); ``dequantize``: see :func:`mlxkv.gguf.reader.read`.

    Raises:
        GGUFError: anything about the file mlxkv cannot map, with a one-line message.
    """
    gguf = read(path, dequantize=dequantize)
    config = build_config(gguf)
    weights = hf_weights(gguf, config)
    quant = quantization(weights)
    if quant is not None:
        config["quantization"] = quant
    try:
        tokenizer = build_tokenizer(gguf.metadata)
    except GGUFError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers / tokenizers refusing the file's vocabulary or ids
        raise GGUFError(f"the GGUF tokenizer cannot be built: {first_line(exc)}") from None
    return Translated(config=config, weights=weights, tokenizer=tokenizer, eos_token_ids=end_of_turn_ids(gguf.metadata))


def build_model(config: dict[str, Any], weights: dict[str, Any]) -> Any:
    """Instantiate the mlx-lm model for ``config`` and load ``weights`` into it (quantized layers keep the
    bits of their own tensors, as mlx-lm's loader does).

    Raises:
        GGUFError: the weights do not fit the model built from the metadata.
    """
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    quant = config.get("quantization")
    if quant is not None:
        def quantized(path: str, module: Any) -> Any:
            if path in quant:
                return quant[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        try:
            nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], class_predicate=quantized)
        except ValueError as exc:  # a quantized tensor where the layer cannot be quantized (a norm, say)
            raise GGUFError(f"the GGUF tensors do not fit a {config['model_type']} model: {first_line(exc)}") \
                from None
    if hasattr(model, "sanitize"):  # e.g. gemma3_text drops its lm_head when the file ties it to the embedding
        weights = model.sanitize(dict(weights))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise GGUFError(f"the GGUF tensors do not fit a {config['model_type']} model: {first[:300]}") from None
    return model


def load_gguf(path: str | Path, *, dequantize: bool = False) -> tuple[Any, dict[str, Any], Any]:
    """``(model, config, tokenizer)`` for a GGUF file; the tokenizer is mlx-lm's ``TokenizerWrapper``.

    ``dequantize`` decodes the K-quants straight to float weights (exact), instead of MLX affine layers; without
    it, only the types no affine form holds exactly (Q6_K, Q2_K) are float, unless ``MLXKV_GGUF_REQUANTIZE``
    asks for 8 bits (:mod:`mlxkv.gguf.kquants`).
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    t = translate(path, dequantize=dequantize)
    model = build_model(t.config, t.weights)
    return model, t.config, TokenizerWrapper(t.tokenizer, streaming_detokenizer(t.tokenizer),
                                             eos_token_ids=t.eos_token_ids)


def streaming_detokenizer(tokenizer: Any) -> Any:
    """The streaming detokenizer class mlx-lm's loader picks for this tokenizer's ``tokenizer.json`` decoder, so a
    GGUF streams its text as the same model's Hugging Face folder does (byte-level BPE without the answer's
    leading space, SentencePiece likewise), and a chat's history, rebuilt from that text, matches."""
    from functools import partial

    from mlx_lm import tokenizer_utils as tu

    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    if tu._is_spm_decoder(decoder):
        return tu.SPMStreamingDetokenizer
    if tu._is_spm_decoder_no_space(decoder):
        return partial(tu.SPMStreamingDetokenizer, trim_space=False)
    if tu._is_bpe_decoder(decoder):
        return tu.BPEStreamingDetokenizer
    return tu.NaiveStreamingDetokenizer


def convert(path: str | Path, out_dir: str | Path, *, dequantize: bool = False,
            quantize: tuple[int, int] | None = None) -> Path:
    """Write the GGUF file at ``path`` as a Hugging Face folder (``config.json``, ``model.safetensors``,
    tokenizer files) that mlx-lm and mlxkv load.

    ``dequantize`` writes quantized layers unquantized: in float32 on the CPU backend (scales upcast first,
    so the weights equal those ``mlxkv.models.load(path, dequantize=True)`` computes), in the scales' own
    dtype elsewhere. ``quantize=(bits, group_size)`` writes the model quantized by mlx-lm's own quantizer
    (``mlx_lm.convert -q``) from its float weights (a quantized file's are dequantized first).

    Raises:
        GGUFError: the file cannot be translated, or ``out_dir`` exists and is not an empty folder.
    """
    import mlx.core as mx

    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFError(f"{out} already exists and is not an empty folder")
    float_weights = dequantize or quantize is not None
    t = translate(path, dequantize=float_weights)
    model = build_model(t.config, t.weights)  # refuses before anything is written if the tensors do not fit
    weights = t.weights
    if float_weights:
        from mlx.utils import tree_flatten

        from mlxkv.precision import dequantize_in_place

        t.config = dequantize_in_place(model, t.config)
        if quantize is not None:
            from mlx_lm.utils import quantize_model

            bits, group_size = quantize
            model, t.config = quantize_model(model, t.config, group_size, bits)
        weights = dict(tree_flatten(model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(t.config, indent=2) + "\n")
    t.tokenizer.save_pretrained(str(out))
    return out
