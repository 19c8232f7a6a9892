"""Prometheus metrics of the API processes, multiprocess-safe.

Per-request figures (requests by outcome, time to first audio, chunk intervals, real-time
factor, audio seconds, reference-cache hits and misses; WebSocket sessions open, utterances and
their time to first audio; what each server limit stopped, by its profile field) are recorded by whichever API process
served the request; with several API processes prometheus-client's multiprocess mode (its
``PROMETHEUS_MULTIPROC_DIR`` directory, set up by ``api.server``) sums them at scrape time.
Engine-wide figures (running and queued requests, talker and codec slots in use, ring bytes,
talker and coalesced codec batch sizes) are read from the engine's counters when scraped, so any
API process reports the one engine's current state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "mossvox"
OUTCOMES = ("ok", "client_error", "rejected", "failed", "cancelled")

# Engine counters that only grow (exported as Prometheus counters; the rest are gauges).
ENGINE_CUMULATIVE = frozenset({"submitted", "rejected", "failed", "finished_stop", "finished_length",
                               "aborted", "chunks", "audio_s", "decode_batches", "coordinator_busy_s",
                               "codec_emit_s", "client_route_s", "restarts", "talker_prompt_rows",
                               "talker_cached_rows", "admission_holds", "talker_restarts",
                               "codec_restarts", "hung_workers", "api_restarts"})

# HELP text of each engine counter (`engine.counters`, plus the API process's own `client_*`).
ENGINE_HELP = MappingProxyType({
    "healthy": "1 while the engine can serve: a replica is up or being restarted",
    "ready": "1 once every worker has loaded its model and warmed up",
    "running": "Requests in the workers: dispatched and not yet closed",
    "queued": "Requests waiting for admission",
    "admission_held": "1 while queued requests wait because a playing stream runs low on buffered audio",
    "admission_holds": "Times admission started holding queued requests for a playing stream that ran low",
    "talker_slots": "Requests held by the talker runners",
    "codec_slots": "Streaming-decode slots open in the codec workers",
    "encode_jobs": "Reference-audio encode jobs in flight",
    "ring_bytes": "Bytes in use in the coordinator's shared-memory rings",
    "submitted": "Requests submitted to the engine",
    "rejected": "Requests admission turned away (queue full, not ready, shutting down)",
    "failed": "Requests that failed in the engine (a worker died, a deadline passed, an error)",
    "finished_stop": "Requests that ended by themselves (finish reason stop)",
    "finished_length": "Requests that ended at their frame cap (finish reason length)",
    "aborted": "Requests aborted because their client left or gave up",
    "chunks": "PCM chunks the codec delivered to the API processes",
    "audio_s": "Seconds of audio the codec delivered",
    "decode_batches": "Coalesced codec decode dispatches",
    "decode_batch_wait_max_s": "Longest time a chunk waited in the codec's coalescing window, seconds",
    "talker_capacity": "Requests the live talkers can hold at once",
    "max_prompt_rows": "Rows the smallest talker KV cache holds: a prompt and its frames must fit (0 = unknown)",
    "codec_capacity": "Streaming-decode slots of the live codecs",
    "coordinator_busy_s": "Seconds the coordinator spent in its handlers (engine overhead)",
    "codec_emit_s": "Seconds the codec spent writing PCM and chunk records (ring overhead)",
    "codec_decode_s": "Seconds the codec spent in decode calls",
    "talker_step_s": "Seconds the talker spent in runner steps",
    "talker_prompt_rows": "Prompt rows the talkers took in",
    "talker_cached_rows": "Prompt rows the talkers took from their prefix caches instead of computing them",
    "replicas": "Talker and codec pairs launched",
    "replicas_up": "Replicas alive and serving",
    "restarts": "Workers or whole replicas restarted in place after a failure",
    "talker_restarts": "Talker workers replaced alone, the codec serving on",
    "codec_restarts": "Codec workers replaced alone, the talker keeping its state",
    "hung_workers": "Workers killed because their liveness beat stood still",
    "restart_last_s": "Seconds from the last replaced worker's death to its replica serving again",
    "api_restarts": "API processes replaced after one died",
    "client_ring_bytes": "Bytes of PCM waiting in this API process's rings",
    "client_open": "Requests open in this API process",
    "client_route_s": "Seconds this API process spent routing engine records",
    "decode_batch_sizes": "Streams decoded together per coalesced codec dispatch",
    "talker_batch_sizes": "Requests per talker step",
})
REPLICA_HELP = MappingProxyType({
    "up": "1 while this replica's talker and codec are alive",
    "running": "Requests dispatched to this replica, not yet closed",
    "dispatched": "Requests ever dispatched to this replica",
    "failed": "Requests that failed with this replica",
    "talker_slots": "Requests held by this replica's talker",
    "codec_slots": "Streaming-decode slots open in this replica's codec",
    "restarts": "Times this replica was restarted in place after a worker failed",
    "memory_card_bytes": "Total memory of this replica's GPU, bytes",
    "memory_usable_bytes": "Memory this replica's plan may use (memory.gpu_utilization of the card), bytes",
    "talker_memory_planned_bytes": "The talker's share of the memory plan, its CUDA context included, bytes",
    "talker_memory_peak_bytes": "The most the talker's allocator held by the end of its warm-up, bytes",
    "talker_kv_tokens": "Tokens the talker's KV cache holds",
    "codec_memory_planned_bytes": "The codec's share of the memory plan, its CUDA context included, bytes",
    "codec_memory_peak_bytes": "The most the codec's allocator held by the end of its warm-up, bytes",
})


def engine_help(key: str) -> str:
    """The HELP text of engine counter ``key`` (``replica<k>_<field>`` names its replica)."""
    if key in ENGINE_HELP:
        return ENGINE_HELP[key]
    replica, _, field = key.partition("_")
    if replica.startswith("replica") and replica[7:].isdigit() and field in REPLICA_HELP:
        return f"Replica {replica[7:]}: {REPLICA_HELP[field][0].lower()}{REPLICA_HELP[field][1:]}"
    return f"Engine counter {key}"


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


def multiprocess_dir() -> str | None:
    """The prometheus-client multiprocess directory of this server, if it runs in that mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ApiMetrics:
    """This process's request metrics plus a scrape-time view of the engine counters."""

    def __init__(self, engine_counters: Callable[[], Mapping[str, object]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Speech requests by outcome", ["outcome"], registry=r)
        self.ttfa = Histogram(f"{PREFIX}_time_to_first_audio_seconds",
                              "Request received to first audio bytes handed to the server",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.chunk_interval = Histogram(f"{PREFIX}_chunk_interval_seconds",
                                        "Time between consecutive audio chunks of one request",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram(f"{PREFIX}_real_time_factor", "Generation wall time / audio duration",
                             buckets=_RTF_BUCKETS, registry=r)
        self.coalesce_wait = Histogram(f"{PREFIX}_codec_coalesce_wait_seconds",
                                       "Time an audio chunk waited in the codec's coalescing window",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter(f"{PREFIX}_audio_seconds", "Seconds of audio produced", registry=r)
        self.ref_cache = Counter(f"{PREFIX}_ref_cache_lookups", "Reference-code cache lookups by result",
                                 ["result"], registry=r)
        self.stream_cuts = Counter(f"{PREFIX}_streams_cut",
                                   "Streams the engine could not finish after audio began (cut with an "
                                   "error event or a closed body), by reason: worker_lost, deadline, "
                                   "engine_failed, shutdown, error", ["reason"], registry=r)
        self.ref_cache_evicted = Counter(f"{PREFIX}_ref_cache_evicted_files", "Reference-cache files removed "
                                         "to stay within api.ref_cache_max_bytes", registry=r)
        self.stream_sessions = Gauge(f"{PREFIX}_stream_sessions_open",
                                     "Open WebSocket speech sessions (/v1/audio/speech/stream)",
                                     multiprocess_mode="livesum", registry=r)
        self.stream_utterances = Counter(f"{PREFIX}_stream_utterances",
                                         "Utterances spoken to the end over WebSocket sessions",
                                         registry=r)
        self.stream_ttfa = Histogram(f"{PREFIX}_stream_time_to_first_audio_seconds",
                                     "WebSocket sessions: the input.text that completed an "
                                     "utterance's first sentence to its first audio frame",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.connections_open = Gauge(f"{PREFIX}_connections_open", "Open client connections (HTTP and "
                                      "WebSocket)", multiprocess_mode="livesum", registry=r)
        self.held_audio = Gauge(f"{PREFIX}_held_audio_bytes", "Bytes of audio made for clients and not "
                                "sent yet (api.max_held_audio_bytes)", multiprocess_mode="livesum", registry=r)
        self.limits = Counter(f"{PREFIX}_limit_hits", "Requests, connections and streams a server limit "
                              "stopped, by the profile field of the limit", ["limit"], registry=r)
        self.loop_lag = Histogram(f"{PREFIX}_api_loop_lag_seconds",
                                  "How late an API process's event loop ran a 20 ms timer: "
                                  "the wait requests and chunks had there", buckets=_LAG_BUCKETS, registry=r)
        self._engine_counters = engine_counters

    def limit_hit(self, limit: str) -> None:
        """One request, connection or stream stopped by ``limit`` (its profile field)."""
        self.limits.labels(limit=limit).inc()

    def render(self) -> bytes:
        """The exposition text: this server's request metrics (all processes) + engine gauges."""
        path = multiprocess_dir()
        if path:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=path)
        else:
            registry = CollectorRegistry()
            registry.register(_Forward(self.registry))
        if self._engine_counters is not None:
            registry.register(EngineCollector(self._engine_counters))
        return generate_latest(registry)


class _Forward(Collector):
    def __init__(self, inner: CollectorRegistry) -> None:
        self.inner = inner

    def collect(self):
        return self.inner.collect()


class EngineCollector(Collector):
    """Engine counters as metrics, read when scraped.

    Numbers become gauges ``mossvox_engine_<key>`` (e.g. ``..._running``, ``..._queued``,
    ``..._talker_slots``, ``..._codec_slots``); ``ENGINE_CUMULATIVE`` keys and keys ending in
    ``_total`` become counters (``..._total``); a
    mapping of ``{batch size: count}`` becomes a histogram ``mossvox_engine_<key>`` (talker and
    coalesced codec batch sizes)."""

    def __init__(self, counters: Callable[[], Mapping[str, object]]) -> None:
        self.counters = counters

    def collect(self) -> Iterable:
        try:
            values = dict(self.counters())
        except Exception:  # an engine that is down has no counters; /metrics must still answer
            values = {}
        up = GaugeMetricFamily(f"{PREFIX}_engine_up", "1 when the engine answered the scrape")
        up.add_metric([], 1.0 if values else 0.0)
        yield up
        for key, value in sorted(values.items()):
            name = f"{PREFIX}_engine_{_metric_name(key)}"
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)):
                if name.endswith("_total") or key in ENGINE_CUMULATIVE:
                    base = name[: -len("_total")] if name.endswith("_total") else name
                    metric = CounterMetricFamily(base, engine_help(key))
                else:
                    metric = GaugeMetricFamily(name, engine_help(key))
                metric.add_metric([], float(value))
                yield metric
            elif isinstance(value, Mapping) and value:
                yield _size_histogram(name, key, value)


def _size_histogram(name: str, key: str, counts: Mapping) -> HistogramMetricFamily:
    """``{size: count}`` -> cumulative histogram buckets at each observed size."""
    sizes = sorted((float(k), int(v)) for k, v in counts.items())
    buckets, running, total = [], 0, 0.0
    for size, count in sizes:
        running += count
        total += size * count
        buckets.append((f"{size:g}", running))
    buckets.append(("+Inf", running))
    metric = HistogramMetricFamily(name, engine_help(key))
    metric.add_metric([], buckets, sum_value=total)
    return metric


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key.lower())
