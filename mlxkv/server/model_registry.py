"""Several models behind one server (``mlxkv serve -m A -m B``): which are loaded, loading them on first use and
unloading the least recently used idle one when ``--max-loaded-models`` needs room.

Each model, once loaded, is a whole single-model server of its own (:class:`ServedModel`): its weights, its
engine with its own KV pool and prefix cache, and the app that serves it (:func:`mlxkv.server.app.create_app`).
:mod:`mlxkv.server.multi_app` picks the model a request names and hands the request to that app.

The registry's state lives on the server's event loop (every method but :meth:`ModelRegistry.stop_all` is called
there); the slow parts (loading weights, stopping an engine and flushing its KV tier) run on one loader thread,
one at a time, so the other models keep answering meanwhile. One thread, kept until the server stops: the MLX
streams a thread makes must outlive the arrays built on them and be destroyed by that same thread. A model with
requests in flight is never unloaded: a request that needs room waits until one of the loaded models is idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from mlxkv.server.metrics import ServerMetrics

#: uvicorn's own logger: its lines show at ``--log-level info`` beside the requests'.
log = logging.getLogger("uvicorn.error")

NOT_LOADED, LOADING, LOADED, UNLOADING = "not-loaded", "loading", "loaded", "unloading"


class ModelUnavailable(Exception):
    """A model cannot answer now: its load failed, or the server is shutting down."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


@dataclass
class ServedModel:
    """One loaded model: its weights (``loaded``), its engine (with its own KV pool) and the app serving it."""

    loaded: Any
    engine: Any
    app: Any


@dataclass
class ModelSlot:
    """One model the server can serve, loaded or not.

    Attributes:
        name: the id requests name it by (``model``) and ``/v1/models`` lists.
        spec: where it comes from (a folder, GGUF file or repo id, as ``-m`` gave it).
        metrics: its Prometheus registry, kept across loads (counters and histograms accumulate).
        served: its engine and app while loaded.
        state: ``not-loaded``, ``loading``, ``loaded`` or ``unloading``.
        in_flight: requests its app is answering now (a model with any is never unloaded).
        last_used: when a request last picked it (``time.monotonic``): the least recent idle one unloads first.
        loads: how many times it was loaded.
        last_flush: its engine's last KV-tier flush at stop (see ``BatchEngine.last_flush``).
    """

    name: str
    spec: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    served: ServedModel | None = None
    state: str = NOT_LOADED
    in_flight: int = 0
    last_used: float = 0.0
    loads: int = 0
    last_flush: dict | None = None


