"""Bounds on a model folder's ``config.json``, checked before a model is built from it.

mlx-lm builds whatever the config declares: ``num_attention_heads = 0`` divides by zero while the attention
layers are made, ``num_hidden_layers = 100000`` instantiates a hundred thousand layers before the weights are
found not to fit, a four-billion-token context or vocabulary sizes tables from it. :func:`config_problem` names
the first size-like field that is not a positive integer within reach of any real model (the same limits as a
GGUF header's, mlxkv.gguf.bounds), looking at the top level and at a nested ``text_config``.
"""

from __future__ import annotations

from typing import Any

from mlxkv.gguf.bounds import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS

#: Largest hidden size, head size, MLP width and vocabulary a config may declare.
MAX_HIDDEN = 1 << 17
MAX_HEAD_DIM = 1 << 12
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22

#: Field -> most it may be (an integer >= 1, or a list of them per layer, when present and not null).
LIMITS = {
    "num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS, "num_layers": MAX_LAYERS,
    "num_attention_heads": MAX_HEADS, "n_head": MAX_HEADS, "num_key_value_heads": MAX_HEADS,
    "hidden_size": MAX_HIDDEN, "n_embd": MAX_HIDDEN, "head_dim": MAX_HEAD_DIM,
    "intermediate_size": MAX_INTERMEDIATE, "vocab_size": MAX_VOCAB,
    "max_position_embeddings": MAX_CONTEXT, "n_positions": MAX_CONTEXT,
}


def _section_problem(config: dict, where: str) -> str | None:
    for key, limit in LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        values = value if isinstance(value, list) and 0 < len(value) <= MAX_LAYERS else [value]  # per-layer sizes
        if any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit for v in values):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
            return f"{where}{key} is {shown}: expected an integer from 1 to {limit}"
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads > heads or heads % kv_heads):
        return f"{where}num_key_value_heads is {kv_heads}: expected a divisor of the {heads} attention heads"
    return None


def config_problem(config: Any) -> str | None:
    """Why ``config`` (a parsed config.json) cannot describe a model mlxkv should build; None when it can."""
    if not isinstance(config, dict):
        return f"it is a JSON {type(config).__name__}, not an object"
    problem = _section_problem(config, "")
    text = config.get("text_config")
    if problem is None and isinstance(text, dict):
        problem = _section_problem(text, "text_config.")
    return problem
