"""`GET /metrics` in Prometheus' text format (prometheus_client).

The request counters and each engine's state (running and waiting requests and programs,
KV blocks used, held, free and cached, and each member pool's: drafts, amateurs) are read
from `Backend.stats()` at each scrape, so they cannot drift from `/health`; the HTTP
answers by status are counted by `CountStatus`, an ASGI middleware outside every other, so
refusals (401, 413, ...) are counted too, and so are the 500s of unhandled errors; a
request's `TokenClock` times its deltas (time to first token, inter-token latency).
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from decodekit.server.backend import Backend

# Backend.counters -> (metric name without _total, help)
COUNTERS = {
    "requests": ("decodekit_requests", "Generation requests received"),
    "generated_tokens": ("decodekit_generated_tokens", "Tokens generated for the server's requests"),
    "cancelled": ("decodekit_cancelled_requests", "Requests cancelled (client gone or timed out)"),
    "timed_out": ("decodekit_timed_out_requests", "Requests that outlived the server's timeout"),
    "rejected": ("decodekit_rejected_requests", "Requests refused with 503 (queue full)"),
}
# Engine.stats() -> (gauge name, help), labelled by model
ENGINE_GAUGES = {
    "running_requests": ("decodekit_running_requests", "Requests the engine is decoding (programs too)"),
    "waiting_requests": ("decodekit_waiting_requests", "Requests queued for the engine (programs too)"),
    "running_programs": ("decodekit_running_programs", "Beam, speculative and contrastive requests running"),
    "waiting_programs": ("decodekit_waiting_programs", "Beam, speculative and contrastive requests queued"),
    "held_blocks": ("decodekit_kv_blocks_held", "KV blocks promised to running programs, not yet used"),
    "used_blocks": ("decodekit_kv_blocks_used", "KV blocks held by running requests"),
    "free_blocks": ("decodekit_kv_blocks_free", "KV blocks free"),
    "cached_blocks": ("decodekit_kv_blocks_cached", "KV blocks held by the prefix cache"),
    "total_blocks": ("decodekit_kv_blocks_total", "KV blocks in the engine's pool"),
}
# Engine.stats()["members"][name] -> (gauge name, help), labelled by model and member
MEMBER_GAUGES = {
    "used_blocks": ("decodekit_member_kv_blocks_used", "KV blocks used in a member pool (draft, amateur)"),
    "held_blocks": ("decodekit_member_kv_blocks_held", "KV blocks promised to programs in a member pool"),
    "cached_blocks": ("decodekit_member_kv_blocks_cached", "KV blocks a member pool's prefix cache holds"),
    "bytes": ("decodekit_member_kv_bytes", "Bytes of a member pool's KV storage"),
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BackendCollector:
    """The backend's counters and engine statistics, read at each scrape."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def collect(self):
        stats = self.backend.stats()
        for key, (name, help_text) in COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=stats[key])
        yield GaugeMetricFamily(
            "decodekit_worker_jobs", "Jobs queued or running in the worker thread", value=stats["worker_jobs"]
        )
        for key, (name, help_text) in ENGINE_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["model"])
            for model, engine in stats["models"].items():
                if key in engine:
                    family.add_metric([model], engine[key])
            yield family
        for key, (name, help_text) in MEMBER_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["model", "member"])
            for model, engine in stats["models"].items():
                for member, pool in engine.get("members", {}).items():
                    family.add_metric([model, member], pool[key])
            yield family


class Metrics:
    """The registry of one app (not the process-wide default: two servers, two registries)."""

    def __init__(self, backend: Backend):
        self.registry = CollectorRegistry(auto_describe=False)
        self.responses = Counter(
            "decodekit_http_responses", "HTTP answers by status code", ["status"], registry=self.registry
        )
        self.ttft = Histogram(
            "decodekit_time_to_first_token_seconds",
            "From a request's arrival to its first generated text",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "decodekit_inter_token_latency_seconds",
            "Between a sample's successive deltas (about one token each on the engine)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(BackendCollector(backend))

    def clock(self) -> TokenClock:
        """A clock for one request, started now."""
        return TokenClock(self)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TokenClock:
    """Times one request's deltas: its first (any sample) -> TTFT, each sample's gaps -> ITL."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.started = metrics, time.perf_counter()
        self.last: dict = {}  # sample key -> time of its last delta

    def tick(self, key) -> None:
        now = time.perf_counter()
        if not self.last:
            self.metrics.ttft.observe(now - self.started)
        elif key in self.last:
            self.metrics.itl.observe(now - self.last[key])
        self.last[key] = now


class CountStatus:
    """ASGI middleware: counts each HTTP answer by its status code."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.responses.labels(str(message["status"])).inc()
            await send(message)

        try:
            return await self.app(scope, receive, counting_send)
        except Exception:
            # An unhandled error: Starlette's outermost middleware (ServerErrorMiddleware, which
            # runs the app's `Exception` handler) answers 500 outside this one, so count it here.
            if not started:
                self.metrics.responses.labels("500").inc()
            raise
