"""The Typer options that ``mlxkv generate``, ``mlxkv chat`` and ``mlxkv serve`` share: one definition each (Typer
reads them as the parameters' defaults), in the same help panels, refusing a bad value with the rule of
:mod:`mlxkv.rules` that the config dataclasses apply too.

A command takes an option from here whenever it has it. ``serve``'s sampling options are the defaults of requests
that leave a field out, so three of its defaults differ on purpose (:data:`SERVE_DEFAULTS`); name, type, help and
rule are the same.
"""

from __future__ import annotations

import copy
from typing import Any

import typer

from mlxkv import rules
from mlxkv.cli.options import (
    FLAG,
    KV_PANEL,
    MODEL_PANEL,
    OUTPUT_PANEL,
    SAMPLING_PANEL,
    SPECULATIVE_PANEL,
    from_rule,
)
from mlxkv.cli.validate import check_adapter_option, check_file_option, check_stop, check_utf8

MODEL = typer.Option(None, "--model", "-m", metavar="MODEL", rich_help_panel=MODEL_PANEL,
                     help="Hugging Face repo id (owner/name or owner/name@revision), local folder or GGUF file "
                          "(default: the embedded demo model).")
REVISION = typer.Option(None, "--revision", metavar="REV", rich_help_panel=MODEL_PANEL,
                        help="Branch, tag or commit of a Hugging Face repo id.")
DEQUANTIZE = typer.Option(False, "--dequantize", metavar=FLAG, rich_help_panel=MODEL_PANEL,
                          help="Run quantized weights unquantized (float32 on CPU: much faster there).")
ADAPTER_PATH = typer.Option(None, "--adapter-path", metavar="FOLDER", callback=check_adapter_option,
                            rich_help_panel=MODEL_PANEL,
                            help="A LoRA adapter over the model's weights: a folder in mlx-lm's format "
                                 "(adapter_config.json and adapters.safetensors, as mlx_lm.lora writes them).")
CHAT_TEMPLATE = typer.Option(None, "--chat-template", metavar="FILE", callback=check_file_option,
                             rich_help_panel=MODEL_PANEL,
                             help="A Jinja chat template file used instead of the model's (e.g. one that renders "
                                  "tools).")
SYSTEM = typer.Option(None, "--system", metavar="TEXT", callback=check_utf8, rich_help_panel=MODEL_PANEL,
                      help="System message (with the chat template).")
DISTRIBUTED = typer.Option("off", "--distributed", metavar="[off|tensor|pipeline]", rich_help_panel=MODEL_PANEL,
                           callback=from_rule(rules.OneOf(("off", "tensor", "pipeline"))),
                           help="Under mlx.launch: tensor-parallel (each rank holds its share of the weights and KV "
                                "heads) or pipeline-parallel (each rank holds a range of the layers and their KV) "
                                "over the launched ranks; rank 0 prints or serves HTTP. See docs/distributed.md.")

MAX_TOKENS = typer.Option(128, "--max-tokens", "-n", callback=from_rule(rules.MAX_TOKENS),
                          rich_help_panel=SAMPLING_PANEL, help="Most tokens to generate per answer.")
TEMP = typer.Option(0.0, "--temp", callback=from_rule(rules.TEMP), rich_help_panel=SAMPLING_PANEL,
                    help=f"Sampling temperature ({rules.TEMP.notation}); 0 is greedy.")
TOP_P = typer.Option(1.0, "--top-p", callback=from_rule(rules.TOP_P), rich_help_panel=SAMPLING_PANEL,
                     help=f"Nucleus sampling mass ({rules.TOP_P.notation}); 1 disables it.")
TOP_K = typer.Option(0, "--top-k", callback=from_rule(rules.TOP_K), rich_help_panel=SAMPLING_PANEL,
                     help="Keep the k most likely tokens; 0 disables it.")
