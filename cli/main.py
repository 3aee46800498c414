"""The ``mlxkv`` command line: parse, call the library, print. MLX is imported inside commands only."""

from __future__ import annotations

import sys
from typing import Optional

import typer

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


def _check_top_p(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter(f"{value} is not in the range 0<x<=1.")
    return value


def _check_min_p(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise typer.BadParameter(f"{value} is not in the range 0<=x<1.")
    return value


def _check_kv_bits(value: Optional[int]) -> Optional[int]:
    if value is not None and value not in (4, 8):
        raise typer.BadParameter(f"{value} is not one of 4, 8.")
    return value


def _read_prompt(prompt: str) -> str:
    if prompt == "-":
        return sys.stdin.read()
    return prompt


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or - to read it from standard input."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Hugging Face repo id or local folder (default: the embedded demo model)."),
    system: Optional[str] = typer.Option(None, help="System message (chat mode)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    temp: float = typer.Option(0.0, min=0.0, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", callback=_check_top_p, help="Nucleus sampling mass (0<x<=1)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens; 0 disables."),
    min_p: float = typer.Option(0.0, "--min-p", callback=_check_min_p, help="Min-p filter (0<=x<1); 0 disables."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--raw",
                                        help="Apply the chat template (default: when the tokenizer has one)."),
    max_kv_size: Optional[int] = typer.Option(None, "--max-kv-size", min=1,
                                              help="Cap on cached tokens per layer (rotating past it)."),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", callback=_check_kv_bits,
                                          help="Quantize the KV cache to 4 or 8 bits."),
    kv_group_size: int = typer.Option(64, "--kv-group-size", min=1, help="Group size for KV quantization."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print speed and memory figures; tracebacks on errors."),
) -> None:
    """Generate text from a prompt, streaming tokens as they are produced."""
    if kv_group_size not in (32, 64, 128):
        raise typer.BadParameter(f"{kv_group_size} is not one of 32, 64, 128.", param_hint="--kv-group-size")
    text = _read_prompt(prompt)
    if not text.strip():
        _fail("the prompt is empty", verbose)
    try:
        from mlxkv.engine.direct import DirectEngine
        from mlxkv.engine.sampling import SamplingParams
        from mlxkv.models import ModelLoadError, load
        from mlxkv.pool import CachePool
        from mlxkv.prompt import encode_prompt
    except ImportError as exc:  # a broken install should still end in one line
        _fail(f"mlxkv is not installed correctly: {exc}", verbose)

    try:
        loaded = load(model)
    except ModelLoadError as exc:
        _fail(str(exc), verbose)
    try:
        params = SamplingParams(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                                seed=seed, stop=tuple(stop or ()))
        tokens = encode_prompt(loaded.tokenizer, text, system=system, chat=chat)
        pool = CachePool(loaded.model, max_sequences=1, max_kv_size=max_kv_size, kv_bits=kv_bits,
                         kv_group_size=kv_group_size)
        engine = DirectEngine(loaded.model, loaded.tokenizer, pool=pool)
        for chunk in engine.generate(tokens, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (ValueError, RuntimeError) as exc:
        _fail(str(exc), verbose)
    if verbose:
        s = engine.last_stats
        typer.echo(
            f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
            f"generation: {s.generation_tokens} tokens, {s.generation_tps:.1f} tok/s | "
            f"peak memory: {s.peak_memory_bytes / 1e9:.3f} GB | KV cache: {s.kv_bytes / 1e6:.2f} MB",
            err=True,
        )


from mlxkv.cli.serve import serve  # noqa: E402  (registered after generate: help lists generate first)

app.command()(serve)


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
