"""The ``mlxkv`` command line: parse, call the library, print. MLX is imported inside commands only."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from mlxkv.cli import shared_options as options
from mlxkv.cli.errors import Command, OneLineErrors
from mlxkv.cli.interrupt import StopOnCtrlC
from mlxkv.cli.logprobs import print_logprobs
from mlxkv.cli.options import (
    FLAG,
    MODEL_PANEL,
    OUTPUT_PANEL,
    kv_config,
    overflow_config,
    sampling_defaults,
    with_revision,
)
from mlxkv.cli.validate import (
    add_extra_eos,
    check_draft_model,
    check_files_option,
    check_utf8,
    read_prompt,
    read_prompt_file,
    refuse_unused,
    refuse_useless_dequantize,
    unused_sampling,
)

app = typer.Typer(
    name="mlxkv",
    cls=OneLineErrors,
    help="Local LLM inference on MLX with a first-class KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"mlxkv {version('mlxkv')}")
        except PackageNotFoundError:
            typer.echo("mlxkv (not installed: running from a source tree)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", metavar=FLAG, callback=_version, is_eager=True,
                                      help="Print the version and exit."),
) -> None:
    """Local LLM inference on MLX with a first-class KV cache."""


def _fail(message: str, verbose: bool) -> None:
    """Print one readable line (a traceback too with --verbose) and exit non-zero."""
    if verbose:
        import traceback

        traceback.print_exc()
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def _quiet_length_warning(tokenizer) -> None:
    """Mark transformers' "sequence length is longer than the maximum" warning as given: :func:`_check_context`
    says it in one line of ours instead."""
    warned = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True


def _check_context(loaded, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a prompt the model's context cannot hold; warn when the answer may run past the context."""
    from mlxkv.engine.batch import context_length_of

    limit = context_length_of(loaded.config)
    if limit is None:
        return
    if prompt_tokens >= limit:
        raise ValueError(f"the prompt is {prompt_tokens} tokens, but {loaded.name} has a context of {limit} tokens "
                         "(max_position_embeddings): shorten the prompt")
    if prompt_tokens + max_tokens > limit:
        typer.echo(f"warning: the prompt ({prompt_tokens} tokens) and --max-tokens {max_tokens} go past the model's "
                   f"context of {limit} tokens; text past it may degrade", err=True)


