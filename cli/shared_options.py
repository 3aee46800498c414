"""Typer options that ``mlxkv generate`` and ``mlxkv chat`` share: one definition each (Typer reads them as the
parameters' defaults), in the same help panels, with the same checks."""

from __future__ import annotations

import typer

from mlxkv.cli.options import (
    FLAG,
    KV_PANEL,
    MODEL_PANEL,
    OUTPUT_PANEL,
    SAMPLING_PANEL,
    check_kv_bits,
    check_kv_group_size,
    check_kv_overflow,
    check_min_p,
    check_top_p,
)
from mlxkv.cli.validate import check_file_option, check_utf8

MODEL = typer.Option(None, "--model", "-m", metavar="MODEL", rich_help_panel=MODEL_PANEL,
                     help="Hugging Face repo id (owner/name or owner/name@revision), local folder or GGUF file "
                          "(default: the embedded demo model).")
REVISION = typer.Option(None, "--revision", metavar="REV", rich_help_panel=MODEL_PANEL,
                        help="Branch, tag or commit of a Hugging Face repo id.")
DEQUANTIZE = typer.Option(False, "--dequantize", metavar=FLAG, rich_help_panel=MODEL_PANEL,
                          help="Run quantized weights unquantized (float32 on CPU: much faster there).")
CHAT_TEMPLATE = typer.Option(None, "--chat-template", metavar="FILE", callback=check_file_option,
                             rich_help_panel=MODEL_PANEL, help="A Jinja chat template file used instead of the model's.")
MAX_TOKENS = typer.Option(128, "--max-tokens", "-n", min=1, rich_help_panel=SAMPLING_PANEL,
                          help="Most tokens to generate (per answer).")
TEMP = typer.Option(0.0, min=0.0, rich_help_panel=SAMPLING_PANEL, help="Sampling temperature; 0 is greedy.")
TOP_P = typer.Option(1.0, "--top-p", callback=check_top_p, rich_help_panel=SAMPLING_PANEL,
                     help="Nucleus sampling mass (0<x<=1).")
TOP_K = typer.Option(0, "--top-k", min=0, rich_help_panel=SAMPLING_PANEL,
                     help="Keep the k most likely tokens; 0 disables.")
MIN_P = typer.Option(0.0, "--min-p", callback=check_min_p, rich_help_panel=SAMPLING_PANEL,
                     help="Min-p filter (0<=x<1); 0 disables.")
SEED = typer.Option(None, rich_help_panel=SAMPLING_PANEL, help="Random seed for sampling (with --temp above 0).")
STOP = typer.Option(None, "--stop", metavar="TEXT", callback=check_utf8, rich_help_panel=SAMPLING_PANEL,
                    help="Stop string (repeatable).")
KV_BITS = typer.Option(None, "--kv-bits", callback=check_kv_bits, metavar="[4|8]", rich_help_panel=KV_PANEL,
                       help="Quantize the KV cache to 4 or 8 bits (paged pages or dense).")
KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", callback=check_kv_group_size, metavar="[32|64|128]",
                             rich_help_panel=KV_PANEL, help="Group size for KV quantization (with --kv-bits).")
KV_OVERFLOW = typer.Option("preempt", "--kv-overflow", callback=check_kv_overflow,
                           metavar="[preempt|window|h2o|offload]", rich_help_panel=KV_PANEL,
                           help="Past --kv-overflow-budget tokens: preempt (no cap), window (sinks + recent), h2o "
                                "(+ most-attended tokens), offload (h2o, evicted rows to host memory and back). "
                                "Paged storage evicts and restores whole pages.")
KV_OVERFLOW_BUDGET = typer.Option(None, "--kv-overflow-budget", min=2, metavar="TOKENS", rich_help_panel=KV_PANEL,
                                  help="Tokens kept per sequence and layer by --kv-overflow window|h2o|offload.")
KV_OVERFLOW_SINKS = typer.Option(None, "--kv-overflow-sinks", min=0, metavar="TOKENS", rich_help_panel=KV_PANEL,
                                 help="First tokens always kept by --kv-overflow (default 4).")
KV_OVERFLOW_RECENT = typer.Option(None, "--kv-overflow-recent", min=1, metavar="TOKENS", rich_help_panel=KV_PANEL,
                                  help="Last tokens always kept by --kv-overflow h2o|offload (default: half the budget).")
VERBOSE = typer.Option(False, "--verbose", "-v", metavar=FLAG, rich_help_panel=OUTPUT_PANEL,
                       help="Print speed and memory figures; tracebacks on errors.")

__all__ = ["MODEL", "REVISION", "DEQUANTIZE", "CHAT_TEMPLATE", "MAX_TOKENS", "TEMP", "TOP_P", "TOP_K", "MIN_P", "SEED",
           "STOP", "KV_BITS", "KV_GROUP_SIZE", "KV_OVERFLOW", "KV_OVERFLOW_BUDGET", "KV_OVERFLOW_SINKS",
           "KV_OVERFLOW_RECENT", "VERBOSE"]
