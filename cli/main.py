"""The ``mlxkv`` command line: parse, call the library, print. MLX is imported inside commands only."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from mlxkv.cli.options import (
    check_block_size,
    check_kv_backend,
    check_kv_bits,
    check_min_p,
    check_top_p,
    kv_config,
)

app = typer.Typer(
    name="mlxkv",
    help="Local LLM inference on MLX with a first-class KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Local LLM inference on MLX with a first-class KV cache."""


def _fail(message: str, verbose: bool) -> None:
    """Print one readable line (a traceback too with --verbose) and exit non-zero."""
    if verbose:
        import traceback

        traceback.print_exc()
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def _read_prompt(prompt: str) -> str:
    if prompt == "-":
        return sys.stdin.read()
    return prompt


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or - to read it from standard input."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Hugging Face repo id, local folder or GGUF file "
                                             "(default: the embedded demo model)."),
    dequantize: bool = typer.Option(False, "--dequantize",
                                    help="Run quantized weights unquantized (float32 on CPU: much faster there)."),
    system: Optional[str] = typer.Option(None, help="System message (chat mode)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    temp: float = typer.Option(0.0, min=0.0, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", callback=check_top_p, help="Nucleus sampling mass (0<x<=1)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens; 0 disables."),
    min_p: float = typer.Option(0.0, "--min-p", callback=check_min_p, help="Min-p filter (0<=x<1); 0 disables."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--raw",
                                        help="Apply the chat template (default: when the tokenizer has one)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="A Jinja chat template file used instead of the model's."),
    max_kv_size: Optional[int] = typer.Option(None, "--max-kv-size", min=1,
                                              help="Cap on cached tokens per layer (rotating past it)."),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", callback=check_kv_bits,
                                          help="Quantize the KV cache to 4 or 8 bits."),
    kv_group_size: int = typer.Option(64, "--kv-group-size", min=1, help="Group size for KV quantization."),
    kv_backend: str = typer.Option("dense", "--kv-backend", callback=check_kv_backend,
                                   help="KV storage: dense buffers or paged blocks with prefix caching."),
    kv_block_size: int = typer.Option(16, "--kv-block-size", callback=check_block_size,
                                      help="Tokens per KV block (paged; a power of two 1..256)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model",
                                              help="Speculative decoding with this draft model (same vocabulary)."),
    prompt_lookup: bool = typer.Option(False, "--prompt-lookup",
                                       help="Speculative decoding by n-gram lookup in the prompt (no draft model)."),
    num_draft_tokens: int = typer.Option(3, "--num-draft-tokens", min=1, help="Tokens drafted per round."),
    ngram_size: int = typer.Option(3, "--ngram-size", min=1, help="N-gram length for --prompt-lookup."),
    json_object: bool = typer.Option(False, "--json", help="Constrain the output to a JSON object."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", metavar="FILE",
                                              help="Constrain the output to JSON valid against this JSON schema."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print speed and memory figures; tracebacks on errors."),
) -> None:
    """Generate text from a prompt, streaming tokens as they are produced."""
    if kv_group_size not in (32, 64, 128):
        raise typer.BadParameter(f"{kv_group_size} is not one of 32, 64, 128.", param_hint="--kv-group-size")
    if json_object and json_schema is not None:
        raise typer.BadParameter("--json and --json-schema exclude each other.", param_hint="--json")
    structured = json_object or json_schema is not None
    if structured and (draft_model or prompt_lookup):
        _fail("structured output (--json, --json-schema) does not work with speculative decoding "
              "(--draft-model, --prompt-lookup)", verbose)
    text = _read_prompt(prompt)
    if not text.strip():
        _fail("the prompt is empty", verbose)
    fmt = None
    if structured:
        from mlxkv.structured import json_object_format, schema_file_format

        try:
            fmt = json_object_format() if json_object else schema_file_format(json_schema)
        except ValueError as exc:
            _fail(str(exc), verbose)
    try:
        from mlxkv import env
        from mlxkv.config import RunConfig, SpeculativeConfig
        from mlxkv.engine.build import build_engine
        from mlxkv.engine.sampling import SamplingParams
        from mlxkv.models import ModelLoadError, load
        from mlxkv.prompt import encode_prompt
    except ImportError as exc:  # a broken install should still end in one line
        _fail(f"mlxkv is not installed correctly: {exc}", verbose)

    try:
        kv = kv_config(backend=kv_backend, block_size=kv_block_size, max_kv_size=max_kv_size, kv_bits=kv_bits,
                       kv_group_size=kv_group_size)
        speculative = SpeculativeConfig(draft_model=draft_model, prompt_lookup=prompt_lookup,
                                        num_draft_tokens=num_draft_tokens, ngram_size=ngram_size)
        run = RunConfig(model=model, dequantize=dequantize, kv=kv, speculative=speculative, flags=env.flags(),
                        chat_template=chat_template)
        params = SamplingParams(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                                seed=seed, stop=tuple(stop or ()))
        loaded = load(run.model, dequantize=run.dequantize, chat_template=run.chat_template)
        tokens = encode_prompt(loaded.tokenizer, text, system=system, chat=chat)
        engine = build_engine(loaded, run, context_tokens=len(tokens) + max_tokens)
        processors = ()
        if fmt is not None:
            from mlxkv.structured.constraint import make_constraint

            processors = (make_constraint(fmt, loaded.tokenizer),)
        output = []
        for chunk in engine.generate(tokens, params, logits_processors=processors):
            output.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if fmt is not None:
            from mlxkv.structured.constraint import is_complete_document

            complete = is_complete_document(fmt, loaded.tokenizer, "".join(output))
    except (ModelLoadError, ValueError, RuntimeError) as exc:
        _fail(str(exc), verbose)
    if fmt is not None and not complete:
        _fail("the JSON output is incomplete: generation stopped at --max-tokens or a --stop string before the "
              "document was closed", verbose)
    if verbose:
        s = engine.last_stats
        typer.echo(
            f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
            f"generation: {s.generation_tokens} tokens, {s.generation_tps:.1f} tok/s | "
            f"peak memory: {s.peak_memory_bytes / 1e9:.3f} GB | KV cache: {s.kv_bytes / 1e6:.2f} MB",
            err=True,
        )
        if getattr(s, "cached_prompt_tokens", 0):
            typer.echo(f"prefix cache: {s.cached_prompt_tokens} of {s.prompt_tokens} prompt tokens reused", err=True)
        if hasattr(s, "acceptance_rate"):
            typer.echo(f"speculative: acceptance {s.acceptance_rate:.1%}, "
                       f"{s.tokens_per_forward:.2f} tokens per target forward", err=True)