@app.command(cls=Command)
def generate(
    ctx: typer.Context,
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT", show_default=False,
                                           help="The prompt text, or - to read it from standard input."),
    prompt_option: Optional[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", callback=check_utf8,
                                                rich_help_panel=MODEL_PANEL,
                                                help="The prompt, as an option (mlx-lm's spelling); - reads stdin."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", metavar="FILE", callback=check_utf8,
                                              rich_help_panel=MODEL_PANEL,
                                              help="Read the prompt from this UTF-8 text file."),
    model: Optional[str] = options.MODEL,
    revision: Optional[str] = options.REVISION,
    dequantize: bool = options.DEQUANTIZE,
    adapter_path: Optional[str] = options.ADAPTER_PATH,
    chat: bool = typer.Option(False, "--chat", metavar=FLAG, rich_help_panel=MODEL_PANEL,
                              help="Apply the chat template (the default when the tokenizer has one)."),
    raw: bool = typer.Option(False, "--raw", metavar=FLAG, rich_help_panel=MODEL_PANEL,
                             help="Encode the prompt as it is."),
    system: Optional[str] = options.SYSTEM,
    prefill_response: Optional[str] = typer.Option(None, "--prefill-response", metavar="TEXT", callback=check_utf8,
                                                   rich_help_panel=MODEL_PANEL,
                                                   help="Start the answer with this text (chat mode): the model "
                                                        "continues it."),
    chat_template: Optional[str] = options.CHAT_TEMPLATE,
    max_tokens: int = options.MAX_TOKENS,
    temp: float = options.TEMP,
    top_p: float = options.TOP_P,
    top_k: int = options.TOP_K,
    min_p: float = options.MIN_P,
    seed: Optional[int] = options.SEED,
    stop: Optional[list[str]] = options.STOP,
    repetition_penalty: Optional[float] = options.REPETITION_PENALTY,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    extra_eos_token: Optional[list[str]] = options.EXTRA_EOS_TOKEN,
    kv_backend: str = options.KV_BACKEND,
    max_kv_size: Optional[int] = options.MAX_KV_SIZE,
    kv_bits: Optional[int] = options.KV_BITS,
    kv_group_size: int = options.KV_GROUP_SIZE,
    kv_overflow: str = options.KV_OVERFLOW,
    kv_overflow_budget: Optional[int] = options.KV_OVERFLOW_BUDGET,
    kv_overflow_sinks: Optional[int] = options.KV_OVERFLOW_SINKS,
    kv_overflow_recent: Optional[int] = options.KV_OVERFLOW_RECENT,
    kv_block_size: int = options.KV_BLOCK_SIZE,
    state_snapshot_interval: int = options.STATE_SNAPSHOT_INTERVAL,
    draft_model: Optional[str] = options.DRAFT_MODEL,
    prompt_lookup: bool = options.PROMPT_LOOKUP,
    num_draft_tokens: int = options.NUM_DRAFT_TOKENS,
    ngram_size: int = options.NGRAM_SIZE,
    logprobs: Optional[int] = typer.Option(None, "--logprobs", min=0, max=20, metavar="N",
                                           rich_help_panel=OUTPUT_PANEL,
                                           help="After the answer, print each token's log-probability and its N "
                                                "most likely alternatives on stderr (0-20)."),
    json_object: bool = typer.Option(False, "--json", metavar=FLAG, rich_help_panel=OUTPUT_PANEL,
                                     help="Constrain the output to a JSON object."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", metavar="FILE", rich_help_panel=OUTPUT_PANEL,
                                              help="Constrain the output to JSON valid against this JSON schema."),
    image: Optional[list[str]] = typer.Option(None, "--image", metavar="FILE", callback=check_files_option,
                                              help="An image the prompt asks about (repeatable; a vision-language "
                                                   "model, with the vision extra: pip install \"mlxkv[vision]\")."),
    verbose: bool = options.VERBOSE,
    distributed: str = options.DISTRIBUTED,
) -> None:
    """Generate text from a prompt, streaming tokens as they are produced."""
    if chat and raw:
        raise typer.BadParameter("--chat and --raw exclude each other", param_hint="--chat")
    if sum(p is not None for p in (prompt, prompt_option, prompt_file)) > 1:
        raise typer.BadParameter("give the prompt once: as the argument, with --prompt or with --prompt-file",
                                 param_hint="--prompt")
    prompt = prompt if prompt is not None else prompt_option
    if prompt is None and prompt_file is None:
        raise typer.BadParameter("no prompt: give it as the argument, with -p TEXT, or - to read standard input",
                                 param_hint="PROMPT")
    refuse_unused(ctx, [*unused_sampling(temp),
                        ("num_draft_tokens", "--num-draft-tokens", bool(draft_model) or prompt_lookup),
                        ("ngram_size", "--ngram-size", prompt_lookup),
                        ("kv_group_size", "--kv-group-size", kv_bits is not None),
                        ("kv_block_size", "--kv-block-size", kv_backend == "paged"),
                        ("state_snapshot_interval", "--state-snapshot-interval", kv_backend == "paged")])
    model = with_revision(model, revision)
    if json_object and json_schema is not None:
        raise typer.BadParameter("--json and --json-schema exclude each other.", param_hint="--json")
    structured = json_object or json_schema is not None
    if image and (draft_model or prompt_lookup or raw or distributed != "off"):
        _fail("--image works with the chat template on one process, without speculative decoding", verbose)
    if logprobs is not None and (draft_model or prompt_lookup):
        _fail("--logprobs does not work with speculative decoding (--draft-model, --prompt-lookup)", verbose)
    try:
        text = read_prompt(prompt) if prompt_file is None else read_prompt_file(prompt_file)
    except ValueError as exc:
        _fail(str(exc), verbose)
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
        from mlxkv.prompt import encode_prompt, response_primer
    except ImportError as exc:  # a broken install should still end in one line
        _fail(f"mlxkv is not installed correctly: {exc}", verbose)
    from mlxkv.distributed.generate import GenerateRanks
    from mlxkv.engine.prefill import PrefillStopped

    if adapter_path is not None and distributed != "off":
        _fail("--adapter-path: a LoRA adapter runs on one process: drop --distributed", verbose)
    try:
        ranks = GenerateRanks(distributed)
    except ValueError as exc:
        _fail(str(exc), verbose)
    ranks.quiet_followers()
    from mlxkv.cli.models import remember_gguf

    kv = kv_config(backend=kv_backend, block_size=kv_block_size, max_kv_size=max_kv_size, kv_bits=kv_bits,
                   kv_group_size=kv_group_size, state_snapshot_interval=state_snapshot_interval,
                   overflow=overflow_config(kv_overflow, kv_overflow_budget, kv_overflow_sinks, kv_overflow_recent))
    sampling = sampling_defaults(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens,
                                 repetition_penalty=repetition_penalty, chat_template_kwargs=chat_template_kwargs)
    if chat_template_kwargs is not None and raw:
        raise typer.BadParameter("applies to the chat template: drop --raw", param_hint="--chat-template-kwargs")
    if draft_model:
        try:
            check_draft_model(draft_model)
        except ValueError as exc:
            _fail(str(exc), verbose)
    try:
        speculative = SpeculativeConfig(draft_model=draft_model, prompt_lookup=prompt_lookup,
                                        num_draft_tokens=num_draft_tokens, ngram_size=ngram_size)
        run = RunConfig(model=model, dequantize=dequantize, kv=kv, speculative=speculative, flags=env.flags(),
                        chat_template=chat_template, adapter_path=adapter_path)
        params = SamplingParams(max_tokens=sampling.max_tokens, temp=sampling.temp, top_p=sampling.top_p,
                                top_k=sampling.top_k, min_p=sampling.min_p, seed=ranks.seed(seed, temp > 0),
                                stop=tuple(stop or ()), repetition_penalty=sampling.repetition_penalty)
        loaded = load(run.model, dequantize=run.dequantize, chat_template=run.chat_template,
                      adapter_path=run.adapter_path)
        ranks.shard(loaded)
        remember_gguf(loaded)
        refuse_useless_dequantize(loaded, dequantize)
        add_extra_eos(loaded.tokenizer, extra_eos_token)
        _quiet_length_warning(loaded.tokenizer)
        media: tuple = ()
        if image:
            from mlxkv.vision.inputs import images_from_files

            vision, request_images = images_from_files(image, loaded)
            text = vision.marker * len(image) + text  # the images, then the question
        tokens = encode_prompt(loaded.tokenizer, text, system=system, chat=True if chat else False if raw else None,
                               template_kwargs=sampling.chat_template_kwargs)
        if image:
            tokens, media = vision.expand(tokens, request_images)
        primer = response_primer(loaded.tokenizer, prefill_response, raw=raw)
        tokens += primer
        _check_context(loaded, len(tokens), max_tokens)
        try:
            engine = build_engine(loaded, run, context_tokens=len(tokens) + max_tokens,
                                  seeded_sampling=params.temp > 0 and params.seed is not None)
        except ModelLoadError as exc:
            raise ModelLoadError(f"--draft-model {draft_model}: {exc}" if draft_model else str(exc)) from None
        output, finish, probabilities = [], None, []
        extra = {"logprobs": logprobs} if logprobs is not None else {}
        if media:
            extra["media"] = media
        with StopOnCtrlC() as stopped:
            try:
                # Distributed ranks must run the same forwards: no rank stops or sizes its chunks on its own.
                for chunk in engine.generate(tokens, params, response_format=fmt, primer=primer,
                                             should_stop=stopped if ranks.group is None else None, **extra):
                    output.append(chunk.text)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    finish = chunk.finish_reason
                    probabilities.append(chunk.logprob)
            except PrefillStopped:
                pass  # Ctrl-C before the first token: nothing to show
        sys.stdout.write("\n")  # the shell's prompt starts on a line of its own, however the text ended
        sys.stdout.flush()
        if logprobs is not None and ranks.rank == 0:
            print_logprobs(probabilities, loaded.tokenizer)
        interrupted = stopped()
        complete = True
        if fmt is not None:
            from mlxkv.structured.constraint import is_complete_document

            complete = is_complete_document(fmt, loaded.tokenizer, "".join(output))
        if finish == "length" and ranks.rank == 0 and complete:  # an incomplete document has its own error
            typer.echo(f"[cut at --max-tokens {max_tokens}]", err=True)
    except (ModelLoadError, ValueError, RuntimeError) as exc:
        _fail(str(exc), verbose)
    if interrupted:
        raise typer.Exit(code=130)  # as a shell reports a command ended by Ctrl-C
    if not complete:
        _fail("the JSON output is incomplete: generation stopped at --max-tokens or a --stop string before the "
              "document was closed", verbose)
    if verbose and ranks.rank == 0:
        s = engine.last_stats
        typer.echo(
            f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
            f"generation: {s.generation_tokens} tokens, {s.generation_tps:.1f} tok/s | "
            f"peak memory: {s.peak_memory_bytes / 1e9:.3f} GB | KV cache: {s.kv_bytes / 1e6:.2f} MB",
            err=True,
        )
        if getattr(s, "cached_prompt_tokens", 0):
            typer.echo(f"prefix cache: {s.cached_prompt_tokens} of {s.prompt_tokens} prompt tokens reused", err=True)
        if s.speculative:
            typer.echo(f"speculative: acceptance {s.acceptance_rate:.1%} ({s.accepted_tokens} of {s.drafted_tokens} "
                       f"proposed), {s.tokens_per_forward:.2f} tokens per target forward", err=True)


