"""Prometheus metrics for ``/metrics``: engine gauges and counters read at scrape time, latency histograms.

Every figure comes from the engine's own stats snapshot (never from MLX on the HTTP thread). With the paged
backend, KV block gauges, evictions and cached blocks per retention priority come from the block manager;
prefix-cache queries and hits are prompt tokens (one lookup per request); preemptions count sequences sent
back for recompute. The dense backend reports zeros for the block figures.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlxkv.engine.request import Usage
from mlxkv.engine.scheduler import EngineObserver

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# (stats key, metric name, help): gauges, then counters (exposed with a _total suffix)
_GAUGES = (
    ("waiting", "mlxkv_queue_depth", "Requests waiting for admission."),
    ("running", "mlxkv_running_sequences", "Sequences decoding."),
    ("prefilling", "mlxkv_prefilling_requests", "Requests whose prompt is being prefilled."),
    ("pool_sequences", "mlxkv_open_sequences", "Sequences open in the cache pool."),
    ("kv_bytes", "mlxkv_kv_cache_bytes", "Bytes held by the open sequences' KV caches."),
    ("preempted", "mlxkv_preempted_sequences", "Sequences preempted and waiting to resume."),
)
_BLOCK_GAUGES = (
    ("used", "mlxkv_kv_blocks_used", "KV blocks held by sequences (paged storage)."),
    ("free", "mlxkv_kv_blocks_free", "Free KV blocks, evictable cached ones included (paged storage)."),
    ("cached", "mlxkv_kv_blocks_cached", "KV blocks holding reusable cached content (paged storage)."),
    ("total", "mlxkv_kv_blocks_total", "KV blocks in the pool (paged storage)."),
)
_COUNTERS = (
    ("prompt_tokens_total", "mlxkv_prompt_tokens", "Prompt tokens admitted."),
    ("generation_tokens_total", "mlxkv_generation_tokens", "Tokens generated."),
    ("evictions", "mlxkv_kv_evictions", "KV blocks evicted (paged storage)."),
    ("preemptions", "mlxkv_preemptions", "Sequences preempted (paged storage)."),
)

_VISION_COUNTERS = (
    ("encoder_cache_hits", "mlxkv_image_feature_cache_hits", "Images whose features came from the cache (the vision "
                                                             "tower skipped)."),
    ("encoder_cache_misses", "mlxkv_image_feature_cache_misses", "Images run through the vision tower."),
    ("image_tokens", "mlxkv_image_tokens", "Image placeholder tokens in admitted prompts."),
    ("image_tokens_cached", "mlxkv_image_tokens_cached", "Image placeholder tokens found in the prefix cache."),
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        yield from _rank_metrics(s.get("distributed"))
        for key, name, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(s.get(key, 0) or 0))
        blocks = s.get("kv_blocks", {})
        for key, name, doc in _BLOCK_GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(blocks.get(key, 0)))
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(s.get(key, 0) or 0))
        prefix = s.get("prefix_cache", {})
        yield CounterMetricFamily("mlxkv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=float(prefix.get("queries", 0)))
        yield CounterMetricFamily("mlxkv_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=float(prefix.get("hits", 0)))
        by_priority = GaugeMetricFamily("mlxkv_kv_blocks_cached_by_priority",
                                        "Cached KV blocks per retention priority (paged storage).", labels=["priority"])
        for priority, count in sorted(blocks.get("cached_by_priority", {}).items(), key=lambda kv: int(kv[0])):
            by_priority.add_metric([str(priority)], float(count))
        yield by_priority
        spec = s.get("speculative") or {}
        if spec.get("enabled"):  # mlxkv serve --prompt-lookup or --draft-model
            yield CounterMetricFamily("mlxkv_speculative_draft_tokens", "Tokens proposed by speculative decoding.",
                                      value=float(spec.get("draft_tokens", 0)))
            yield CounterMetricFamily("mlxkv_speculative_accepted_tokens", "Proposed tokens the model accepted.",
                                      value=float(spec.get("accepted_tokens", 0)))
            yield CounterMetricFamily("mlxkv_speculative_verify_steps", "Decode steps that verified proposals.",
                                      value=float(spec.get("verify_steps", 0)))
            yield GaugeMetricFamily("mlxkv_speculative_acceptance_rate", "Accepted / proposed tokens since start.",
                                    value=float(spec.get("acceptance_rate", 0.0)))
            yield GaugeMetricFamily("mlxkv_decode_tokens_per_forward", "Tokens committed per decode forward, per "
                                    "sequence (1.0 without speculation).",
                                    value=float(spec.get("tokens_per_forward", 0.0)))
        snaps = s.get("state_snapshots") or {}
        if snaps.get("enabled"):  # models with recurrent layers (paged)
            yield GaugeMetricFamily("mlxkv_state_snapshots", "Recurrent-state snapshots stored in the KV block pool.",
                                    value=float(snaps.get("count", 0)))
            yield CounterMetricFamily("mlxkv_state_snapshot_hits", "Prefix hits resumed from a recurrent-state "
                                      "snapshot.", value=float(snaps.get("hits", 0)))
        vision = s.get("vision")
        if vision:  # a vision-language model (docs/vision.md)
            for key, name, doc in _VISION_COUNTERS:
                yield CounterMetricFamily(name, doc, value=float(vision.get(key, 0)))
            yield GaugeMetricFamily("mlxkv_image_feature_cache_bytes", "Bytes of cached image features.",
                                    value=float(vision.get("encoder_cache_bytes", 0)))


class ServerMetrics(EngineObserver):
    """The server's metrics registry; also the engine's observer for latency histograms.

    Args:
        stats: the engine's ``stats`` function, read at each scrape (call :meth:`bind` if not known yet).
    """

    def __init__(self, stats: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = stats or (lambda: {})
        self.registry.register(_EngineCollector(lambda: self._stats()))
        self.ttft = Histogram("mlxkv_time_to_first_token_seconds", "Time from submission to the first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("mlxkv_time_per_output_token_seconds", "Mean time between a request's tokens.",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.requests = Counter("mlxkv_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=self.registry)

    def bind(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_request_finished(self, finish_reason: str, usage: Usage, time_per_output_token: float | None) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        if time_per_output_token is not None:
            self.tpot.observe(time_per_output_token)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _rank_metrics(dist: dict | None) -> Iterator:
    """Per-rank figures of a distributed server (``--distributed``; nothing otherwise)."""
    if not dist:
        return
    yield GaugeMetricFamily("mlxkv_distributed_ranks", "Ranks of the distributed launch.",
                            value=float(dist["world_size"]))
    if dist.get("bytes_per_block_per_rank"):
        yield GaugeMetricFamily("mlxkv_kv_block_bytes_per_rank", "Bytes of one KV block on each rank (its KV heads).",
                                value=float(dist["bytes_per_block_per_rank"]))
    for key, name, doc in (("mlx_active_bytes", "mlxkv_rank_mlx_active_bytes", "MLX active memory of each rank."),
                           ("mlx_peak_bytes", "mlxkv_rank_mlx_peak_bytes", "MLX peak memory of each rank.")):
        family = GaugeMetricFamily(name, doc, labels=["rank"])
        for rank in dist.get("ranks", []):
            family.add_metric([str(rank["rank"])], float(rank[key]))
        yield family
    tiers = [r for r in dist.get("ranks", []) if "tier" in r]  # with --host-cache-size / --kv-disk-cache
    if tiers:
        blocks = GaugeMetricFamily("mlxkv_rank_tier_blocks", "KV tier blocks each rank holds (its shard of each).",
                                   labels=["rank", "store"])
        restored = GaugeMetricFamily("mlxkv_rank_tier_restored_blocks",
                                     "Blocks each rank restored from its KV tier (prefix hits rank 0 agreed).",
                                     labels=["rank"])
        for rank in tiers:
            blocks.add_metric([str(rank["rank"]), "memory"], float(rank["tier"]["memory_blocks"]))
            blocks.add_metric([str(rank["rank"]), "disk"], float(rank["tier"]["disk_blocks"]))
            restored.add_metric([str(rank["rank"])], float(rank["tier"]["restored_blocks"]))
        yield blocks
        yield restored

