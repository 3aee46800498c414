"""Tiny configurations of real mlx-lm architectures, one per cache layout we must support.

Every config is an mlx-lm ``config.json`` dict (float32, vocab = the test tokenizer's 1024 tokens).
The set covers each attention/cache kind mlx-lm builds with ``make_prompt_cache``:

=================  =====================================================================
``llama``          full attention, GQA (4 query heads, 2 KV heads) -> ``KVCache`` per layer
``qwen3``          full attention with q/k norms, explicit ``head_dim``       -> ``KVCache``
``gemma3_text``    layer 0 sliding (window 8) + layer 1 global -> ``RotatingKVCache`` + ``KVCache``
``llama4``         4 layers, chunk size 16: layers 0-2 ``ChunkedKVCache``, layer 3 ``KVCache``;
                   MoE feed-forward on layers 1 and 3 (top-1 of 2 experts)
``deepseek_v3``    multi-head latent attention (MLA); layer 0 dense MLP, layer 1 MoE
``qwen3_next``     hybrid: layer 0 gated-delta linear attention (``ArraysCache``, recurrent
                   state) + layer 1 full attention (``KVCache``)
=================  =====================================================================

:data:`EXTRA_ARCHITECTURES` holds architectures that only some tests need (not in ``ARCH_NAMES``, so the
suites parametrized over every architecture keep their size):

=================  =====================================================================
``nemotron_h``     Mamba-2 hybrid, pattern ``M*-M``: layers 0 and 3 Mamba-2 (``ArraysCache``: conv +
                   SSM state), layer 1 full attention (``KVCache``), layer 2 MLP (no cache)
=================  =====================================================================

``build_model`` instantiates one in memory with deterministic random weights.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

#: Vocabulary size shared by every test architecture and the test tokenizer.
TEST_VOCAB_SIZE = 1024

#: Weight scale over 1/sqrt(fan_in). At 1.0 random 2-layer models drift into repeating one token
#: after a few greedy steps (measured: up to 35 repeats in 60 steps); at 2.0 the same seeds give
#: 40-58 distinct tokens in 60 steps, so greedy-equality tests compare non-trivial sequences.
GAIN = 2.0

_COMMON = {
    "vocab_size": TEST_VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # qwen3 covers tied embeddings
    },
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
        # layer i is global when i % pattern == pattern - 1: layer 0 sliding, layer 1 global
        "sliding_window_pattern": 2,
    },
    "llama4": {
        "model_type": "llama4",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "text_config": {
            "model_type": "llama4_text",
            "vocab_size": TEST_VOCAB_SIZE,
            "max_position_embeddings": 4096,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "attention_bias": False,
            # layers with (i + 1) % 4 != 0 use chunked attention: 0, 1, 2 chunked; 3 global
            "attention_chunk_size": 16,
            "interleave_moe_layer_step": 2,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "rms_norm_eps": 1e-5,
            "rope_scaling": None,
            "rope_theta": 500000.0,
            "use_qk_norm": True,
        },
    },
    "deepseek_v3": {
        **_COMMON,
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
    },
    "qwen3_next": {
        **_COMMON,
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        # every layer a dense MLP: no experts needed to exercise the hybrid cache
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [0, 1],
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        # layer i is full attention when (i + 1) % interval == 0: layer 0 linear, layer 1 full
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
    },
}

EXTRA_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "nemotron_h": {
        **_COMMON,
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "M*-M",
        "tie_word_embeddings": False,
    },
}

#: Architecture names, in a stable order, for ``pytest.mark.parametrize``.
ARCH_NAMES: list[str] = list(ARCHITECTURES)


def get_config(arch: str) -> dict[str, Any]:
    """A deep copy of the config dict for ``arch``.

    Raises:
        ValueError: if ``arch`` is not one of ``ARCH_NAMES``.
    """
    known = {**ARCHITECTURES, **EXTRA_ARCHITECTURES}
    if arch not in known:
        raise ValueError(f"unknown test architecture {arch!r}; valid: {', '.join(known)}")
    return copy.deepcopy(known[arch])


def _init_weights(model: nn.Module, seed: int) -> None:
    """Replace every parameter with a deterministic draw keyed by (seed, parameter index in name order).

    Matrices (and stacked expert matrices) get N(0, (GAIN / sqrt(fan_in))^2), fan_in being their
    last axis. Token embeddings get the same small scale, so the residual stream is led by the
    layers' outputs rather than the input token's own embedding (with tied embeddings that would
    bias greedy decoding towards repeating its input). Vectors (norm weights, biases, SSM
    constants such as ``A_log``) keep the module's own initial values, which ``build_model`` makes
    deterministic by seeding MLX's global generator before constructing the model.
    """
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for i, (name, p) in enumerate(params):
        if p.ndim < 2:
            new.append((name, p))
            continue
        # depthwise conv weights are (channels, kernel, 1): their fan-in is the kernel width
        fan_in = math.prod(p.shape[1:]) if ".conv" in name else p.shape[-1]
        std = GAIN * fan_in**-0.5
        w = mx.random.normal(p.shape, dtype=mx.float32, key=keys[i]) * std
        new.append((name, w))
    model.update(tree_unflatten(new))


def build_model(arch: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """Instantiate the mlx-lm model for ``arch`` with deterministic random float32 weights.

    Args:
        arch: one of ``ARCH_NAMES``.
        seed: weight seed; the same (arch, seed) always gives bit-identical weights. Side effect:
            MLX's global random generator is reseeded with ``seed``.

    Returns:
        ``(model, config)`` where ``config`` is the dict the model was built from (the one
        ``write_test_model`` saves as config.json).

    Raises:
        ValueError: if ``arch`` is unknown.
    """
    return build_from_config(get_config(arch), seed)


def build_from_config(config: dict[str, Any], seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`build_model` for a config dict of any mlx-lm architecture (same weight draw)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config=config)
    mx.random.seed(seed)  # some modules draw their vectors at construction (qwen3_next A_log)
    model = model_class(args_class.from_dict(config))
    _init_weights(model, seed)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model, config
