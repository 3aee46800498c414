"""Typer options of ``mlxkv chat`` that mean what ``mlxkv generate``'s options of the same names mean (one
definition each; Typer reads them as parameter defaults). Help panels are named as ``generate``'s."""

from __future__ import annotations

import typer

from mlxkv.cli.options import check_kv_bits, check_min_p, check_top_p

MODEL = typer.Option(None, "--model", "-m", metavar="MODEL", rich_help_panel="Model",
                     help="Hugging Face repo id, local folder or GGUF file (default: the embedded demo model).")
DEQUANTIZE = typer.Option(False, "--dequantize", rich_help_panel="Model",
                          help="Run quantized weights unquantized (float32 on CPU: much faster there).")
CHAT_TEMPLATE = typer.Option(None, "--chat-template", metavar="FILE", rich_help_panel="Model",
                             help="A Jinja chat template file used instead of the model's.")
MAX_TOKENS = typer.Option(128, "--max-tokens", "-n", min=1, rich_help_panel="Sampling",
                          help="Most tokens to generate (per answer).")
TEMP = typer.Option(0.0, min=0.0, rich_help_panel="Sampling", help="Sampling temperature; 0 is greedy.")
TOP_P = typer.Option(1.0, "--top-p", callback=check_top_p, rich_help_panel="Sampling",
                     help="Nucleus sampling mass (0<x<=1).")
TOP_K = typer.Option(0, "--top-k", min=0, rich_help_panel="Sampling", help="Keep the k most likely tokens; 0 disables.")
MIN_P = typer.Option(0.0, "--min-p", callback=check_min_p, rich_help_panel="Sampling",
                     help="Min-p filter (0<=x<1); 0 disables.")
SEED = typer.Option(None, rich_help_panel="Sampling", help="Random seed for sampling.")
STOP = typer.Option(None, "--stop", metavar="TEXT", rich_help_panel="Sampling", help="Stop string (repeatable).")
KV_BITS = typer.Option(None, "--kv-bits", callback=check_kv_bits, rich_help_panel="KV cache",
                       help="Quantize the KV cache to 4 or 8 bits.")
KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", min=1, rich_help_panel="KV cache",
                             help="Group size for KV quantization (32, 64 or 128).")


def check_kv_group_size(value: int) -> int:
    """The group size check made after parsing (one of 32, 64, 128)."""
    if value not in (32, 64, 128):
        raise typer.BadParameter(f"{value} is not one of 32, 64, 128.", param_hint="--kv-group-size")
    return value


__all__ = ["MODEL", "DEQUANTIZE", "CHAT_TEMPLATE", "MAX_TOKENS", "TEMP", "TOP_P", "TOP_K", "MIN_P", "SEED", "STOP",
           "KV_BITS", "KV_GROUP_SIZE", "check_kv_group_size"]
