"""``mlxkv serve``: the OpenAI-compatible server (the lead registers :func:`serve` on the main Typer app).

Thin: parse options, build the server (:func:`mlxkv.server.runner.build`), run uvicorn until a signal
(:mod:`mlxkv.server.shutdown`: a graceful stop that saves the KV tier). MLX, FastAPI and the
model are imported inside the command so ``mlxkv --help`` stays instant.
"""

from __future__ import annotations

from typing import Optional

import typer
from mlxkv.cli.options import (
    check_cache_layout,
    check_kv_backend,
    check_kv_bits,
    check_min_p,
    check_top_p,
    kv_config,
    sampling_defaults,
)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Hugging Face repo id, local folder or GGUF file (default: the demo model)."),
    dequantize: bool = typer.Option(False, "--dequantize",
                                    help="Run quantized weights unquantized (float32 on CPU: much faster there)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8080, min=0, max=65535, help="Port to listen on."),
    max_sequences: int = typer.Option(8, "--max-sequences", min=1, help="Most sequences decoding at once."),
    max_queue_depth: int = typer.Option(64, "--max-queue-depth", min=1,
                                        help="Most requests waiting for admission; more get HTTP 429."),
    prefill_chunk_size: int = typer.Option(512, "--prefill-chunk-size", min=1,
                                           help="Most prompt tokens prefilled per engine step."),
    batched_prefill: bool = typer.Option(False, "--batched-prefill",
                                         help="Prefill the short prompt chunks of requests admitted together in "
                                              "one forward (checked against one-by-one at start)."),
    api_key: Optional[str] = typer.Option(None, "--api-key",
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes "
                                               "(default: the MLXKV_API_KEY environment variable)."),
    max_kv_size: Optional[int] = typer.Option(None, "--max-kv-size", min=1,
                                              help="Cap on cached tokens per layer (rotating past it)."),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", callback=check_kv_bits,
                                          help="Quantize the KV cache to 4 or 8 bits."),
    kv_group_size: int = typer.Option(64, "--kv-group-size", min=1, help="Group size for KV quantization."),
    layout: str = typer.Option("mlxkv", "--cache-layout", callback=check_cache_layout,
                               help="KV cache layouts: mlxkv (default) or mlx-lm (for comparison)."),
    kv_backend: str = typer.Option("paged", "--kv-backend", callback=check_kv_backend,
                                   help="KV storage: paged (default; block pool with prefix caching) or dense."),
    kv_block_size: int = typer.Option(16, "--kv-block-size", min=1, help="Tokens per KV block (paged)."),
    kv_cache_budget: Optional[int] = typer.Option(
        None, "--kv-cache-budget", min=1,
        help="Bytes for KV blocks (paged; default: max-sequences full contexts, at most half the free memory)."),
    host_cache_size: int = typer.Option(0, "--host-cache-size", min=0,
                                        help="Bytes of host memory for evicted KV blocks (paged secondary tier)."),
    kv_disk_cache: Optional[str] = typer.Option(None, "--kv-disk-cache",
                                                help="Folder for an on-disk KV block tier (paged; survives restarts)."),
    kv_disk_cache_size: int = typer.Option(0, "--kv-disk-cache-size", min=0,
                                           help="Byte cap of the on-disk KV tier (needs --kv-disk-cache)."),
    kv_disk_write_interval: float = typer.Option(
        2.0, "--kv-disk-write-interval", min=0.0, max=3600.0,
        help="Seconds between writes of newly cached KV blocks to the disk tier (what a crash can lose; 0: only "
             "evicted blocks and the flush at stop)."),
    kv_disk_flush_timeout: float = typer.Option(
        10.0, "--kv-disk-flush-timeout", min=0.0,
        help="Seconds a graceful stop (SIGTERM/SIGINT) may spend writing cached KV blocks to the disk tier."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="A Jinja chat template file used instead of the model's "
                                                     "(e.g. one that renders tools)."),
    tool_parser: Optional[str] = typer.Option(None, "--tool-parser",
                                              help="mlx-lm tool parser for the model's tool calls (default: the one "
                                                   "mlx-lm infers from the chat template), e.g. json_tools."),
    allowed_origins: Optional[list[str]] = typer.Option(None, "--allowed-origins",
                                                        help="CORS: origins browsers may call from (repeatable or "
                                                             "comma-separated; * for any; default: no CORS)."),
    sse_keepalive_s: float = typer.Option(10.0, "--sse-keepalive-s", min=0.01,
                                          help="Seconds a stream may stay silent (a long prefill) before a "
                                               "keep-alive comment is sent."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id reported by /v1/models (default: --model)."),
    metrics_key: Optional[str] = typer.Option(
        None, "--metrics-key",
        help="Require 'Authorization: Bearer KEY' (or the API key) on /metrics, /docs, /redoc and /openapi.json "
             "(default: open)."),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", min=0.001, help="Largest request body (MB); else 413."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    switch_interval_ms: float = typer.Option(0.5, "--switch-interval-ms", min=0.01,
                                             help="GIL switch interval of the server process (ms): how long the "
                                                  "HTTP event loop may wait for the engine thread."),
    temp: float = typer.Option(1.0, "--temp", min=0.0, max=2.0,
                               help="Default sampling temperature (0 is greedy); a request's own value wins."),
    top_p: float = typer.Option(1.0, "--top-p", callback=check_top_p, help="Default nucleus sampling mass (0<x<=1)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Default top-k (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", callback=check_min_p, help="Default min-p (0<=x<1; 0 = off)."),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", help="Default repetition penalty (> 0; mlx-lm's, over the last 20 tokens)."),
    max_tokens: Optional[int] = typer.Option(
        None, "--max-tokens", min=1,
        help="Default most tokens per completion (default: the rest of the context for chat, 16 for completions)."),
    chat_template_kwargs: Optional[str] = typer.Option(
        None, "--chat-template-kwargs",
        help='JSON object of extra chat template variables for every request, e.g. \'{"enable_thinking": false}\' '
             "(a request's chat_template_kwargs keys win)."),
) -> None:
    """Serve the OpenAI API (chat, completions, streaming) over a continuous-batching engine."""
    if kv_group_size not in (32, 64, 128):
        raise typer.BadParameter(f"{kv_group_size} is not one of 32, 64, 128.", param_hint="--kv-group-size")
    from mlxkv import env
    from mlxkv.server.compat import parse_origins

    try:
        flags = env.flags()  # a bad MLXKV_* value is one line, before the model loads
        origins = parse_origins(allowed_origins)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    key = api_key or flags.api_key
    if host not in _LOOPBACK and key is None:
        typer.echo(f"warning: serving on {host} without an API key: anyone who can reach it can use it", err=True)
    try:
        from mlxkv.config import EngineConfig, RunConfig
        from mlxkv.models import ModelLoadError
        from mlxkv.server.runner import build, set_switch_interval
        from mlxkv.server.shutdown import serve_until_signalled
    except ImportError as exc:
        typer.echo(f"error: the server needs its extras (pip install 'mlxkv[serve]'): {exc}", err=True)
        raise typer.Exit(code=1) from None
    try:
        kv = kv_config(backend=kv_backend, block_size=kv_block_size, max_kv_size=max_kv_size, kv_bits=kv_bits,
                       kv_group_size=kv_group_size, layout=layout, budget=kv_cache_budget,
                       host_cache_bytes=host_cache_size, disk_cache_dir=kv_disk_cache,
                       disk_cache_bytes=kv_disk_cache_size, disk_write_interval_s=kv_disk_write_interval)
        engine = EngineConfig(max_sequences=max_sequences, max_queue_depth=max_queue_depth,
                              prefill_chunk_size=prefill_chunk_size, batched_prefill=batched_prefill)
        sampling = sampling_defaults(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                                     repetition_penalty=repetition_penalty, max_tokens=max_tokens,
                                     chat_template_kwargs=chat_template_kwargs)
        run = RunConfig(model=model, dequantize=dequantize, kv=kv, engine=engine, sampling=sampling, flags=flags,
                        chat_template=chat_template, tool_parser=tool_parser)
        parts = build(run, api_key=key, max_body_bytes=int(max_body_mb * 1024 * 1024), model_name=served_model_name,
                      allowed_origins=origins, keepalive_s=sse_keepalive_s, flush_timeout_s=kv_disk_flush_timeout,
                      metrics_key=metrics_key)
    except (ModelLoadError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    set_switch_interval(switch_interval_ms / 1000)
    typer.echo(f"mlxkv serve: {parts.loaded.name} on http://{host}:{port} "
               f"(max {max_sequences} sequences, queue {max_queue_depth}, {kv_backend} KV)", err=True)
    serve_until_signalled(parts.app, parts.engine, host=host, port=port, log_level=log_level)
    flushed = parts.engine.last_flush
    if flushed:
        typer.echo(f"mlxkv serve: KV tier saved: {flushed['on_disk']} block(s) on disk ({flushed['written']} written "
                   f"at stop, {flushed['seconds']:.2f} s)"
                   + (f", {flushed['lost']} not written (--kv-disk-flush-timeout)" if flushed["lost"] else ""),
                   err=True)
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()  # MLX asks each thread that used it to clean up, else the process may abort at exit