MIN_P = typer.Option(0.0, "--min-p", callback=from_rule(rules.MIN_P), rich_help_panel=SAMPLING_PANEL,
                     help=f"Min-p filter ({rules.MIN_P.notation}); 0 disables it.")
SEED = typer.Option(None, "--seed", rich_help_panel=SAMPLING_PANEL,
                    help="Random seed for sampling (with --temp above 0).")
STOP = typer.Option(None, "--stop", metavar="TEXT", callback=check_stop, rich_help_panel=SAMPLING_PANEL,
                    help="Stop string (repeatable).")

REPETITION_PENALTY = typer.Option(None, "--repetition-penalty", rich_help_panel=SAMPLING_PANEL,
                                  help="Repetition penalty (> 0; mlx-lm's, over the last 20 tokens).")
CHAT_TEMPLATE_KWARGS = typer.Option(
    None, "--chat-template-kwargs", metavar="JSON", rich_help_panel=SAMPLING_PANEL,
    help='JSON object of extra chat template variables, e.g. \'{"enable_thinking": false}\' (serve: for every '
         "request; a request's chat_template_kwargs keys win).")

EXTRA_EOS_TOKEN = typer.Option(None, "--extra-eos-token", metavar="TOKEN", callback=check_utf8,
                               rich_help_panel=SAMPLING_PANEL,
                               help="A token (as the vocabulary spells it, or its id) that also ends an answer "
                                    "(repeatable).")

KV_BACKEND = typer.Option("dense", "--kv-backend", callback=from_rule(rules.KV_BACKEND), metavar="[dense|paged]",
                          rich_help_panel=KV_PANEL,
                          help="KV storage: dense buffers or paged blocks (a shared pool with prefix caching).")
KV_BLOCK_SIZE = typer.Option(16, "--kv-block-size", callback=from_rule(rules.KV_BLOCK_SIZE), metavar="TOKENS",
                             rich_help_panel=KV_PANEL,
                             help=f"Tokens per KV block (paged; a power of two 1..{rules.MAX_BLOCK_SIZE}).")
STATE_SNAPSHOT_INTERVAL = typer.Option(
    0, "--state-snapshot-interval", callback=from_rule(rules.STATE_SNAPSHOT_INTERVAL), metavar="BLOCKS",
    rich_help_panel=KV_PANEL,
    help="Models with recurrent layers (paged): also snapshot their state every this many KV blocks of a prompt, "
         "so prompts sharing a prefix resume deeper (0: at prompt and sequence ends only).")
MAX_KV_SIZE = typer.Option(None, "--max-kv-size", callback=from_rule(rules.MAX_KV_SIZE), metavar="TOKENS",
                           rich_help_panel=KV_PANEL,
                           help=f"Cap on cached tokens per layer, rotating past it (dense; "
                                f"{rules.MAX_KV_SIZE.notation}).")
KV_BITS = typer.Option(None, "--kv-bits", callback=from_rule(rules.KV_BITS_RULE), metavar="[4|8]",
                       rich_help_panel=KV_PANEL,
                       help="Quantize the KV cache to 4 or 8 bits (groups of --kv-group-size along head_dim).")
KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", callback=from_rule(rules.KV_GROUP_SIZE), metavar="[32|64|128]",
                             rich_help_panel=KV_PANEL, help="Group size for KV quantization (with --kv-bits).")
KV_OVERFLOW = typer.Option("preempt", "--kv-overflow", callback=from_rule(rules.KV_OVERFLOW),
                           metavar="[preempt|window|h2o|offload]", rich_help_panel=KV_PANEL,
                           help="Past --kv-overflow-budget tokens: preempt (no cap), window (sinks + recent), h2o "
                                "(+ most-attended tokens), offload (h2o, evicted rows to host memory and back). "
                                "Paged storage evicts and restores whole pages.")
KV_OVERFLOW_BUDGET = typer.Option(None, "--kv-overflow-budget", callback=from_rule(rules.KV_OVERFLOW_BUDGET),
                                  metavar="TOKENS", rich_help_panel=KV_PANEL,
                                  help="Tokens kept per sequence and layer by --kv-overflow window|h2o|offload.")
