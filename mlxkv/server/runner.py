"""Building and running a server: model + pool + engine + app, under uvicorn (foreground or in a thread)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from mlxkv.engine.batch import BatchEngine, EngineConfig, context_length_of
from mlxkv.server.limits import DEFAULT_MAX_BODY_BYTES
from mlxkv.server.metrics import ServerMetrics


@dataclass
class ServerParts:
    """What :func:`build` made: the loaded model, its engine (not started) and the app."""

    loaded: Any
    engine: BatchEngine
    app: Any
    metrics: ServerMetrics


def build(model: str | None, *, config: EngineConfig | None = None, layout: str = "mlxkv",
          max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64,
          api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          model_name: str | None = None, manage_engine: bool = True, kv_backend: str = "paged",
          kv_block_size: int = 16, kv_cache_budget: int | None = None, host_cache_bytes: int = 0,
          disk_cache_dir: str | None = None, disk_cache_bytes: int = 0,
          dequantize: bool = False) -> ServerParts:
    """Load ``model`` (see :func:`mlxkv.models.load`) and wire pool, engine, metrics and app together.

    ``kv_backend="paged"`` (default): one block pool with prefix caching, sized by ``kv_cache_budget`` bytes
    (default: see :func:`paged_kv_config`); ``host_cache_bytes`` / ``disk_cache_dir`` / ``disk_cache_bytes``
    size the secondary KV tier. ``"dense"``: per-sequence buffers (``layout``, ``max_kv_size``, ``kv_bits``).
    ``dequantize`` runs quantized weights unquantized (see :func:`mlxkv.models.load`).

    Raises:
        mlxkv.models.ModelLoadError: the model cannot be loaded.
        ValueError: invalid engine or cache settings.
    """
    from mlxkv.models import load
    from mlxkv.kv.store import CachePool
    from mlxkv.server.app import create_app

    config = config or EngineConfig()
    loaded = load(model, progress=True, dequantize=dequantize)
    context = context_length_of(loaded.config)
    if kv_backend == "paged":
        if kv_bits is not None or max_kv_size is not None or layout != "mlxkv":
            raise ValueError("--kv-bits, --max-kv-size and --cache-layout apply to the dense backend: "
                             "add --kv-backend dense")
        kv_config = paged_kv_config(config.max_sequences, context, block_size=kv_block_size, budget=kv_cache_budget,
                                    host_cache_bytes=host_cache_bytes, disk_cache_dir=disk_cache_dir,
                                    disk_cache_bytes=disk_cache_bytes)
        pool = CachePool(loaded.model, max_sequences=config.max_sequences, backend="paged", kv_config=kv_config)
    elif kv_backend == "dense":
        pool = CachePool(loaded.model, max_sequences=config.max_sequences, layout=layout, max_kv_size=max_kv_size,
                         kv_bits=kv_bits, kv_group_size=kv_group_size)
    else:
        raise ValueError(f"kv_backend must be one of dense, paged, got {kv_backend!r}")
    metrics = ServerMetrics()
    engine = BatchEngine(loaded.model, loaded.tokenizer, config=config, pool=pool, context_length=context,
                         observer=metrics)
    app = create_app(engine, model_name=model_name or loaded.name, api_key=api_key, max_body_bytes=max_body_bytes,
                     metrics=metrics, manage_engine=manage_engine)
    return ServerParts(loaded, engine, app, metrics)


def paged_kv_config(max_sequences: int, context_length: int | None, *, block_size: int = 16,
                    budget: int | None = None, host_cache_bytes: int = 0, disk_cache_dir: str | None = None,
                    disk_cache_bytes: int = 0) -> Any:
    """The server's paged KvCacheConfig.

    ``budget`` bytes when given; else enough blocks for ``max_sequences`` full contexts, capped at
    ``AUTO_FREE_FRACTION`` of free memory (only the fraction without a known context length). Secondary-tier
    sizes are passed on where this version of :class:`~mlxkv.config.KvCacheConfig` has the fields.
    """
    from mlxkv.config import KvCacheConfig

    fields: dict[str, Any] = {}
    for name, value in (("secondary_memory_bytes", host_cache_bytes), ("secondary_disk_dir", disk_cache_dir),
                        ("secondary_disk_bytes", disk_cache_bytes)):
        if value:
            if name not in KvCacheConfig.__dataclass_fields__:
                raise ValueError(f"this mlxkv has no secondary KV tier ({name}): drop the host/disk cache options")
            fields[name] = value
    max_tokens = max_sequences * context_length if budget is None and context_length else None
    return KvCacheConfig(backend="paged", block_size=block_size, kv_cache_budget=budget or "auto",
                         free_memory_fraction=AUTO_FREE_FRACTION, max_tokens=max_tokens, **fields)


#: Share of free memory the paged pool may take when no ``--kv-cache-budget`` is given.
AUTO_FREE_FRACTION = 0.5
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
    :meth:`start` / :meth:`stop`.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
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
