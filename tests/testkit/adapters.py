"""Write LoRA adapters in mlx-lm's format (``adapter_config.json`` + ``adapters.safetensors``) for the test models.

The adapter is built as ``mlx_lm.lora`` builds one before training (mlx-lm's ``linear_to_lora_layers`` over the
model's last ``num_layers`` layers) and given random non-zero ``lora_b`` (freshly made adapters have zero
``lora_b``, which would leave the model's output unchanged), then saved as ``mlx_lm.lora`` saves its result.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def write_test_adapter(model_dir: str | Path, out_dir: str | Path, *, seed: int = 0, rank: int = 4,
                       scale: float = 10.0, num_layers: int = 2, keys: list[str] | None = None,
                       fine_tune_type: str = "lora") -> Path:
    """An adapter for the model in ``model_dir`` (an mlx-lm folder) written into ``out_dir``; returns ``out_dir``.

    ``keys``: the module names to adapt (mlx-lm's ``lora_parameters.keys``; default: every linear layer);
    ``fine_tune_type``: ``lora`` or ``dora``.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    lora = {"rank": rank, "scale": scale, "dropout": 0.0, **({"keys": keys} if keys is not None else {})}
    linear_to_lora_layers(model, num_layers, lora, use_dora=fine_tune_type == "dora")
    key = mx.random.key(seed)
    adapter = {}
    for name, value in tree_flatten(model.parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("lora_a", "lora_b"):  # drawn from ``seed`` (mlx-lm draws lora_a from the global generator)
            key, sub = mx.random.split(key)
        if leaf == "lora_a":  # (in, r): mlx-lm's initial range
            bound = value.shape[0] ** -0.5
            value = mx.random.uniform(-bound, bound, value.shape, key=sub)
        elif leaf == "lora_b":
            value = 0.05 * mx.random.normal(value.shape, key=sub)  # (r, out): a visible, finite change
        if leaf in ("lora_a", "lora_b", "m"):
            adapter[name] = value
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapter)
    config = {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": lora}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
