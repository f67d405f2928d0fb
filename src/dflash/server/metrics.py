"""Prometheus metrics, in a registry of the app's own (several apps in one process never collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dflash.kv.prefix_cache import PrefixCacheStats
from dflash.server.turn import Outcome

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_ACCEPTANCE_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "dflash_http_requests", "HTTP requests by route and status", ["route", "method", "status"], registry=r
        )
        self.requests = Counter(
            "dflash_requests",
            "Generation requests by API and outcome (stop, length, tool_calls, cancelled, invalid, error, overloaded)",
            ["api", "outcome"], registry=r,
        )
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed", ["api"], registry=r)
        self.completion_tokens = Counter("dflash_completion_tokens", "Tokens generated", ["api"], registry=r)
        self.latency = Histogram(
            "dflash_request_latency_seconds", "Arrival to last token", ["api"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds", "Arrival to first generated token", ["api"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "dflash_queue_wait_seconds", "Time a request waited in the queue for a free generation slot",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.acceptance = Histogram(
            "dflash_acceptance_length", "Mean tokens committed per speculative round, per request",
            buckets=_ACCEPTANCE_BUCKETS, registry=r,
        )
        self.fallbacks = Counter(
            "dflash_spec_fallbacks", "Speculative generations retried with plain decoding", registry=r
        )
        self.errors = Counter("dflash_generation_errors", "Generations that failed with an error", ["api"], registry=r)
        self.cancelled = Counter(
            "dflash_cancelled", "Generations stopped because the client went away", ["api", "stage"], registry=r
        )
        self.degenerate = Counter(
            "dflash_degenerate_stops", "Turns ended by DFLASH_DEGENERATE_RUN_TOKENS", registry=r
        )
        self.stall_continuations = Counter(
            "dflash_stall_continuations", "Turns continued by DFLASH_STALL_TOOL_PREFIX", registry=r
        )
        self.timeouts = Counter(
            "dflash_request_timeouts", "Turns ended by --request-timeout (answered with finish reason length)",
            registry=r,
        )
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for the worker", registry=r)
        self.busy = Gauge("dflash_busy", "1 while a generation runs", registry=r)
        self.running = Gauge("dflash_requests_running", "Requests generating now", registry=r)
        self.waiting = Gauge("dflash_requests_waiting", "Requests queued for a free generation slot", registry=r)
        self.batch_size = Histogram(
            "dflash_batch_size", "Requests decoded together in one engine step", buckets=_BATCH_BUCKETS, registry=r
        )

    def bind_worker(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the worker's queue and pool at scrape time."""
        self.queue_depth.set_function(lambda: float(waiting()))
        self.waiting.set_function(lambda: float(waiting()))
        self.running.set_function(lambda: float(running()))
        self.busy.set_function(lambda: 1.0 if running() > 0 else 0.0)

    def observe_batch(self, size: int) -> None:
        """Called by the engine after each batched step (on its own thread)."""
        self.batch_size.observe(size)

    def bind_prefix_cache(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self.registry.register(PrefixCacheCollector(stats))

    def bind_speculation_pauses(self, pauses: Callable[[], tuple[int, int]]) -> None:
        self.registry.register(SpeculationPauseCollector(pauses))

    def observe_outcome(self, api: str, outcome: Outcome, latency_s: float) -> None:
        self.requests.labels(api, outcome.finish_reason).inc()
        if outcome.finish_reason == "cancelled":
            self.cancelled.labels(api, "running").inc()
        self.prompt_tokens.labels(api).inc(outcome.prompt_tokens)
        self.completion_tokens.labels(api).inc(outcome.completion_tokens)
        self.latency.labels(api).observe(latency_s)
        if outcome.ttft_s is not None:
            self.ttft.labels(api).observe(outcome.ttft_s)
        if outcome.stats.rounds:
            self.acceptance.observe(outcome.stats.acceptance_length)
        if outcome.stats.fallbacks:
            self.fallbacks.inc(outcome.stats.fallbacks)
        if outcome.degenerate:
            self.degenerate.inc()
        if outcome.continued:
            self.stall_continuations.inc()

    def observe_error(self, api: str, latency_s: float, *, client_error: bool) -> None:
        self.requests.labels(api, "invalid" if client_error else "error").inc()
        if not client_error:
            self.errors.labels(api).inc()
        self.latency.labels(api).observe(latency_s)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(max(0.0, seconds))

    def observe_overloaded(self, api: str) -> None:
        self.requests.labels(api, "overloaded").inc()

    def observe_dropped(self, api: str) -> None:
        self.requests.labels(api, "cancelled").inc()
        self.cancelled.labels(api, "queued").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class PrefixCacheCollector(Collector):
    """The engine's prefix cache counters, read at scrape time (the cache keeps them; nothing is copied)."""

    def __init__(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield CounterMetricFamily("dflash_prefix_cache_hits", "Prompt lookups that reused at least one cached block",
                                  value=s.hits)
        yield CounterMetricFamily("dflash_prefix_cache_misses", "Prompt lookups that reused nothing", value=s.misses)
        yield CounterMetricFamily("dflash_prefix_cache_evictions", "Cached blocks evicted to stay under the budget",
                                  value=s.evictions)
        yield CounterMetricFamily("dflash_prefix_cache_reused_tokens",
                                  "Prompt tokens restored from the prefix cache instead of prefilled", value=s.reused_tokens)
        yield GaugeMetricFamily("dflash_prefix_cache_tokens", "Prompt positions held in the prefix cache", value=s.tokens)
        yield GaugeMetricFamily("dflash_prefix_cache_bytes", "Bytes held in the prefix cache", value=s.bytes)
        yield GaugeMetricFamily("dflash_prefix_cache_budget_bytes", "Memory budget of the prefix cache",
                                value=s.budget_bytes)


class SpeculationPauseCollector(Collector):
    """The batched engine's speculation pauses under load (`dflash.batch.speculation_pause`), read at scrape time:
    why speculative requests decode plainly while many requests share the server."""

    def __init__(self, pauses: Callable[[], tuple[int, int]]) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Metric]:
        pauses, requests = self.pauses()
        yield CounterMetricFamily("dflash_speculation_pauses",
                                  "Times speculation paused under load where rounds were predicted slower than plain "
                                  "steps", value=pauses)
        yield CounterMetricFamily("dflash_speculation_paused_requests",
                                  "Speculative requests that decoded plainly because speculation paused under load",
                                  value=requests)
