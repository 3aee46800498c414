"""Write tiny random-weight test models to disk in the layout ``mlx_lm.utils.load`` reads.

A test model folder holds config.json, model.safetensors (float32) and the test tokenizer files
(``testkit.tokenizer``). Loading it gives bit-identical weights to ``build_model(arch, seed)``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from testkit.archs import TEST_VOCAB_SIZE, build_model
from testkit.tokenizer import write_tokenizer


def write_test_model(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the ``arch`` test model with weight seed ``seed`` and write it into ``out_dir``.

    Args:
        arch: one of ``testkit.archs.ARCH_NAMES``.
        out_dir: destination folder (created if missing; existing files are overwritten).
        seed: weight seed (see ``build_model``).

    Returns:
        ``out_dir`` as a ``Path``; ``mlx_lm.utils.load(str(path))`` loads it.

    Raises:
        ValueError: if ``arch`` is unknown.
    """
    return write_model(*build_model(arch, seed), out_dir)


def write_model(model, config: dict, out_dir: str | Path) -> Path:
    """Write an in-memory test model and its config (vocabulary of the test tokenizer) into ``out_dir``."""
    from mlx_lm.utils import save_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, out / "config.json")
    text_config = config.get("text_config", config)
    write_tokenizer(out, vocab_size=TEST_VOCAB_SIZE, model_max_length=text_config["max_position_embeddings"])
    return out
