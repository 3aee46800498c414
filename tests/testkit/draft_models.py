"""Draft models built offline for the speculative-decoding tests: a model folder's first layers, with its own
embedding, final norm and output head, written as an mlx-lm model folder (same tokenizer and vocabulary)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def first_layers(src: str | Path, num_layers: int, out_dir: str | Path) -> Path:
    """Write the model in ``src`` (an mlx-lm folder of safetensors) cut to its first ``num_layers`` decoder layers
    into ``out_dir``: its other files (tokenizer, templates) copied, ``num_hidden_layers`` set in its config."""
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, value in mx.load(str(file)).items():
            layer = _LAYER.search(name)
            if layer is None or int(layer.group(1)) < num_layers:
                weights[name] = value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(file, out / file.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