@app.command(cls=Command)
def convert(
    gguf_file: str = typer.Argument(..., metavar="GGUF_FILE", help="The GGUF file to convert."),
    out_dir: str = typer.Argument(..., metavar="OUT_DIR", help="Folder to write (must not exist, or be empty)."),
    dequantize: bool = typer.Option(False, "--dequantize", metavar=FLAG,
                                    help="Write quantized weights unquantized (float32 on the CPU backend)."),
    quantize: bool = typer.Option(False, "--quantize", "-q", metavar=FLAG,
                                  help="Write the weights quantized by mlx-lm's quantizer (as mlx_lm.convert -q)."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", metavar="BITS",
                                         help="With -q: bits per weight, 2, 3, 4, 5, 6 or 8 (default 4)."),
    q_group_size: Optional[int] = typer.Option(None, "--q-group-size", metavar="N",
                                               help="With -q: weights per quantization group, 32, 64 or 128 "
                                                    "(default 64)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", metavar=FLAG, help="Tracebacks on errors."),
) -> None:
    """Write a GGUF model as a Hugging Face folder (config, safetensors, tokenizer) that mlx-lm loads too."""
    if quantize and dequantize:
        raise typer.BadParameter("-q and --dequantize exclude each other", param_hint="--quantize")
    for value, name, allowed in ((q_bits, "--q-bits", (2, 3, 4, 5, 6, 8)), (q_group_size, "--q-group-size", (32, 64, 128))):
        if value is not None and not quantize:
            raise typer.BadParameter(f"{name} applies to -q (--quantize) only", param_hint=name)
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value} is not one of {', '.join(map(str, allowed))}", param_hint=name)
    from pathlib import Path

    from mlxkv.gguf import GGUFError, is_gguf
    from mlxkv.gguf import convert as convert_gguf

    source = Path(gguf_file).expanduser()
    if not source.exists():
        _fail(f"no such file: {gguf_file}", verbose)
    if not source.is_file() or not is_gguf(source):
        _fail(f"{gguf_file} is {'a folder' if source.is_dir() else 'not a GGUF file'}: convert takes a GGUF file",
              verbose)
    try:
        out = convert_gguf(source, out_dir, dequantize=dequantize,
                           quantize=(int(q_bits or 4), int(q_group_size or 64)) if quantize else None)
    except GGUFError as exc:
        _fail(str(exc), verbose)
    typer.echo(f"wrote {out}")


from mlxkv.cli.cache import cache_app  # noqa: E402  (registered after generate: help lists generate first)
from mlxkv.cli.chat import chat  # noqa: E402
from mlxkv.cli.serve import serve  # noqa: E402
from mlxkv.cli.top import top  # noqa: E402

from mlxkv.cli.models import models_app  # noqa: E402
from mlxkv.cli.pull import pull  # noqa: E402
from mlxkv.cli.show import show  # noqa: E402

app.command(cls=Command)(serve)
app.add_typer(models_app, name="models", help="List the models on this machine (Hugging Face cache, GGUF files "
                                              "used before) with sizes; rm deletes one.")
app.command(cls=Command)(chat)
app.command(cls=Command)(show)
app.command(cls=Command)(pull)
app.add_typer(cache_app, name="cache", help="Inspect and clear on-disk KV caches; stats of a running server.")
app.command(cls=Command)(top)


def main() -> None:  # pragma: no cover - entry point
    """The ``mlxkv`` program. After Ctrl-C (exit status 130) the process ends without tearing down its objects:
    freeing a loaded model takes the better part of a second, and Ctrl-C asks for the shell back now."""
    try:
        app(prog_name="mlxkv")
    except SystemExit as exc:
        if exc.code == 130:
            import os

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
