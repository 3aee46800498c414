"""Random-weight DeepSeek V2/V3 models for MLA tests and benchmarks (no download).

``deepseek_v3`` reuses the tiny config of :mod:`testkit.archs`; ``deepseek_v2`` is the same shape
with V2's differences: no query LoRA (V2-Lite style ``q_proj``), softmax greedy routing, and YaRN rope
scaling whose mscale changes both the softmax scale and the rope output (so both paths are exercised).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from testkit.archs import _init_weights, get_config

#: What turns the tiny deepseek_v3 config into a deepseek_v2 one.
V2_CHANGES: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "q_lora_rank": None,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
}
ARCHS = ("deepseek_v2", "deepseek_v3")


def deepseek_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The tiny config for ``arch`` (``deepseek_v2`` or ``deepseek_v3``), with ``overrides`` applied.

    Raises:
        ValueError: unknown ``arch``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown MLA test architecture {arch!r}; valid: {', '.join(ARCHS)}")
    config = get_config("deepseek_v3")
    if arch == "deepseek_v2":
        for key in ("scoring_func", "norm_topk_prob"):
            config.pop(key)
        config.update(V2_CHANGES)
    config.update(overrides)
    return config


def build_deepseek(arch: str, seed: int = 0, **overrides: Any) -> tuple[nn.Module, dict[str, Any]]:
    """Instantiate ``arch`` with deterministic random float32 weights (same scheme as ``archs.build_model``).

    The same (arch, seed, overrides) always gives bit-identical weights, so two calls build a reference
    model and a model to modify.
    """
    from mlx_lm.utils import _get_classes

    config = deepseek_config(arch, **overrides)
    model_class, args_class = _get_classes(config=config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    _init_weights(model, seed)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model, config