KV_OVERFLOW_SINKS = typer.Option(None, "--kv-overflow-sinks", callback=from_rule(rules.KV_OVERFLOW_SINKS),
                                 metavar="TOKENS", rich_help_panel=KV_PANEL,
                                 help="First tokens always kept by --kv-overflow (default 4).")
KV_OVERFLOW_RECENT = typer.Option(None, "--kv-overflow-recent", callback=from_rule(rules.KV_OVERFLOW_RECENT),
                                  metavar="TOKENS", rich_help_panel=KV_PANEL,
                                  help="Last tokens always kept by --kv-overflow h2o|offload (default: half the "
                                       "budget).")

VERBOSE = typer.Option(False, "--verbose", "-v", metavar=FLAG, rich_help_panel=OUTPUT_PANEL,
                       help="Tracebacks on errors; generate also prints speed and memory figures, chat "
                            "each turn's cached and prefilled tokens and timings.")


def _with_default(option: Any, default: Any, shown: str | None = None) -> Any:
    """``option`` with another default (``shown``: what ``--help`` says the default is, when not the value)."""
    changed = copy.copy(option)
    changed.default = default
    if shown is not None:
        changed.show_default = shown
    return changed


#: The defaults ``serve`` gives requests that leave a field out: OpenAI's temperature of 1, the route's own
#: length limit, and the paged store that shares prefixes between requests.
SERVE_DEFAULTS = {"temp": 1.0, "max_tokens": None, "kv_backend": "paged"}
SERVE_TEMP = _with_default(TEMP, SERVE_DEFAULTS["temp"])
SERVE_MAX_TOKENS = _with_default(MAX_TOKENS, SERVE_DEFAULTS["max_tokens"],
                                 "the rest of the context for chat, 16 for completions")
SERVE_KV_BACKEND = _with_default(KV_BACKEND, SERVE_DEFAULTS["kv_backend"])

__all__ = ["MODEL", "REVISION", "DEQUANTIZE", "ADAPTER_PATH", "CHAT_TEMPLATE", "SYSTEM", "DISTRIBUTED", "MAX_TOKENS", "TEMP",
           "TOP_P", "TOP_K", "MIN_P", "SEED", "STOP", "REPETITION_PENALTY", "CHAT_TEMPLATE_KWARGS", "EXTRA_EOS_TOKEN", "KV_BACKEND", "KV_BLOCK_SIZE", "STATE_SNAPSHOT_INTERVAL",
           "MAX_KV_SIZE", "KV_BITS", "KV_GROUP_SIZE", "KV_OVERFLOW", "KV_OVERFLOW_BUDGET", "KV_OVERFLOW_SINKS",
           "KV_OVERFLOW_RECENT", "VERBOSE", "SERVE_DEFAULTS", "SERVE_TEMP", "SERVE_MAX_TOKENS", "SERVE_KV_BACKEND"]

DRAFT_MODEL = typer.Option(None, "--draft-model", metavar="MODEL", rich_help_panel=SPECULATIVE_PANEL,
                           help="Speculative decoding with this draft model (same vocabulary; its KV in a paged pool "
                                "of its own, with prefix caching).")
PROMPT_LOOKUP = typer.Option(False, "--prompt-lookup", metavar=FLAG, rich_help_panel=SPECULATIVE_PANEL,
                             help="Speculative decoding by n-gram lookup in the prompt and output (no draft model).")
NUM_DRAFT_TOKENS = typer.Option(3, "--num-draft-tokens", min=1, rich_help_panel=SPECULATIVE_PANEL,
                                help="Tokens drafted per step at most.")
NGRAM_SIZE = typer.Option(3, "--ngram-size", min=1, rich_help_panel=SPECULATIVE_PANEL,
                          help="Longest n-gram --prompt-lookup matches.")
