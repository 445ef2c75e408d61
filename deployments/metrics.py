"""Service metrics through `ray.serve.metrics` (exported with Ray's Prometheus metrics, prefixed `ray_`).

Ray Serve adds the deployment, replica and application tags itself. One instance per replica process;
every method is cheap enough for the per-request path (a few dict operations).
"""

from __future__ import annotations

import os
import statistics
from collections import deque

from ray.serve.metrics import Counter, Gauge, Histogram

from deployments.errors import DISCONNECTED

# in seconds, Prometheus's base unit (what `histogram_quantile` dashboards and alert rules expect of `_seconds`)
_LATENCY_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
_PATCHES = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


class RecentTimings:
    """Phase durations of the last `size` requests or batches, read back as medians by `stats()` calls.

    The Prometheus histograms aggregate over a replica's life; benchmarks and operators also need "where does
    an idle request's time go right now" without a metrics pipeline."""

    def __init__(self, size: int = 64) -> None:
        self._rows: deque[dict[str, float]] = deque(maxlen=size)

    def add(self, **seconds: float) -> None:
        self._rows.append(seconds)

    def p50_ms(self) -> dict[str, float]:
        """{phase: median ms over the kept rows that have it}, plus "n": rows kept."""
        phases: dict[str, list[float]] = {}
        for row in self._rows:
            for k, v in row.items():
                phases.setdefault(k, []).append(v)
        return {k: round(statistics.median(v) * 1e3, 3) for k, v in phases.items()} | {"n": len(self._rows)}


class IngressMetrics:
    """Requests, images and latency as the clients see them."""

    def __init__(self) -> None:
        self.requests = Counter(
            "vision_requests",
            description="Requests to the ingress, by route (http|handle) and outcome "
            "(ok|client_error|unauthorized|overloaded|timeout|server_error|disconnected).",
            tag_keys=("route", "outcome"),
        )
        self.images = Counter("vision_request_images", description="Images received.", tag_keys=("route",))
        self.patches = Counter("vision_request_patches", description="Patches of the images received.")
        self.latency = Histogram(
            "vision_request_latency_seconds",
            description="Ingress request latency, decode to response.",
            boundaries=_LATENCY_S,
            tag_keys=("route",),
        )
        self.merged = Histogram(
            "vision_ingress_batch_images",
            description="Images per merged encoder request formed by ingress batching.",
            boundaries=_SIZES,
        )
        self.retries = Counter(
            "vision_encoder_call_retries",
            description="Encoder calls retried because their replica died or was unavailable.",
        )
        # the encoder-output cache (`deployments.ingress.cache`), per item looked up
        self.cache_hits = Counter(
            "vision_cache_hits",
            description="Items answered from the ingress's encoder-output cache (no decode, no encode), by kind "
            "(image|text).",
            tag_keys=("kind",),
        )
        self.cache_misses = Counter(
            "vision_cache_misses",
            description="Items looked up in the encoder-output cache and not found (then decoded and encoded), by "
            "kind (image|text).",
            tag_keys=("kind",),
        )
        self.cache_bytes = Gauge(
            "vision_cache_bytes",
            description="Bytes held by this ingress replica's encoder-output cache (outputs and bookkeeping; at most "
            "cache_mib).",
        )

    def request(self, route: str, outcome: str, images: int, patches: int, seconds: float) -> None:
        self.requests.inc(tags={"route": route, "outcome": outcome})
        if images:
            self.images.inc(images, tags={"route": route})
        if patches:
            self.patches.inc(patches)
        self.latency.observe(seconds, tags={"route": route})


# ingress counters of error answers, by metrics outcome
_ANSWER_COUNTS = {
    "client_error": "client_errors",
    "overloaded": "rejected",
    "timeout": "timed_out",
    "server_error": "server_errors",
}


