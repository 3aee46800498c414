"""BatchEngine: one engine thread owns MLX, the model and the CachePool; other threads submit and read events.

Callers (HTTP handlers) never touch MLX: :meth:`BatchEngine.submit` validates and queues a request and returns
a :class:`~mlxkv.engine.request.RequestHandle` at once; the engine thread runs
:class:`~mlxkv.engine.scheduler.Scheduler` steps while there is work and blocks on its inbox otherwise, so a
submission wakes an idle engine at once (no polling); while busy it takes new commands between steps. Each
step's events reach each event loop with a single wake-up (:mod:`mlxkv.engine.output`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from typing import Any

import mlx.core as mx

from mlxkv.engine.batch_probe import probe_batched_decode, probe_batched_prefill
from mlxkv.engine.output import batched_wakeups
from mlxkv.engine.pool_facts import PoolFacts
from mlxkv.engine.request import (
    EngineStoppedError,
    Event,
    GenerationRequest,
    PromptTooLongError,
    QueueFullError,
    RequestHandle,
)
from mlxkv.engine.scheduler import EngineObserver, Job, Scheduler
from mlxkv.engine.speculation import Speculation, check_pool
from mlxkv.kernels.fast_exp import fast_exp2_ready
from mlxkv.config import EngineConfig
from mlxkv.kv import CachePool, event_to_json

log = logging.getLogger("mlxkv.engine")


def context_length_of(config: dict) -> int | None:
    """``max_position_embeddings`` from a model config (``text_config`` first for wrapped models)."""
    for source in (config.get("text_config") or {}, config):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size_of(model: Any) -> int | None:
    """The width of a model's logits: ``vocab_size`` from its mlx-lm arguments (``text_config`` first), if any."""
    args = getattr(model, "args", None)
    for source in (getattr(args, "text_config", None), args):
        value = source.get("vocab_size") if isinstance(source, dict) else getattr(source, "vocab_size", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class BatchEngine:
    """Continuous-batching generation for many concurrent requests over one model.

    Args:
        model: the mlx-lm model (loaded through :func:`mlxkv.models.load` so the attention hook is installed).
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``None``: token events only).
        config: engine settings.
        pool: the CachePool (default: mlxkv layouts, ``config.max_sequences`` sequences).
        context_length: longest prompt + output in tokens (``None``: unlimited).
        observer: receives timings (time to first token, time per output token) on the engine thread.
        speculation: speculative decoding by prompt lookup or a draft model (:mod:`mlxkv.engine.speculation`;
            None: off).

    Raises:
        ValueError: settings the pool cannot run (speculation over layers it cannot rewind exactly).
    """

    def __init__(self, model: Any, tokenizer: Any, *, config: EngineConfig | None = None,
                 pool: CachePool | None = None, context_length: int | None = None,
                 observer: EngineObserver | None = None, speculation: Speculation | None = None):
        self.config = config or EngineConfig()
        self.pool = pool if pool is not None else CachePool(model, max_sequences=self.config.max_sequences)
        if self.pool.max_sequences < self.config.max_sequences:
            raise ValueError(f"the pool holds {self.pool.max_sequences} sequences, fewer than max_sequences="
                             f"{self.config.max_sequences}")
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size_of(model)
        if speculation is not None:
            check_pool(self.pool)
        self.speculation = speculation
        self._scheduler = Scheduler(model, tokenizer, self.pool, max_sequences=self.config.max_sequences,
                                    prefill_chunk_size=self.config.prefill_chunk_size, observer=observer,
                                    on_dequeue=self._dequeued, intake=self._take_submissions,
                                    speculation=speculation)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet admitted (or dropped)
        self._thread: threading.Thread | None = None
        self._running = False
        self._batched_reason = "not probed yet"
        self._batched_prefill_reason = "not probed yet"
        self.vision: Any = None  # the served model's image support (mlxkv.vision.inputs.VisionInputs): its stats
        self._snapshot: dict = {}
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._kv_capacity = self.pool.max_sequence_tokens()  # the longest sequence the block pool holds (paged)
        self.pool_facts = PoolFacts.of(self.pool)  # what routes may know of the pool, read here, before the thread
        self._kv_stats: dict = {}
        self._kv_stats_at = 0.0
        self._draining = False  # drain(): new submissions refused
        self._drains: list[tuple[str, concurrent.futures.Future]] = []  # drain commands, run between steps
        self._flush_timeout = 10.0  # seconds stop() gives the KV tier to write its cached blocks
        self.last_flush: dict | None = None  # what the last stop's tier flush did

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "BatchEngine":
        """Start the engine thread (probes batched decode first); returns ``self``."""
        if self._thread is not None:
            return self
        self._running = True
        self._thread = threading.Thread(target=self._main, name="mlxkv-engine", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the engine thread did not start in time")
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            raise self._start_error
        return self

    def stop(self, timeout: float = 30.0, flush_timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests end with an error event and release their sequences, then
        the KV tier writes its cached blocks to disk (at most ``flush_timeout`` seconds; see :attr:`last_flush`)."""
        if self._thread is None:
            return
        self._inbox.put(("stop", flush_timeout))
        self._thread.join(timeout + flush_timeout)
        self._thread = None

    def drain(self, message: str = "the server is shutting down", timeout: float = 30.0) -> int:
        """Refuse new submissions and end every unfinished request now with an error event whose
        ``finish_reason`` is ``"shutdown"`` (a graceful stop). Returns how many requests were ended."""
        self._draining = True
        if not self.alive:
            return 0
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("drain", (message, future)))
        return future.result(timeout)

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called (the server is stopping)."""
        return self._draining

    @property
    def state_snapshots(self) -> bool:
        """Whether requests' ``snapshot_at`` marks are used (a model with recurrent layers, paged, prefix caching)."""
        return self.pool_facts.state_snapshots

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- API for other threads -----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue ``request``; returns its handle at once (events arrive in ``loop`` if given, else a thread queue).

        Raises:
            PromptTooLongError: the prompt leaves no room in the model's context.
            ValueError: ``n`` exceeds ``max_sequences``, a ``logit_bias`` token is outside the vocabulary, or a
                constrained ``response_format`` comes to an engine without a tokenizer.
            QueueFullError: ``max_queue_depth`` requests are already waiting.
            EngineStoppedError: the engine is not running.
        """
        prompt_len = len(request.prompt)
        if self.context_length is not None and prompt_len >= self.context_length:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens but the model's context is {self.context_length} tokens "
                f"(prompt + at least one generated token must fit)")
        if self._kv_capacity is not None and prompt_len >= self._kv_capacity:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens but the KV cache budget holds {self._kv_capacity} tokens "
                f"(prompt + at least one generated token must fit; raise --kv-cache-budget)")
        if request.n > self.config.max_sequences:
            raise ValueError(f"n={request.n} exceeds the server's max_sequences={self.config.max_sequences}")
        if request.response_format is not None and request.response_format.constrained and self.tokenizer is None:
            raise ValueError("a constrained response_format needs the engine's tokenizer (none was given)")
        bias = request.params.logit_bias
        if bias and self.vocab_size is not None and max(bias) >= self.vocab_size:
            raise ValueError(f"logit_bias token {max(bias)} is outside the model's vocabulary of {self.vocab_size}")
        if self._draining:
            raise EngineStoppedError("the server is shutting down")
        if not self.alive:
            raise EngineStoppedError("the engine is not running")
        with self._lock:
            if self._queued >= self.config.max_queue_depth:
                raise QueueFullError(f"the request queue is full ({self.config.max_queue_depth} waiting)")
            self._queued += 1
        room = self.context_length - prompt_len if self.context_length is not None else request.params.max_tokens
        if self._kv_capacity is not None:  # a sequence alone must always fit the block pool (no endless preemption)
            room = min(room, self._kv_capacity - prompt_len)
        handle = RequestHandle(request, loop=loop)
        handle._wake = lambda: self._inbox.put(("wake", None))
        job = Job(request=request, handle=handle, max_tokens=min(request.params.max_tokens, room))
        self._inbox.put(("submit", job))
        return handle

    def stats(self) -> dict:
        """A snapshot of the engine's state and counters (safe from any thread; never touches MLX)."""
        with self._lock:
            snap = copy.deepcopy(self._snapshot)
            snap["waiting"] = self._queued
        snap["alive"] = self.alive
        return snap

    def reset_cache(self, timeout: float = 60.0, salt: str | None = None) -> dict:
        """Drop reusable cached state: the prefix cache's unreferenced blocks (paged) and MLX's buffer cache.

        Blocks held by running sequences stay; with ``salt`` only the blocks of prompts sent with that cache salt
        go. Returns what was cleared:
        ``{"mlx_cache_bytes_freed": ..., "prefix_cache_blocks_freed": ...}``.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("reset", (future, salt)))
        return future.result(timeout)

    def block_map(self, timeout: float = 10.0) -> dict | None:
        """The block pool's picture (:func:`mlxkv.kv.blocks.block_map.block_map`), taken on the engine thread
        between steps (any thread; None without a paged pool).

        Raises:
            EngineStoppedError: the engine is not running.
        """
        if not self.pool.is_paged:
            return None
        if not self.alive:
            raise EngineStoppedError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("block_map", future))
        return future.result(timeout)

    def kv_events(self, since: int = 0) -> dict | None:
        """The KV cache's events numbered above ``since`` (:meth:`mlxkv.kv.CachePool.kv_events`; any thread) in
        their JSON form: ``{"events": [{"seq": n, "type": ..., ...}], "cursor": newest number, "dropped": events
        missed}``; None without a paged pool.

        Raises:
            ValueError: ``since`` < 0.
        """
        batch = self.pool.kv_events(since)
        if batch is None:
            return None
        return {"events": [{"seq": n, **event_to_json(e)} for n, e in batch.events], "cursor": batch.cursor,
                "dropped": batch.dropped}

    # ---- engine thread -------------------------------------------------------------------------------------
    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1
            assert self._queued >= 0, "queue depth went negative"

    def _main(self) -> None:
        sched = self._scheduler
        try:
            fast_exp2_ready()  # the attention's compiled exponential: checked (built, on a new machine) before requests
            batched, self._batched_reason = self._decide_batching()
            sched.set_batching(batched, False)
            batched_prefill, self._batched_prefill_reason = self._decide_prefill_batching(batched)
            sched.set_batching(batched, batched_prefill)
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._start_error = exc
            self._running = False
        self._publish()
        self._started.set()
        try:
            while self._running:
                self.pool.persist_tier()  # the KV tier's write-behind sweep, when due (between steps only)
                self._release_idle_pool(sched.has_work())
                self._handle_commands(block=not sched.has_work())
                self._run_drains()
                if self._running and sched.has_work():
                    try:
                        with batched_wakeups():  # a step's events wake each event loop once
                            sched.step()
                    except Exception:  # noqa: BLE001 - the scheduler contains per-request failures; this is a bug
                        log.exception("engine step failed")
                        sched.end_all(Event("error", finish_reason="error",
                                            message="RuntimeError: internal engine error"))
                self._publish()
        finally:
            sched.end_all(Event("error", finish_reason="error", message="the engine stopped"))
            try:
                self.last_flush = self.pool.flush_tier(self._flush_timeout)
            except Exception:  # noqa: BLE001 - a failed flush loses cached blocks, never the shutdown
                log.exception("flushing the KV tier failed")
            self._publish()
            # MLX streams made by this thread must be destroyed by it, else the process can abort at exit
            # ("terminate called without an active exception"): MLX asks threads to clean up themselves.
            mx.synchronize()
            mx.clear_streams()

    def _decide_batching(self) -> tuple[bool, str]:
        wanted = self.config.batched_decode
        if wanted is False:
            return False, "disabled by configuration"
        if self.config.max_sequences < 2:
            return False, "max_sequences is 1"
        ok, reason = probe_batched_decode(self.model, self.pool)
        if wanted and not ok:
            raise RuntimeError(f"batched decode was required but does not work for this model: {reason}")
        if not ok:
            log.warning("batched decode unavailable (%s): decoding sequences one by one", reason)
        return ok, reason

    def _decide_prefill_batching(self, batched_decode: bool) -> tuple[bool, str]:
        """Batched prefill when configured, batched decode works and the prefill probe passes (else one by one,
        with a warning when it was asked for: the results are the same)."""
        if not self.config.batched_prefill:
            return False, "disabled by configuration"
        if not batched_decode:
            return False, "batched decode is off"
        ok, reason = probe_batched_prefill(self.model, self.pool)
        if not ok:
            log.warning("batched prefill unavailable (%s): prefilling sequences one by one", reason)
        return ok, reason

    def _take_submissions(self) -> bool:
        """The scheduler's intake (between a step's plans): handle what reached the inbox; whether any request
        was submitted."""
        before = self._scheduler.totals["requests"]
        self._handle_commands(block=False)
        return self._scheduler.totals["requests"] > before

    def _release_idle_pool(self, busy: bool) -> None:
        """A growing paged pool idle for its ``idle_release_s`` gives back the chunks above its first."""
        if busy:
            return
        due = self.pool.release_due_in()
        if due is not None and due <= 0 and self.pool.release_unused():
            self._kv_stats_at = 0.0
            self._publish()  # at once: the engine may now wait for a command as long as none comes

    def _handle_commands(self, block: bool) -> None:
        try:
            if block:  # idle: wake for the tier's next sweep and the pool's idle release too, if one is due
                dues = [d for d in (self.pool.tier_due_in(), self.pool.release_due_in()) if d is not None]
                command = self._inbox.get(timeout=min(dues)) if dues else self._inbox.get()
            else:
                command = self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "submit":
                self._scheduler.add(payload)
            elif kind == "reset":
                future, salt = payload
                blocks = self.pool.evict_cached(salt)  # cached blocks no sequence holds
                if salt is None:
                    self.pool.release_unused()  # a growing pool gives back the chunks nothing holds now
                self._kv_stats_at = 0.0  # republish at once
                freed = mx.get_cache_memory()
                mx.clear_cache()
                future.set_result({"mlx_cache_bytes_freed": int(freed), "prefix_cache_blocks_freed": blocks})
            elif kind == "block_map":
                try:
                    payload.set_result(self.pool.block_map())
                except Exception as exc:  # noqa: BLE001 - the reader's error, not the engine's
                    payload.set_exception(exc)
            elif kind == "drain":  # not between a step's plans (this may be the scheduler's intake): see _run_drains
                self._drains.append(payload)
            elif kind == "stop":
                self._flush_timeout = payload
                self._running = False
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run_drains(self) -> None:
        """End every unfinished request with the shutdown event, for each drain command received."""
        while self._drains:
            message, future = self._drains.pop(0)
            future.set_result(self._scheduler.end_all(Event("error", finish_reason="shutdown", message=message)))

    def _paged_stats(self, force: bool) -> dict:
        """Block and prefix-cache figures from the pool (its block scan is O(blocks): at most every 0.25 s
        while busy, always when idle)."""
        now = time.monotonic()
        if not self.pool.is_paged or (not force and now - self._kv_stats_at < 0.25):
            return self._kv_stats
        self._kv_stats = self.pool.block_stats()
        self._kv_stats_at = now
        return self._kv_stats

    def _speculative_stats(self, totals: dict) -> dict:
        """Speculative decoding's figures: tokens proposed and accepted, their ratio, and tokens committed per
        sequence per decode forward (1.0 without speculation)."""
        drafted, accepted = totals["draft_tokens"], totals["accepted_draft_tokens"]
        steps = totals["decode_rows"]
        spec = self.speculation
        stats = {"enabled": spec is not None, "drafter": spec.drafter_name if spec else None,
                 "num_draft_tokens": spec.num_draft_tokens if spec else None,
                 "verify_steps": totals["verify_steps"], "draft_tokens": drafted, "accepted_tokens": accepted,
                 "acceptance_rate": accepted / drafted if drafted else 0.0,
                 "tokens_per_forward": totals["decode_tokens"] / steps if steps else 0.0}
        if spec is not None and spec.draft is not None:
            stats["draft_model"] = spec.draft.stats()  # its forwards, rows per forward and its own pool
        return stats

    def _publish(self) -> None:
        sched = self._scheduler
        draft = self.speculation.draft if self.speculation is not None else None  # its pool's bytes count too
        totals = sched.totals
        queries, hits = totals["prefix_queries"], totals["prefix_hits"]
        snap = {
            "running": len(sched.running),
            "prefilling": len(sched.prefilling),
            "preempted": len(sched.preempted),
            "pool_sequences": len(self.pool),
            "max_sequences": self.config.max_sequences,
            "kv_backend": self.pool.backend,
            "kv_bytes": self.pool.memory_usage_bytes() + (draft.pool.memory_usage_bytes() if draft else 0),
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "batched_decode": sched.batched,
            "batched_decode_reason": self._batched_reason,
            "batched_prefill": sched.batched_prefill,
            "batched_prefill_reason": self._batched_prefill_reason,
            "context_length": self.context_length,
            # token-weighted, one lookup per request (parallel samples and resumes after preemption excluded)
            "prefix_cache": {"enabled": self.pool.prefix_caching, "queries": queries,
                             "hits": hits, "hit_rate": hits / queries if queries else 0.0},
            "kv_blocks": {"paged": False, "used": 0, "free": 0, "cached": 0},
            "evictions": 0,
            "preemptions": totals["preemptions"],
            "speculative": self._speculative_stats(totals),
            **self._paged_stats(force=not sched.has_work()),
            **{f"{k}_total" if k not in ("max_batch", "preemptions", "prefix_queries", "prefix_hits") else k: v
               for k, v in totals.items() if k not in ("preemptions", "prefix_queries", "prefix_hits")},
        }
        if self.vision is not None and self.vision.available:
            snap["vision"] = {**self.vision.stats(), "image_tokens": totals["image_tokens"],
                              "image_tokens_cached": totals["image_tokens_cached"]}
        with self._lock:
            self._snapshot = snap