@app.command()
def convert(
    gguf_file: str = typer.Argument(..., help="The GGUF file to convert."),
    out_dir: str = typer.Argument(..., help="Folder to write (must not exist, or be empty)."),
    dequantize: bool = typer.Option(False, "--dequantize",
                                    help="Write quantized weights unquantized (float32 on the CPU backend)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Tracebacks on errors."),
) -> None:
    """Write a GGUF model as a Hugging Face folder (config, safetensors, tokenizer) that mlx-lm loads too."""
    from pathlib import Path

    from mlxkv.gguf import GGUFError, is_gguf
    from mlxkv.gguf import convert as convert_gguf

    source = Path(gguf_file).expanduser()
    if not source.is_file() or not is_gguf(source):
        _fail(f"not a GGUF file: {gguf_file}", verbose)
    try:
        out = convert_gguf(source, out_dir, dequantize=dequantize)
    except GGUFError as exc:
        _fail(str(exc), verbose)
    typer.echo(f"wrote {out}")


from mlxkv.cli.cache import cache_app  # noqa: E402  (registered after generate: help lists generate first)
from mlxkv.cli.chat import chat  # noqa: E402
from mlxkv.cli.serve import serve  # noqa: E402

app.command()(serve)
app.command()(chat)
app.add_typer(cache_app, name="cache", help="Inspect and clear on-disk KV caches; stats of a running server.")


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