class IngressTelemetry:
    """Everything an ingress replica records about its requests, behind one object: the Prometheus
    metrics (`metrics`), counters for `ingress_stats()` (`count`, `answered`) and, per route, the phases of
    the last requests (`timings`: parse, decode, encoder call, answer; and each encoder call's round trip)."""

    def __init__(self) -> None:
        self.metrics = IngressMetrics()
        self.timings = {
            "http": RecentTimings(),
            "handle": RecentTimings(),
            "inline_decode": RecentTimings(),
            # each encoder call's round trip, by transport ("inline" over gRPC, "by_reference")
            "encoder_call": RecentTimings(),
        }
        self.counts = {
            "merged_calls": 0,
            "merged_batches": 0,
            "encoder_requests": 0,
            "encoder_retries": 0,
            "encoder_backpressure": 0,
            "disconnected": 0,  # requests whose caller went away before the answer (no answer sent)
            "cache_hits": 0,  # items answered from the encoder-output cache
            "cache_misses": 0,  # items looked up there and not found
            # HTTP error answers: 4xx (but 408/429), 429/503, 408/504, other 5xx
            **dict.fromkeys(_ANSWER_COUNTS.values(), 0),
        }

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def answered(self, outcome: str) -> None:
        """An HTTP error answer with this metrics outcome."""
        self.counts[_ANSWER_COUNTS[outcome]] += 1

    def request(self, route: str, outcome: str, images: int, patches: int, seconds: float) -> None:
        """A request done, by outcome; `DISCONNECTED`: its caller went away (cancelled by Serve), never answered."""
        if outcome == DISCONNECTED:
            self.counts["disconnected"] += 1
        self.metrics.request(route, outcome, images, patches, seconds)

    def cache_lookups(self, kind: str, hits: int, misses: int) -> None:
        """Items of `kind` (image|text) looked up in the encoder-output cache."""
        self.counts["cache_hits"] += hits
        self.counts["cache_misses"] += misses
        if hits:
            self.metrics.cache_hits.inc(hits, tags={"kind": kind})
        if misses:
            self.metrics.cache_misses.inc(misses, tags={"kind": kind})

    def cache_held(self, nbytes: int) -> None:
        self.metrics.cache_bytes.set(nbytes)

    def snapshot(self) -> dict:
        return dict(self.counts) | {"timings_ms": {route: t.p50_ms() for route, t in self.timings.items()}}


class ReplicaMetrics:
    """What the encoder replica does with its requests' batches."""

    def __init__(self) -> None:
        self.requests = Counter("vision_encoder_requests", description="Requests the encoder replica ran.")
        self.images = Counter("vision_encoder_images", description="Images encoded.")
        self.patches = Counter("vision_encoder_patches", description="Real patches encoded.")
        self.padded = Counter("vision_encoder_padded_patches", description="Padding patches run by bucket graphs.")
        self.replays = Counter(
            "vision_encoder_bucket_replays", description="Graph replays by bucket budget.", tag_keys=("bucket",)
        )
        self.eager = Counter(
            "vision_encoder_eager_runs",
            description="Packs run eagerly: no bucket fits them, or a large pack its bucket would pad much.",
        )
        self.batch_requests = Histogram(
            "vision_encoder_batch_requests", description="Requests per replica batch.", boundaries=_SIZES
        )
        self.batch_images = Histogram(
            "vision_encoder_batch_images", description="Images per replica batch.", boundaries=_SIZES
        )
        self.batch_patches = Histogram(
            "vision_encoder_batch_patches", description="Real patches per replica batch.", boundaries=_PATCHES
        )
        self.queue_wait = Histogram(
            "vision_encoder_queue_wait_seconds",
            description="Time a request waited in the replica before its batch started.",
            boundaries=_LATENCY_S,
        )
        self.run_latency = Histogram(
            "vision_encoder_batch_latency_seconds",
            description="Device time of one batch: upload, patchify, bucket replays, download.",
            boundaries=_LATENCY_S,
        )
        self.queue_depth = Gauge("vision_encoder_queue_depth", description="Requests inside the replica.")
        self.captured = Gauge("vision_encoder_graphs_captured", description="Bucket graphs captured (0 on CPU).")
        self.health_checks = Counter(
            "vision_encoder_health_checks",
            description="Health checks (a tiny encode through the graph path), by result (ok|failed).",
            tag_keys=("result",),
        )
        self.health_probe = Histogram(
            "vision_encoder_health_probe_seconds",
            description="Latency of the health check's probe encode, queue wait included.",
            boundaries=_LATENCY_S,
        )

    def batch(self, requests: int, images: int, patches: int, waits_s: list[float], run_s: float, engine: dict) -> None:
        """One batch of requests; `engine`: what the engine's counters gained from it (`replica_pipeline.
        engine_delta`), not their totals, which also count the start-up and health-check encodes."""
        self.requests.inc(requests)
        self.images.inc(images)
        self.patches.inc(patches)
        self.batch_requests.observe(requests)
        self.batch_images.observe(images)
        self.batch_patches.observe(patches)
        for w in waits_s:
            self.queue_wait.observe(w)
        self.run_latency.observe(run_s)
        if engine["padded_patches"]:
            self.padded.inc(engine["padded_patches"])
        if engine["eager_runs"]:
            self.eager.inc(engine["eager_runs"])
        for budget, n in engine["replays"].items():
            self.replays.inc(n, tags={"bucket": str(budget)})


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm; 0 where it does not exist)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