class ModelRegistry:
    """The served models by name, at most ``max_loaded`` of them loaded at once (``None``: no limit).

    Args:
        models: ``(name, spec)`` pairs; the first is the default model (requests that name none, routes asked
            without ``?model=``).
        factory: ``factory(slot) -> ServedModel``: loads ``slot``'s model and builds its engine (not started) and
            app; runs on the loader thread; raises with a one-line message when the model cannot be loaded.
        max_loaded: most models loaded at once (>= 1; ``None``: all may be).
        flush_timeout_s: how long stopping one engine may take to write its KV tier's cached blocks.

    Raises:
        ValueError: no models, two with one name, ``max_loaded`` < 1.
    """

    def __init__(self, models: list[tuple[str, str]], factory: Callable[[ModelSlot], ServedModel], *,
                 max_loaded: int | None = None, flush_timeout_s: float = 10.0):
        if not models:
            raise ValueError("no model to serve")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {max_loaded}")
        self.slots: dict[str, ModelSlot] = {}
        for name, spec in models:
            if name in self.slots:
                raise ValueError(f"two models are served as {name!r}: name them apart with -m NAME=PATH")
            self.slots[name] = ModelSlot(name, spec)
        self.default = models[0][0]
        self.max_loaded = max_loaded
        self.flush_timeout_s = flush_timeout_s
        self._factory = factory
        self._changed: asyncio.Condition | None = None  # made on the event loop at first use
        self._busy = False  # a load or an unload is under way (one at a time)
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxkv-loader")
        self.draining = False
        self.openapi_schema: dict | None = None

    # ---- what the routes read ----------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def loaded(self) -> list[ModelSlot]:
        """The models loaded now."""
        return [s for s in self.slots.values() if s.state == LOADED]

    def describe(self) -> str:
        """The served names, for messages: ``'a', 'b'``."""
        return ", ".join(repr(n) for n in self.slots)

    # ---- loading and unloading ---------------------------------------------------------------------------------

    def load_now(self, name: str) -> ServedModel:
        """Load ``name`` on this thread before the server runs (the default model at start); its engine is started
        by :meth:`start`."""
        slot = self.slots[name]
        slot.served, slot.state, slot.loads = self._factory(slot), LOADED, slot.loads + 1
        slot.last_used = time.monotonic()
        return slot.served

    def start(self) -> None:
        """Start the engines of the models loaded before the server ran (the server's start-up)."""
        for slot in self.loaded():
            slot.served.engine.start()

    @contextlib.asynccontextmanager
    async def use(self, name: str, *, load: bool = True) -> AsyncIterator[ServedModel | None]:
        """Hold model ``name`` for one request: loaded (``load``: loading it now, unloading the least recently
        used idle model first when the limit needs room; else ``None`` when it is not loaded) and not unloaded
        until the block ends. Only a loading use counts as a use for the least-recently-used order.

        Raises:
            ModelUnavailable: the model failed to load, or the server is shutting down.
        """
        slot = self.slots[name]
        served = await self._acquire(slot, load)
        try:
            yield served
        finally:
            if served is not None:
                slot.in_flight -= 1
                if slot.in_flight == 0:
                    await self._notify()

    async def _acquire(self, slot: ModelSlot, load: bool) -> ServedModel | None:
        changed = self._condition()
        while True:
            async with changed:
                if self.draining:
                    raise ModelUnavailable("the server is shutting down", "server_shutting_down")
                if slot.state == LOADED:
                    slot.in_flight += 1
                    if load:
                        slot.last_used = time.monotonic()
                    return slot.served
                if not load and slot.state != LOADING:
                    return None
                if self._busy or slot.state != NOT_LOADED:
                    await changed.wait()
                    continue
                victim = None
                if self.max_loaded is not None and self._occupied() >= self.max_loaded:
                    victim = self._least_recent_idle()
                    if victim is None:  # every loaded model is answering: wait for one to be idle
                        await changed.wait()
                        continue
                    victim.state = UNLOADING
                else:
                    slot.state = LOADING
                self._busy = True
            try:
                if victim is not None:
                    await self._unload(victim)
                else:
                    await self._load(slot)
            finally:
                self._busy = False
                await self._notify()

    async def _load(self, slot: ModelSlot) -> None:
        log.info("mlxkv: loading model %r (%s)", slot.name, slot.spec)
        started = time.monotonic()
        try:
            served = await self._on_loader(self._factory, slot)
            if self.draining:  # the server began stopping meanwhile: its engine is never started
                raise ModelUnavailable("the server is shutting down", "server_shutting_down")
            await self._on_loader(served.engine.start)
        except ModelUnavailable:
            slot.state = NOT_LOADED
            raise
        except Exception as exc:  # noqa: BLE001 - any failure leaves the model unloaded; the request hears why
            slot.state = NOT_LOADED
            log.error("mlxkv: model %r could not be loaded: %s", slot.name, exc)
            raise ModelUnavailable(f"model {slot.name!r} could not be loaded: {exc}", "model_load_failed") from None
        slot.served, slot.state, slot.loads = served, LOADED, slot.loads + 1
        log.info("mlxkv: model %r loaded in %.1f s", slot.name, time.monotonic() - started)

    async def _unload(self, slot: ModelSlot) -> None:
        log.info("mlxkv: unloading model %r (least recently used; --max-loaded-models %s)", slot.name,
                 self.max_loaded)
        await self._on_loader(self._release, slot)
        slot.state = NOT_LOADED
        log.info("mlxkv: model %r unloaded", slot.name)

    def _release(self, slot: ModelSlot) -> None:
        """Stop ``slot``'s engine (its KV tier flushed) and drop every reference to its weights and pool."""
        served, slot.served = slot.served, None
        try:
            if served is not None:
                served.engine.stop(flush_timeout=self.flush_timeout_s)
                slot.last_flush = served.engine.last_flush
        finally:
            slot.metrics.bind(lambda: {})  # the metrics outlive the engine they read
            del served
            _forget_routes()
            gc.collect()  # the model's modules hold reference cycles
            import mlx.core as mx

            mx.clear_cache()  # give the freed buffers back rather than keep them for the next allocation
            _trim_heap()

    async def _on_loader(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._loader, fn, *args)

    def _occupied(self) -> int:
        return sum(s.state in (LOADED, LOADING, UNLOADING) for s in self.slots.values())

    def _least_recent_idle(self) -> ModelSlot | None:
        idle = [s for s in self.slots.values() if s.state == LOADED and s.in_flight == 0]
        return min(idle, key=lambda s: s.last_used, default=None)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    # ---- stopping ----------------------------------------------------------------------------------------------

    def drain(self, message: str) -> int:
        """Refuse new requests (and loads) and end every loaded model's open requests with ``message`` (a graceful
        stop; called from any thread). Returns how many requests were ended."""
        self.draining = True
        return sum(slot.served.engine.drain(message) for slot in list(self.slots.values())
                   if slot.served is not None)

    def stop_all(self) -> None:
        """Stop every loaded model's engine (each KV tier flushed) and the loader thread; the server's shutdown,
        on a worker thread."""
        self.draining = True
        for slot in self.slots.values():
            served = slot.served
            if served is not None:
                served.engine.stop(flush_timeout=self.flush_timeout_s)
                slot.last_flush = served.engine.last_flush
        self._loader.submit(_clear_streams).result()
        self._loader.shutdown()


def _trim_heap() -> None:
    """Return the C heap's free pages to the system where the C library can (glibc's ``malloc_trim``): an
    unloaded model's buffers freed on the CPU backend stay in the process's resident memory otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass  # not glibc (macOS frees its own way)


def _clear_streams() -> None:
    """Destroy the MLX streams this thread made (else the process can abort at exit: MLX asks each thread to)."""
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()


def _forget_routes() -> None:
    """Empty FastAPI's caches keyed by route functions (``fastapi.dependencies.models``: ``lru_cache`` s of 4,096
    entries in the versions that have them): an unloaded model's routes close over its engine, and a cache
    entry would keep its weights and pool alive. Refilled cheaply by the routes still served."""
    try:
        from fastapi.dependencies import models
    except ImportError:
        return
    for name in dir(models):
        cached = getattr(models, name)
        if name.endswith("_cached") and callable(getattr(cached, "cache_clear", None)):
            cached.cache_clear()
