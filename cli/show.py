"""``mlxkv show MODEL``: what a model is, as the KV cache sees it: architecture, layers, heads, KV bytes per token,
context length, quantization, chat template. Loads the model as ``generate`` would (MLX imported inside)."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from mlxkv.cli import shared_options as options
from mlxkv.cli.options import FLAG, with_revision


def describe(loaded: Any) -> dict[str, Any]:
    """The facts ``mlxkv show`` prints, from a :class:`mlxkv.models.LoadedModel`."""
    from mlx.utils import tree_flatten

    config = loaded.config
    layers = config.get("num_hidden_layers")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and "hidden_size" in config
                                          else None)
    floats = [v for _, v in tree_flatten(loaded.model.parameters()) if "float" in str(v.dtype)]
    itemsize = floats[0].itemsize if floats else None
    per_token = 2 * layers * kv_heads * head_dim * itemsize if layers and kv_heads and head_dim and itemsize else None
    template = getattr(loaded.tokenizer, "chat_template", None)
    return {"model": loaded.name, "path": str(loaded.path), "architecture": loaded.model_type, "layers": layers,
            "attention_heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "kv_dtype": str(floats[0].dtype).removeprefix("mlx.core.") if floats else None,
            "kv_bytes_per_token": per_token, "context": config.get("max_position_embeddings"),
            "vocab_size": config.get("vocab_size"), "quantized": loaded.quantized, "gguf": loaded.is_gguf,
            "chat_template": bool(template)}


def show(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                          help="As -m takes it: a repo id, a folder or a GGUF file (default: the "
                                               "embedded demo model)."),
    revision: Optional[str] = options.REVISION,
    as_json: bool = typer.Option(False, "--json", metavar=FLAG, help="One JSON object instead of lines."),
    template: bool = typer.Option(False, "--template", metavar=FLAG, help="Print the chat template's text too."),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar=FLAG, help="Tracebacks on errors."),
) -> None:
    """Show a model's architecture, layers, heads, KV bytes per token, context length and chat template."""
    model = with_revision(model, revision)
    from mlxkv.cli.models import remember_gguf
    from mlxkv.models import ModelLoadError, load

    try:
        loaded = load(model)
        facts = describe(loaded)
    except (ModelLoadError, ValueError, OSError) as exc:
        if verbose:
            import traceback

            traceback.print_exc()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1)
    remember_gguf(loaded)
    if template:
        facts["chat_template_text"] = getattr(loaded.tokenizer, "chat_template", None)
    if as_json:
        typer.echo(json.dumps(facts))
        return
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        if key != "chat_template_text":
            typer.echo(f"{key.replace('_', ' '):<{width}}  {'-' if value is None else value}")
    if template and facts["chat_template_text"]:
        typer.echo(facts["chat_template_text"])


__all__ = ["show", "describe"]
