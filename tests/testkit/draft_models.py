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
    return some_layers(src, list(range(num_layers)), out_dir)


def some_layers(src: str | Path, layers: list[int], out_dir: str | Path) -> Path:
    """Write the model in ``src`` with only its decoder ``layers`` (in that order, renumbered from 0) into
    ``out_dir``, as :func:`first_layers` does."""
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    new_index = {old: new for new, old in enumerate(layers)}
    num_layers = len(layers)
    weights = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, value in mx.load(str(file)).items():
            layer = _LAYER.search(name)
            if layer is None:
                weights[name] = value
            elif int(layer.group(1)) in new_index:
                start, end = layer.span(1)
                weights[name[:start] + str(new_index[int(layer.group(1))]) + name[end:]] = value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(file, out / file.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
