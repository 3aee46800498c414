"""Tiny random-weight vision-language models written to disk in the layout mlx-vlm (and mlx-lm) load.

``gemma3`` is Gemma 3's architecture (a SigLIP vision tower, the average-pool projector, the gemma3_text language
model with one sliding and one global layer) at test size: the language model has the test tokenizer's vocabulary,
whose last three ids are the image markers ``<start_of_image>``, ``<end_of_image>`` and ``<image_soft_token>``.
``image_size`` / ``patch_size`` / ``tokens_per_image`` set how many tokens an image takes (the benchmark uses
hundreds). The folder also holds a ``preprocessor_config.json`` for transformers' ``Gemma3ImageProcessor``.

``qwen_vl`` is Qwen2-VL's (or Qwen2.5-VL's) architecture at test size: its vision tower with the 2x2 patch merger,
the Qwen2 language model with M-RoPE (3-D positions), the vocabulary's last four ids the tokens
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, and a ``preprocessor_config.json``
for transformers' ``Qwen2VLImageProcessor`` (images kept at their aspect ratio: tokens per image vary).

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


def write_vision_tokenizer(out_dir: str | Path, model_max_length: int = 4096,
                           markers: tuple[str, ...] = IMAGE_MARKERS) -> Path:
    """The test tokenizer (:func:`testkit.tokenizer.write_tokenizer`) with its last ids the image ``markers``
    (Gemma 3's three by default)."""
    from tokenizers import AddedToken, Tokenizer

    n = len(markers)
    out = write_tokenizer(out_dir, vocab_size=TEST_VOCAB_SIZE - n, model_max_length=model_max_length)
    tok = Tokenizer.from_str(_trained_json(TEST_VOCAB_SIZE - n))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in markers])
    assert tok.token_to_id(markers[-1]) == TEST_VOCAB_SIZE - 1, tok.token_to_id(markers[-1])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = tokenizer_config(model_max_length)
    if markers == IMAGE_MARKERS:
        config.update(boi_token=markers[0], eoi_token=markers[1], image_token=markers[2])
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


#: Qwen2-VL's image tokens, in id order at the end of the vocabulary (the video token is unused by mlxkv).
QWEN_MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(TEST_VOCAB_SIZE - 4, TEST_VOCAB_SIZE)


def qwen_vl_config(model_type: str = "qwen2_vl", patch_size: int = 4, vision_layers: int = 1,
                   vision_hidden: int = 32) -> dict[str, Any]:
    """A Qwen2-VL (``model_type="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``) config.json at test size: the
    language model's settings at the top level (as the checkpoints have them) with M-RoPE sections over its
    16-wide heads; a vision tower of ``patch_size`` pixels per patch, 2x2 patches merged per image token."""
    if model_type == "qwen2_vl":
        vision = {"model_type": model_type, "depth": vision_layers, "embed_dim": vision_hidden, "hidden_size": 64,
                  "num_heads": 2, "mlp_ratio": 2}
    else:
        vision = {"model_type": model_type, "depth": vision_layers, "hidden_size": vision_hidden,
                  "intermediate_size": 2 * vision_hidden, "out_hidden_size": 64, "num_heads": 2,
                  "window_size": 4 * patch_size, "fullatt_block_indexes": [vision_layers - 1]}
    vision.update(patch_size=patch_size, spatial_patch_size=patch_size, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    return {
        "model_type": model_type,
        "architectures": ["Qwen2VLForConditionalGeneration" if model_type == "qwen2_vl"
                          else "Qwen2_5_VLForConditionalGeneration"],
        "torch_dtype": "float32",
        "vocab_size": TEST_VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "vision_config": vision,
    }


def qwen_processor_config(patch_size: int = 4, min_tokens: int = 4, max_tokens: int = 64) -> dict[str, Any]:
    """preprocessor_config.json for transformers' ``Qwen2VLImageProcessor``: images resized (aspect kept) to a
    multiple of two patches, between ``min_tokens`` and ``max_tokens`` image tokens."""
    unit = (2 * patch_size) ** 2  # pixels per image token (2x2 merged patches)
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "min_pixels": min_tokens * unit,
        "max_pixels": max_tokens * unit,
        "size": {"shortest_edge": min_tokens * unit, "longest_edge": max_tokens * unit},
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def build_qwen_vl(config: dict[str, Any], seed: int = 0):
    """The mlx-vlm Qwen2-VL / Qwen2.5-VL model for ``config`` with deterministic random float32 weights."""
    import importlib

    from mlx_vlm.utils import update_module_configs

    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(seed)
    config = copy.deepcopy(config)  # from_dict copies the top-level settings into config["text_config"]
    model_config = update_module_configs(module.ModelConfig.from_dict(config), module, config, ["text", "vision"])
    model = module.Model(model_config)
    _init_weights(model, seed)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model


def write_qwen_vl(out_dir: str | Path, seed: int = 0, model_type: str = "qwen2_vl", min_tokens: int = 4,
                  max_tokens: int = 64, **sizes: Any) -> Path:
    """Write a tiny Qwen2-VL / Qwen2.5-VL (``model_type``; ``sizes``: :func:`qwen_vl_config`'s other arguments)
    into ``out_dir``; ``min_tokens`` / ``max_tokens``: the image processor's bounds on tokens per image."""
    config = qwen_vl_config(model_type, **sizes)
    model = build_qwen_vl(config, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_vision_tokenizer(out, markers=QWEN_MARKERS)
    processor = qwen_processor_config(config["vision_config"]["patch_size"], min_tokens, max_tokens)
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return out
