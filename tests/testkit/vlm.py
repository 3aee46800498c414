"""Tiny random-weight vision-language models written to disk in the layout mlx-vlm (and mlx-lm) load.

``gemma3`` is Gemma 3's architecture (a SigLIP vision tower, the average-pool projector, the gemma3_text language
model with one sliding and one global layer) at test size: the language model has the test tokenizer's vocabulary,
whose last three ids are the image markers ``<start_of_image>``, ``<end_of_image>`` and ``<image_soft_token>``.
``image_size`` / ``patch_size`` / ``tokens_per_image`` set how many tokens an image takes (the benchmark uses
hundreds). The folder also holds a ``preprocessor_config.json`` for transformers' ``Gemma3ImageProcessor``.

Loading it gives bit-identical weights for the same arguments (weights drawn as :mod:`testkit.archs` draws them).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from testkit.archs import TEST_VOCAB_SIZE, _init_weights
from testkit.tokenizer import _trained_json, tokenizer_config, write_tokenizer

#: The image markers, in id order at the end of the vocabulary.
IMAGE_MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
BOI_ID, EOI_ID, IMAGE_ID = TEST_VOCAB_SIZE - 3, TEST_VOCAB_SIZE - 2, TEST_VOCAB_SIZE - 1


def gemma3_config(image_size: int = 16, patch_size: int = 4, tokens_per_image: int = 16,
                  vision_layers: int = 1, vision_hidden: int = 32) -> dict[str, Any]:
    """A Gemma 3 VLM config.json: ``(image_size / patch_size)^2`` patches pooled to ``tokens_per_image``."""
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "float32",
        "vocab_size": TEST_VOCAB_SIZE,
        "image_token_index": IMAGE_ID,
        "boi_token_index": BOI_ID,
        "eoi_token_index": EOI_ID,
        "mm_tokens_per_image": tokens_per_image,
        "hidden_size": 64,  # mlx-vlm divides image features by sqrt(this), defaulting to 2048 when absent
        "pad_token_id": 0,
        "eos_token_id": [2],
        "text_config": {
            "model_type": "gemma3_text",
            "vocab_size": TEST_VOCAB_SIZE,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "rope_global_base_freq": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": tokens_per_image,
            "max_position_embeddings": 4096,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": 2,
            "patch_size": patch_size,
            "image_size": image_size,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
    }


def image_processor_config(image_size: int) -> dict[str, Any]:
    """preprocessor_config.json: resize to ``image_size`` square, rescale to [0, 1], normalize to [-1, 1]."""
    return {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "size": {"height": image_size, "width": image_size},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }


def build_gemma3(config: dict[str, Any], seed: int = 0):
    """The mlx-vlm Gemma 3 model for ``config`` with deterministic random float32 weights."""
    from mlx_vlm.models import gemma3
    from mlx_vlm.utils import update_module_configs

    mx.random.seed(seed)
    model_config = update_module_configs(gemma3.ModelConfig.from_dict(config), gemma3, config, ["text", "vision"])
    model = gemma3.Model(model_config)
    _init_weights(model, seed)
    # Gemma 3 ties its output to the embeddings and scales them up by sqrt(hidden) on the way in: at the usual draw
    # the input token's own embedding leads the residual and greedy decoding repeats it; smaller embeddings give
    # varied sequences (measured: 17 distinct tokens in 20 greedy steps at 0.2)
    embed = model.language_model.model.embed_tokens
    embed.weight = embed.weight * 0.2
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def write_vision_tokenizer(out_dir: str | Path, model_max_length: int = 4096) -> Path:
    """The test tokenizer (:func:`testkit.tokenizer.write_tokenizer`) with its last three ids the image markers."""
    from tokenizers import AddedToken, Tokenizer

    out = write_tokenizer(out_dir, vocab_size=TEST_VOCAB_SIZE - 3, model_max_length=model_max_length)
    tok = Tokenizer.from_str(_trained_json(TEST_VOCAB_SIZE - 3))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_MARKERS])
    assert tok.token_to_id(IMAGE_MARKERS[-1]) == IMAGE_ID, tok.token_to_id(IMAGE_MARKERS[-1])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = {**tokenizer_config(model_max_length), "boi_token": IMAGE_MARKERS[0], "eoi_token": IMAGE_MARKERS[1],
              "image_token": IMAGE_MARKERS[2]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def write_gemma3_vlm(out_dir: str | Path, seed: int = 0, **sizes: Any) -> Path:
    """Write a tiny Gemma 3 VLM (``sizes``: :func:`gemma3_config`'s arguments) into ``out_dir``; returns it."""
    config = gemma3_config(**sizes)
    image_size = config["vision_config"]["image_size"]
    model = build_gemma3(copy.deepcopy(config), seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    weights.pop("language_model.lm_head.weight", None)  # Gemma 3 ties its output to the embeddings, as checkpoints do
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # mlx-lm's save_config drops vision_config
    write_vision_tokenizer(out)
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor_config(image_size), indent=2) + "\n")
    return out


def write_gemma3_language_only(out_dir: str | Path, seed: int = 0) -> Path:
    """A Gemma 3 VLM folder built without mlx-vlm: its config (vision_config included) and the language model's
    weights only (mlx-lm's ``gemma3``), as a user without the vision extra loads it; its text answers are those of
    any gemma3 checkpoint."""
    from testkit.archs import build_from_config

    config = gemma3_config()
    text_args = {"model_type": "gemma3", "vocab_size": TEST_VOCAB_SIZE, "text_config": dict(config["text_config"])}
    model, _ = build_from_config(text_args, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_vision_tokenizer(out)
    return out
