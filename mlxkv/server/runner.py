"""Building and running a server: model + pool + engine + app, under uvicorn (foreground or in a thread)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from mlxkv.config import RunConfig, SpeculativeConfig
from mlxkv.engine.batch import BatchEngine, context_length_of
from mlxkv.engine.speculation import Speculation
from mlxkv.server.compat import DEFAULT_KEEPALIVE_S
from mlxkv.server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from mlxkv.server.read_timeouts import DEFAULT_HEADER_TIMEOUT_S, protocol_class
from mlxkv.server.tenancy import Tenants, key_fingerprint
from mlxkv.server.metrics import ServerMetrics


@dataclass
class ServerParts:
    """What :func:`build` made: the loaded model, its engine (not started) and the app."""

    loaded: Any
    engine: BatchEngine
    app: Any
    metrics: ServerMetrics


def vision_inputs(loaded: Any, limits: Any = None) -> Any:
    """The served model's image support (:class:`mlxkv.vision.inputs.VisionInputs`): its vision tower when it is a
    vision-language model and mlx-vlm is installed, else why it refuses images."""
    from mlxkv.vision.images import ImageLimits
    from mlxkv.vision.inputs import VisionInputs
    from mlxkv.vision.support import TEXT_ONLY

    limits = limits or ImageLimits()
    if loaded.is_gguf:
        return VisionInputs(None, TEXT_ONLY, limits)
    return VisionInputs.for_model(loaded.path, loaded.config, loaded.tokenizer, limits, model=loaded.model)


def build(run: RunConfig, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          model_name: str | None = None, manage_engine: bool = True, allowed_origins: Sequence[str] = (),
          ui: bool = True,
          keepalive_s: float = DEFAULT_KEEPALIVE_S, max_client_priority: int = 100,
          admin_key: str | None = None, flush_timeout_s: float = 10.0,
          metrics_key: str | None = None, distributed: Any = None, tenants: Tenants | None = None,
          public_metrics: bool = False, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
          responses: Any = None, image_limits: Any = None) -> ServerParts:
    """Load ``run.model`` (see :func:`mlxkv.models.load`) and wire its KV store (:func:`mlxkv.engine.build.
    build_pool`: ``run.kv`` for ``run.engine.max_sequences`` sequences of the model's context), engine, metrics and
    app together (``allowed_origins``, ``keepalive_s``, ``max_client_priority``, ``admin_key``, ``flush_timeout_s``,
    ``metrics_key``, ``tenants``, ``public_metrics``, ``body_timeout_s``, ``responses``: see :func:`mlxkv.server.app.create_app`).
    ``distributed``: rank 0's :class:`mlxkv.distributed.leader.Leader` under ``mlx.launch`` (shards the model,
    builds the pool and engine).

    ``ui``: serve the built-in page at ``/`` (see :func:`mlxkv.server.app.create_app`). ``image_limits``: a
    vision-language model's image limits and ``file://`` folders (:class:`mlxkv.vision.images.ImageLimits`; ``None``:
    the defaults, no local files).

    Raises:
        mlxkv.models.ModelLoadError: the model cannot be loaded.
        ValueError: invalid engine or cache settings.
    """
    metrics = ServerMetrics()
    loaded, engine, app = _serve_one(run, metrics, model_name=model_name, distributed=distributed, api_key=api_key,
                                     max_body_bytes=max_body_bytes, manage_engine=manage_engine,
                                     allowed_origins=allowed_origins, ui=ui, keepalive_s=keepalive_s,
                                     max_client_priority=max_client_priority, admin_key=admin_key,
                                     flush_timeout_s=flush_timeout_s, metrics_key=metrics_key, tenants=tenants,
                                     public_metrics=public_metrics, body_timeout_s=body_timeout_s,
                                     responses=responses, image_limits=image_limits)
    return ServerParts(loaded, engine, app, metrics)


def _serve_one(run: RunConfig, metrics: ServerMetrics, *, model_name: str | None, distributed: Any = None,
               image_limits: Any = None, **app_options: Any) -> tuple[Any, BatchEngine, Any]:
    """``run.model`` loaded, its pool and engine (not started), and the app serving it (``image_limits``: see
    :func:`build`; ``app_options``: see :func:`mlxkv.server.app.create_app`)."""
    from mlxkv.engine.build import build_pool
    from mlxkv.models import load
    from mlxkv.server.app import create_app

    speculation = speculation_of(run.speculative, distributed is not None)  # refused before the model loads
    loaded = load(run.model, progress=True, dequantize=run.dequantize, chat_template=run.chat_template,
                  tool_parser=run.tool_parser, adapter_path=run.adapter_path)
    context = context_length_of(loaded.config)
    make_pool, make_engine = build_pool, BatchEngine
    if distributed is not None:
        distributed.shard(loaded)
        make_pool, make_engine = distributed.pool, distributed.engine
    vision = vision_inputs(loaded, image_limits)
    pool = make_pool(loaded.model, run.kv, max_sequences=run.engine.max_sequences, context_tokens=context)
    if run.speculative.draft_model:
        speculation = replace(speculation, draft=load_draft(run, loaded, pool, context))
    extra = {"speculation": speculation} if speculation is not None else {}
    engine = make_engine(loaded.model, loaded.tokenizer, config=run.engine, pool=pool, context_length=context,
                         observer=metrics, **extra)
    app = create_app(engine, model_name=model_name or loaded.name, metrics=metrics, defaults=run.sampling,
                     vision=vision, **app_options)
    return loaded, engine, app


@dataclass
class MultiServerParts:
    """What :func:`build_multi` made: the models (the first one loaded, its engine not started) and the app."""

    registry: Any
    app: Any


def build_multi(run: RunConfig, models: Sequence[tuple[str, str]], *, max_loaded: int | None = None,
                on_loaded: Callable[[Any], None] = lambda loaded: None, api_key: str | None = None,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_origins: Sequence[str] = (), ui: bool = True,
                keepalive_s: float = DEFAULT_KEEPALIVE_S, max_client_priority: int = 100,
                admin_key: str | None = None, flush_timeout_s: float = 10.0, metrics_key: str | None = None,
                tenants: Tenants | None = None, public_metrics: bool = False,
                body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, responses: Any = None,
                image_limits: Any = None) -> MultiServerParts:
    """A server for several models (``models``: ``(name, spec)`` pairs, the first the default), each loaded as
    :func:`build` loads one, with ``run``'s settings (its ``model`` aside); at most ``max_loaded`` loaded at once
    (:class:`mlxkv.server.model_registry.ModelRegistry`). Every model's files are found (downloaded if need be)
    now and the first one is loaded now; the others load at their first request. With a disk tier, each model
    keeps its blocks in a folder of its own under ``run.kv.secondary_disk_dir``. ``on_loaded(loaded)`` runs after
    each load. The other options: see :func:`mlxkv.server.app.create_app`.

    Raises:
        mlxkv.models.ModelLoadError: a model cannot be found, or the first one cannot be loaded.
        ValueError: invalid names, limit, engine or cache settings.
    """
    from mlxkv.models import resolve_model_path
    from mlxkv.server.model_registry import ModelRegistry, ModelSlot, ServedModel
    from mlxkv.server.multi_app import create_multi_app

    if tenants is None:
        tenants = Tenants({api_key: key_fingerprint(api_key)} if api_key else {}, admin_key)
    app_options = dict(tenants=tenants, max_body_bytes=max_body_bytes, ui=False, keepalive_s=keepalive_s,
                       max_client_priority=max_client_priority, admin_key=admin_key, metrics_key=metrics_key,
                       public_metrics=public_metrics, body_timeout_s=body_timeout_s, responses=responses,
                       image_limits=image_limits)

    def factory(slot: ModelSlot) -> ServedModel:
        kv = run.kv
        if kv.secondary_disk_dir is not None:
            folder = Path(kv.secondary_disk_dir).expanduser() / _folder_name(slot.name)
            kv = replace(kv, secondary_disk_dir=str(folder))
        loaded, engine, app = _serve_one(replace(run, model=slot.spec, kv=kv), slot.metrics, model_name=slot.name,
                                         **app_options)
        if registry.openapi_schema is None:
            registry.openapi_schema = app.openapi()
        on_loaded(loaded)
        return ServedModel(loaded, engine, app)

    registry = ModelRegistry(list(models), factory, max_loaded=max_loaded, flush_timeout_s=flush_timeout_s)
    for _, spec in models:
        resolve_model_path(spec)  # a missing model fails now, not at its first request
    registry.load_now(registry.default)
    app = create_multi_app(registry, tenants=tenants, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                           allowed_origins=allowed_origins, metrics_key=metrics_key, public_metrics=public_metrics,
                           ui=ui)
    return MultiServerParts(registry, app)


def _folder_name(name: str) -> str:
    """A served name as one folder name (a repo id's ``/`` as ``--``, as the Hugging Face cache spells it)."""
    return name.replace("/", "--").replace("\\", "--")


def speculation_of(spec: SpeculativeConfig, distributed: bool) -> Speculation | None:
    """The engine's speculative decoding for ``spec`` (``--prompt-lookup`` or ``--draft-model``,
    ``--num-draft-tokens``, ``--ngram-size``); None when off. A draft model is loaded later (:func:`load_draft`).

    Raises:
        ValueError: a combination serve does not run (``--distributed``), in one line.
    """
    if not spec.enabled:
        return None
    if distributed:
        raise ValueError(f"{'--draft-model' if spec.draft_model else '--prompt-lookup'} does not run with "
                         "--distributed")
    return Speculation(num_draft_tokens=spec.num_draft_tokens, ngram_size=spec.ngram_size)


def load_draft(run: RunConfig, loaded: Any, pool: Any, context: int | None) -> Any:
    """``run.speculative.draft_model`` loaded, with its own paged pool holding as many tokens as the target's
    ``pool`` (:func:`mlxkv.engine.build.draft_model_rows`): a :class:`~mlxkv.engine.draft_rows.DraftModelRows`.

    Raises:
        ValueError: the draft's vocabulary differs from the target's, or its layers cannot rewind exactly.
        mlxkv.models.ModelLoadError: it cannot be loaded.
    """
    from mlxkv.engine.build import draft_model_rows, load_draft_model

    draft = load_draft_model(run, loaded.model, progress=True)
    sequences = run.engine.max_sequences
    tokens = pool.max_sequence_tokens() or sequences * (context or 4096)
    return draft_model_rows(draft.model, run, target_tokens=tokens, max_sequences=sequences)


#: The server process's GIL switch interval (seconds). The engine thread builds each step's graph in Python;
#: with CPython's default 5 ms the event loop (HTTP parsing, token delivery, SSE writes) waits up to 5 ms for
#: the GIL at every hand-over, several times per request.
SERVER_SWITCH_INTERVAL_S = 0.0005


def set_switch_interval(seconds: float | None = SERVER_SWITCH_INTERVAL_S) -> None:
    """Set this process's GIL switch interval (``sys.setswitchinterval``); ``None`` leaves it as it is.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if seconds is None:
        return
    if seconds <= 0:
        raise ValueError(f"the switch interval must be > 0 seconds, got {seconds}")
    sys.setswitchinterval(seconds)


class ServerThread:
    """Serve ``app`` with uvicorn on a background thread, on an already-bound loopback socket.

    ``port=0`` picks a free port; :attr:`url` tells which. Use as a context manager or call
    :meth:`start` / :meth:`stop`. A client not done sending its request headers ``header_timeout_s`` seconds
    after connecting (or after its previous response) is dropped (:mod:`mlxkv.server.read_timeouts`).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                                http=protocol_class(header_timeout_s))
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="mlxkv-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
