"""``mlxkv serve``: the OpenAI-compatible server (the lead registers :func:`serve` on the main Typer app).

Thin: parse options, build the server (:func:`mlxkv.server.runner.build`), run uvicorn until a signal
(:mod:`mlxkv.server.shutdown`: a graceful stop that saves the KV tier). MLX, FastAPI and the
model are imported inside the command so ``mlxkv --help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from mlxkv import rules
from mlxkv.cli import shared_options as options
from mlxkv.cli.options import (
    FLAG,
    KV_PANEL,
    MODEL_PANEL,
    SERVER_PANEL,
    check_log_level,
    from_rule,
    kv_config,
    overflow_config,
    parse_size,
    sampling_defaults,
    with_revision,
)
from mlxkv.cli.validate import (check_draft_model, check_file_option, check_folder_option, given, refuse_unused,
                                refuse_useless_dequantize)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SIZE_HELP = "SIZE: bytes or with a unit, e.g. 512MB, 8GB, 8GiB"


def serve(
    ctx: typer.Context,
    model: Optional[list[str]] = typer.Option(
        None, "--model", "-m", metavar="[NAME=]MODEL", rich_help_panel=MODEL_PANEL,
        help="Hugging Face repo id (owner/name or owner/name@revision), local folder or GGUF file (default: the "
             "embedded demo model). Repeatable: each request's 'model' picks one, by NAME (default: the folder's "
             "name, the file's stem or the repo id); the first answers requests that name none."),
    models_file: Optional[str] = typer.Option(
        None, "--models-file", metavar="FILE", callback=check_file_option, rich_help_panel=MODEL_PANEL,
        help="File of models to serve, one [NAME=]MODEL per line (# comments), after those given with -m."),
    max_loaded_models: Optional[int] = typer.Option(
        None, "--max-loaded-models", min=1, metavar="N", rich_help_panel=MODEL_PANEL,
        help="With several models: most loaded at once (default: all); a request for another unloads the least "
             "recently used idle one. Models load at their first request (the first one at start)."),
    revision: Optional[str] = options.REVISION,
    dequantize: bool = options.DEQUANTIZE,
    adapter_path: Optional[str] = options.ADAPTER_PATH,
    chat_template: Optional[str] = options.CHAT_TEMPLATE,
    tool_parser: Optional[str] = typer.Option(None, "--tool-parser", rich_help_panel=MODEL_PANEL,
                                              help="mlx-lm tool parser for the model's tool calls (default: the one "
                                                   "mlx-lm infers from the chat template), e.g. json_tools."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", rich_help_panel=MODEL_PANEL,
                                                    help="Model id reported by /v1/models (default: --model; "
                                                         "several models: -m NAME=MODEL)."),
    host: str = typer.Option("127.0.0.1", rich_help_panel=SERVER_PANEL,
                             help="Address to bind (loopback by default; :: for every IPv6 and IPv4 address)."),
    port: int = typer.Option(8080, min=0, max=65535, rich_help_panel=SERVER_PANEL,
                             help="Port to listen on (0: one the system picks, printed at start)."),
    api_key: Optional[list[str]] = typer.Option(
        None, "--api-key", metavar="KEY", rich_help_panel=SERVER_PANEL,
        help="Require 'Authorization: Bearer KEY' on /v1 routes (default: the MLXKV_API_KEY environment variable). "
             "Repeatable: each key is its own tenant, whose cached prompts no other key reaches; one key: one "
             "tenant, its clients share the prefix cache."),
    api_keys_file: Optional[str] = typer.Option(
        None, "--api-keys-file", metavar="FILE", rich_help_panel=SERVER_PANEL,
        help="File of 'TENANT: KEY' lines (# comments): each key's tenant; several tenants are isolated from "
             "each other in the prefix cache."),
    public_metrics: bool = typer.Option(False, "--public-metrics", metavar=FLAG, rich_help_panel=SERVER_PANEL,
                                        help="Leave /metrics open on a server with API keys (default: it needs a "
                                             "key, as /docs and /openapi.json do)."),
    allowed_origins: Optional[list[str]] = typer.Option(None, "--allowed-origins", rich_help_panel=SERVER_PANEL,
                                                        help="CORS: origins browsers may call from (repeatable or "
                                                             "comma-separated; * for any; default: no CORS)."),
    allowed_image_dir: Optional[list[str]] = typer.Option(
        None, "--allowed-image-dir", metavar="DIR", rich_help_panel=SERVER_PANEL,
        help="A folder whose images requests may name as file:// URLs (repeatable; default: none, data URLs only)."),
    max_sequences: int = typer.Option(8, "--max-sequences", min=1, rich_help_panel=SERVER_PANEL,
                                      help="Most sequences decoding at once."),
    max_queue_depth: int = typer.Option(64, "--max-queue-depth", min=1, rich_help_panel=SERVER_PANEL,
                                        help="Most requests waiting for admission; more get HTTP 429."),
    prefill_chunk_size: int = typer.Option(512, "--prefill-chunk-size", min=1, rich_help_panel=SERVER_PANEL,
                                           help="Most prompt tokens prefilled per engine step."),
    batched_prefill: bool = typer.Option(False, "--batched-prefill", metavar=FLAG, rich_help_panel=SERVER_PANEL,
                                         help="Prefill the short prompt chunks of requests admitted together in "
                                              "one forward (checked against one-by-one at start)."),
    no_ui: bool = typer.Option(False, "--no-ui", metavar=FLAG, rich_help_panel=SERVER_PANEL,
                               help="Do not serve the built-in web page at / (chat playground, live KV view)."),
    sse_keepalive_s: float = typer.Option(10.0, "--sse-keepalive-s", min=0.01, rich_help_panel=SERVER_PANEL,
                                          help="Seconds a stream may stay silent (a long prefill) before a "
                                               "keep-alive comment is sent."),
    metrics_key: Optional[str] = typer.Option(
        None, "--metrics-key", rich_help_panel=SERVER_PANEL,
        help="A key that opens /metrics, /docs, /redoc and /openapi.json besides the API keys (with neither: "
             "those routes are open)."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", min=0.01, rich_help_panel=SERVER_PANEL,
                                         help="Seconds a client may take to send a request's headers; slower "
                                              "ones get 408 and are disconnected."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", min=0.01, rich_help_panel=SERVER_PANEL,
                                       help="Seconds a client may take to send a request's body; slower ones get "
                                            "408 and are disconnected."),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", min=0.001, rich_help_panel=SERVER_PANEL,
                                      help="Largest request body in MB; larger ones get HTTP 413."),
    max_client_priority: int = typer.Option(100, "--max-client-priority", min=0, max=100, rich_help_panel=SERVER_PANEL,
                                            help="Highest KV retention priority a request may ask for (0-100); "
                                                 "a request above it gets a 400."),
    admin_key: Optional[str] = typer.Option(None, "--admin-key", rich_help_panel=SERVER_PANEL,
                                            help="Key a /v1/cache/reset of every tenant's blocks needs (a reset "
                                                 "with cache_salt drops only that tenant's); default: no key."),
    responses_ttl: float = typer.Option(600.0, "--responses-ttl", min=0.001, rich_help_panel=SERVER_PANEL,
                                        help="Seconds the KV blocks of a stored /v1/responses result stay retained "
                                             "(previous_response_id continues from them)."),
    responses_kv_budget: Optional[int] = typer.Option(
        None, "--responses-kv-budget", parser=parse_size, metavar="SIZE", rich_help_panel=SERVER_PANEL,
        help="KV the retained /v1/responses results may hold together (new conversations take at most half of "
             "it; default: half the KV pool; 0: none retained). " + _SIZE_HELP + "."),
    responses_max: int = typer.Option(1000, "--responses-max", min=1, rich_help_panel=SERVER_PANEL,
                                      help="Stored /v1/responses results kept in memory (least recently used "
                                           "dropped first)."),
    kv_tenant_share: float = typer.Option(0.5, "--kv-tenant-share", min=0.01, max=1.0, rich_help_panel=KV_PANEL,
                                          help="Share of the KV block pool and of the disk tier one tenant "
                                               "(cache_salt) keeps while others need room (1 = no quota)."),
    log_level: str = typer.Option("info", "--log-level", callback=check_log_level, rich_help_panel=SERVER_PANEL,
                                  metavar="[critical|error|warning|info|debug|trace]", help="uvicorn log level."),
    switch_interval_ms: float = typer.Option(0.5, "--switch-interval-ms", min=0.01, rich_help_panel=SERVER_PANEL,
                                             help="GIL switch interval of the server process (ms): how long the "
                                                  "HTTP event loop may wait for the engine thread."),
    kv_backend: str = options.SERVE_KV_BACKEND,
    kv_block_size: int = options.KV_BLOCK_SIZE,
    state_snapshot_interval: int = options.STATE_SNAPSHOT_INTERVAL,
    kv_cache_budget: Optional[int] = typer.Option(
        None, "--kv-cache-budget", parser=parse_size, metavar="SIZE", rich_help_panel=KV_PANEL,
        help="Memory for KV blocks (paged; default: max-sequences full contexts, at most half the free memory). "
             + _SIZE_HELP + "."),
    kv_preallocate: bool = typer.Option(
        False, "--kv-preallocate", rich_help_panel=KV_PANEL,
        help="Allocate the whole --kv-cache-budget at start (steady latency) instead of growing the paged pool in "
             "chunks as blocks are needed and giving them back when idle."),
    kv_idle_release: Optional[float] = typer.Option(
        None, "--kv-idle-release", min=0.0, max=7 * 24 * 3600.0, metavar="SECONDS", rich_help_panel=KV_PANEL,
        show_default="300",
        help="Seconds with no request running after which the growing paged pool gives back its chunks above the "
             "first (cached blocks there are evicted, to the host/disk tier if any); 0: never."),
    host_cache_size: int = typer.Option(0, "--host-cache-size", parser=parse_size, metavar="SIZE",
                                        rich_help_panel=KV_PANEL,
                                        help="Host memory for evicted KV blocks (paged secondary tier; 0 = off)."),
    kv_disk_cache: Optional[str] = typer.Option(None, "--kv-disk-cache", metavar="DIR", callback=check_folder_option,
                                                rich_help_panel=KV_PANEL,
                                                help="Folder for an on-disk KV block tier (paged; survives restarts)."),
    kv_disk_cache_size: int = typer.Option(0, "--kv-disk-cache-size", parser=parse_size, metavar="SIZE",
                                           rich_help_panel=KV_PANEL, show_default="16GiB",
                                           help="Cap of the on-disk KV tier (needs --kv-disk-cache)."),
    kv_disk_write_interval: float = typer.Option(
        2.0, "--kv-disk-write-interval", min=0.0, max=3600.0, rich_help_panel=KV_PANEL,
        help="Seconds between writes of newly cached KV blocks to the disk tier (what a crash can lose; 0: only "
             "evicted blocks and the flush at stop)."),
    kv_disk_flush_timeout: float = typer.Option(
        10.0, "--kv-disk-flush-timeout", min=0.0, rich_help_panel=KV_PANEL,
        help="Seconds a graceful stop (SIGTERM/SIGINT) may spend writing cached KV blocks to the disk tier."),
    max_kv_size: Optional[int] = options.MAX_KV_SIZE,
    kv_bits: Optional[int] = options.KV_BITS,
    kv_group_size: int = options.KV_GROUP_SIZE,
    kv_overflow: str = options.KV_OVERFLOW,
    kv_overflow_budget: Optional[int] = options.KV_OVERFLOW_BUDGET,
    kv_overflow_sinks: Optional[int] = options.KV_OVERFLOW_SINKS,
    kv_overflow_recent: Optional[int] = options.KV_OVERFLOW_RECENT,
    layout: str = typer.Option("mlxkv", "--cache-layout", callback=from_rule(rules.KV_LAYOUT),
                               metavar="[mlxkv|mlx-lm]", rich_help_panel=KV_PANEL,
                               help="KV cache layouts: mlxkv or mlx-lm's own (dense; for comparison)."),
    temp: float = options.SERVE_TEMP,
    top_p: float = options.TOP_P,
    top_k: int = options.TOP_K,
    min_p: float = options.MIN_P,
    repetition_penalty: Optional[float] = options.REPETITION_PENALTY,
    max_tokens: Optional[int] = options.SERVE_MAX_TOKENS,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    distributed: str = options.DISTRIBUTED,
    distributed_timeout: float = typer.Option(
        60.0, "--distributed-timeout", min=0.1, rich_help_panel=SERVER_PANEL,
        help="Seconds without an answer from another rank (longer than the slowest step) before every rank stops."),
    prompt_lookup: bool = options.PROMPT_LOOKUP,
    draft_model: Optional[str] = options.DRAFT_MODEL,
    num_draft_tokens: int = options.NUM_DRAFT_TOKENS,
    ngram_size: int = options.NGRAM_SIZE,
) -> None:
    """Serve the OpenAI and Anthropic HTTP APIs (streaming, tools, JSON output) from a batching engine.

    OpenAI's /v1/chat/completions and /v1/completions, Anthropic's /v1/messages, over a continuous-batching engine
    with a paged, prefix-sharing KV cache.

    The sampling options are the defaults of requests that leave a field out.
    """
    refuse_unused(ctx, [("kv_group_size", "--kv-group-size", kv_bits is not None),
                        ("kv_block_size", "--kv-block-size", kv_backend == "paged"),
                        ("state_snapshot_interval", "--state-snapshot-interval", kv_backend == "paged")])
    if not (prompt_lookup or draft_model) and given(ctx, "num_draft_tokens"):
        raise typer.BadParameter("applies to --prompt-lookup or --draft-model only", param_hint="--num-draft-tokens")
    if not prompt_lookup and given(ctx, "ngram_size"):
        raise typer.BadParameter("applies to --prompt-lookup only", param_hint="--ngram-size")
    from mlxkv.cli.served_models import named, served_models

    try:
        models = served_models(model or [], models_file)
        several = _check_several(models, served_model_name, revision, distributed, adapter_path)
        if several:
            models = named(models)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if not several:
        name, spec = models[0] if models else (None, None)
        served_model_name = served_model_name or name
        model = with_revision(spec, revision)
    from mlxkv import env
    from mlxkv.server.compat import parse_origins

    try:
        flags = env.flags()  # a bad MLXKV_* value is one line, before the model loads
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    try:
        origins = parse_origins(allowed_origins)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--allowed-origins") from None
    image_dirs = tuple(Path(d).expanduser() for d in allowed_image_dir or ())
    for folder in image_dirs:
        if not folder.is_dir():
            raise typer.BadParameter(f"{folder} is not a folder", param_hint="--allowed-image-dir")
    try:
        from mlxkv.server.tenancy import Tenants

        keys = api_key or ([flags.api_key] if flags.api_key and not api_keys_file else [])
        tenants = Tenants.from_options(keys, api_keys_file, admin_key)
        if public_metrics and metrics_key is not None:
            raise ValueError("--public-metrics and --metrics-key contradict each other: /metrics is open or needs "
                             "a key")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    kv = kv_config(backend=kv_backend, block_size=kv_block_size, max_kv_size=max_kv_size, kv_bits=kv_bits,
                   kv_group_size=kv_group_size, layout=layout, budget=kv_cache_budget,
                   host_cache_bytes=host_cache_size, disk_cache_dir=kv_disk_cache, disk_cache_bytes=kv_disk_cache_size,
                   tenant_share=kv_tenant_share, disk_write_interval_s=kv_disk_write_interval,
                   state_snapshot_interval=state_snapshot_interval, preallocate=kv_preallocate,
                   idle_release_s=kv_idle_release,
                   overflow=overflow_config(kv_overflow, kv_overflow_budget, kv_overflow_sinks, kv_overflow_recent))
    sampling = sampling_defaults(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                                 repetition_penalty=repetition_penalty, max_tokens=max_tokens,
                                 chat_template_kwargs=chat_template_kwargs)
    from mlxkv.config import EngineConfig, RunConfig, SpeculativeConfig

    try:
        engine = EngineConfig(max_sequences=max_sequences, max_queue_depth=max_queue_depth,
                              prefill_chunk_size=prefill_chunk_size, batched_prefill=batched_prefill)
        speculative = SpeculativeConfig(prompt_lookup=prompt_lookup, draft_model=draft_model,
                                        num_draft_tokens=num_draft_tokens, ngram_size=ngram_size)
        run = RunConfig(model=None if several else model, dequantize=dequantize, kv=kv, engine=engine,
                        sampling=sampling, flags=flags, chat_template=chat_template, tool_parser=tool_parser,
                        adapter_path=adapter_path, speculative=speculative)
        if adapter_path is not None and distributed != "off":
            raise ValueError("--adapter-path: a LoRA adapter runs on one process: drop --distributed")
        if (prompt_lookup or draft_model) and distributed != "off":
            raise ValueError(f"{'--draft-model' if draft_model else '--prompt-lookup'} does not run with --distributed")
        if draft_model and several:
            raise ValueError("--draft-model serves one model: drop the other --model / --models-file entries")
        if draft_model:
            check_draft_model(draft_model)
        group = _distributed_group(distributed)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if group is not None and group.rank() > 0:  # a follower: no HTTP, rank 0's plans replayed
        from mlxkv.distributed.follower import serve_follower

        raise typer.Exit(code=serve_follower(run, group, distributed, distributed_timeout))
    from mlxkv.cli.listen import ListenError, bind, bound_port, url

    try:
        sock = bind(host, port)  # before the model loads: a busy port fails now, not minutes later
    except ListenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    try:
        from mlxkv.models import ModelLoadError
        from mlxkv.server.responses_api import StoreConfig
        from mlxkv.server.runner import build, set_switch_interval
        from mlxkv.server.shutdown import serve_until_signalled
        from mlxkv.vision.images import ImageLimits
    except ImportError as exc:
        sock.close()
        typer.echo(f"error: the server needs its extras (pip install 'mlxkv[serve]'): {exc}", err=True)
        raise typer.Exit(code=1) from None
    if host not in _LOOPBACK and not tenants.required:
        typer.echo(f"warning: serving on {host} without an API key: anyone who can reach it can use it", err=True)
    tier_existed = kv_disk_cache is not None and Path(kv_disk_cache).expanduser().exists()
    try:
        app_options = dict(tenants=tenants, public_metrics=public_metrics, body_timeout_s=body_timeout,
                           max_body_bytes=int(max_body_mb * 1024 * 1024), allowed_origins=origins,
                           keepalive_s=sse_keepalive_s, max_client_priority=max_client_priority, ui=not no_ui,
                           admin_key=admin_key, flush_timeout_s=kv_disk_flush_timeout, metrics_key=metrics_key,
                           responses=StoreConfig(max_responses=responses_max, ttl_s=responses_ttl,
                                                 kv_budget_bytes=responses_kv_budget),
                           image_limits=ImageLimits(allowed_dirs=image_dirs))
        leader = None
        if group is not None:
            from mlxkv.distributed.leader import Leader

            leader = Leader(group, distributed, distributed_timeout)
        if several:
            from mlxkv.cli.models import remember_gguf
            from mlxkv.server.runner import build_multi

            parts = build_multi(run, models, max_loaded=max_loaded_models, on_loaded=remember_gguf, **app_options)
        else:
            parts = build(run, model_name=served_model_name, distributed=leader, **app_options)
            refuse_useless_dequantize(parts.loaded, dequantize)
    except (ModelLoadError, ValueError) as exc:
        sock.close()
        from mlxkv.cli.options import in_cli_words

        typer.echo(f"error: {in_cli_words(str(exc))}", err=True)
        raise typer.Exit(code=1) from None
    except OSError as exc:  # the tier folder or its secret on a full disk, a read-only or forbidden folder
        sock.close()
        _remove_if_made(kv_disk_cache, tier_existed)
        where = f" (--kv-disk-cache {kv_disk_cache})" if kv_disk_cache else ""
        typer.echo(f"error: cannot write the server's files{where}: {exc.strerror or exc}"
                   + (f": {exc.filename}" if exc.filename else ""), err=True)
        raise typer.Exit(code=1) from None
    set_switch_interval(switch_interval_ms / 1000)
    if several:
        registry = parts.registry
        limit = f"at most {max_loaded_models} loaded" if max_loaded_models else "all may stay loaded"
        typer.echo(f"mlxkv serve: {len(models)} models on {url(host, bound_port(sock))}: "
                   + ", ".join(f"{n} ({registry.slots[n].state})" for n in registry.names)
                   + f" ({limit}; each: max {max_sequences} sequences, queue {max_queue_depth}, {kv_backend} KV)",
                   err=True)
        started = serve_until_signalled(parts.app, registry, host=host, port=bound_port(sock), log_level=log_level,
                                        sockets=[sock], header_timeout_s=header_timeout)
        for slot in registry.slots.values():
            _report_flush(slot.last_flush, f" of {slot.name}")
    else:
        from mlxkv.cli.models import remember_gguf

        remember_gguf(parts.loaded)
        adapter = f" with adapter {adapter_path}" if adapter_path is not None else ""
        typer.echo(f"mlxkv serve: {parts.loaded.name}{adapter} on {url(host, bound_port(sock))} "
                   f"(max {max_sequences} sequences, queue {max_queue_depth}, {kv_backend} KV"
                   + (f", {distributed} parallel over {group.size()} ranks" if group is not None else "") + ")",
                   err=True)
        started = serve_until_signalled(parts.app, parts.engine, host=host, port=bound_port(sock),
                                        log_level=log_level, sockets=[sock], header_timeout_s=header_timeout)
        _report_flush(parts.engine.last_flush)
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()  # MLX asks each thread that used it to clean up, else the process may abort at exit
    if not started:
        raise typer.Exit(code=3)  # uvicorn's startup-failure code (it logged why)


def _check_several(models: list, served_model_name: Optional[str], revision: Optional[str], distributed: str,
                   adapter_path: Optional[str] = None) -> bool:
    """Whether several models are served; raises ValueError (one line) for the options that take one model."""
    if len(models) < 2:
        if models and models[0][0] is not None and served_model_name is not None:
            raise ValueError("the model is named twice: by -m NAME=MODEL and by --served-model-name; keep one")
        return False
    for value, option, instead in ((served_model_name, "--served-model-name", "name each model with -m NAME=MODEL"),
                                   (revision, "--revision", "give each repo id's as owner/name@REVISION")):
        if value is not None:
            raise ValueError(f"{option} applies to one model; with several, {instead}")
    if distributed != "off":
        raise ValueError("--distributed serves one model: give a single -m")
    if adapter_path is not None:
        raise ValueError("--adapter-path applies to one model; with several, serve each adapted model on its own")
    return True


def _report_flush(flushed: Optional[dict], whose: str = "") -> None:
    if flushed:
        typer.echo(f"mlxkv serve: KV tier{whose} saved: {flushed['on_disk']} block(s) on disk ({flushed['written']} "
                   f"written at stop, {flushed['seconds']:.2f} s)"
                   + (f", {flushed['lost']} not written (--kv-disk-flush-timeout)" if flushed["lost"] else ""),
                   err=True)


def _remove_if_made(folder: Optional[str], existed: bool) -> None:
    """Remove the tier folder a failed start made, when it is still empty (nothing of a failed start stays)."""
    if folder is None or existed:
        return
    try:
        Path(folder).expanduser().rmdir()
    except OSError:
        pass  # not empty, or already gone: leave it


def _distributed_group(mode: str):
    """The ``mx.distributed`` group for ``--distributed MODE`` (None when off; refused under mlx.launch then)."""
    from mlxkv.distributed.group import check_mode, check_undistributed, start_group

    if check_mode(mode) == "off":
        check_undistributed()
        return None
    return start_group(mode)


