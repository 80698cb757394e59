"""/metrics: the daemon's health in Prometheus text format, written by prometheus_client.

One registry per app (never the process-global one), so tests and several apps in one
process do not collide. Three feeds:

  - a route middleware: requests by route, method and status, and total latency;
  - the engine's control events (memrad.protocol records, the same ones the TUI sees):
    decisions by outcome and tier, declines by reason class, TTFT, token counts, prefill
    and decode speed, parks and evictions, and a ledger of parked bytes kept from the
    park/evict events alone, to check the pool's own byte count against;
  - a collector read at scrape time: pool sessions and bytes, queue depth, and the
    process's resident memory (prometheus_client's ProcessCollector).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from memrad.protocol import DecisionEvent, EvictEvent, ParkEvent, TurnEvent

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKENS_PER_S = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000)
CLIENT_GONE = "499"  # nginx's code for "the client closed the connection first"
# Set on a request whose client left (memrad.server.serving).
CLIENT_GONE_KEY = web.RequestKey("memra_client_gone", bool) if hasattr(web, "RequestKey") else "memra_client_gone"
# Set on a stream that failed after its 200 left: the status its error event carried.
STREAM_FAILED_KEY = web.RequestKey("memra_stream_failed", int) if hasattr(web, "RequestKey") else "memra_stream_failed"


class Metrics:
    """Counters and histograms for one app; `observe` is safe from any thread."""

    def __init__(self, state: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("memra_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("memra_http_request_duration_seconds", "Time from request to the last byte",
                                 ["route"], buckets=SECONDS, registry=r)
        self.ttft = Histogram("memra_ttft_seconds", "Time to first token of finished generations",
                              buckets=SECONDS, registry=r)
        self.tokens = Counter("memra_tokens", "Tokens by kind: prompt, cached (reused from the pool), completion",
                              ["kind"], registry=r)
        self.prefill_speed = Histogram("memra_prefill_tokens_per_second",
                                       "Primed (uncached) prompt tokens per second of TTFT, per request",
                                       buckets=TOKENS_PER_S, registry=r)
        self.decode_speed = Histogram("memra_decode_tokens_per_second",
                                      "Generated tokens after the first per second of decoding, per request",
                                      buckets=TOKENS_PER_S, registry=r)
        self.draft_tokens = Counter("memra_draft_tokens", "Tokens drafted from the context and verified, by kind: "
                                    "drafted, accepted (memrad.engine.speculation)", ["kind"], registry=r)
        self.decode_steps = Counter("memra_decode_steps", "Decode steps of finished replies, by kind: verify (drafts "
                                    "as rows of one step), plain; completion tokens over these is tokens per step",
                                    ["kind"], registry=r)
        self.decisions = Counter("memra_decisions", "Reuse decisions by outcome and nominating tier",
                                 ["outcome", "tier"], registry=r)
        self.declines = Counter("memra_declines", "Requests that reused nothing, by reason class",
                                ["reason_class"], registry=r)
        self.parks = Counter("memra_parks", "Sessions parked in memory", registry=r)
        self.spills = Counter("memra_spills", "Sessions the memory cap moved to the disk tier", registry=r)
        self.evictions = Counter("memra_evictions", "Parked sessions dropped (from memory without a disk copy, "
                                 "or from disk)", registry=r)
        self.spill_failures = Counter("memra_spill_failures", "Evicted sessions whose write to the disk tier "
                                      "failed: lost (the log says why)", registry=r)
        self._ledger: dict[str, int] = {}
        self._lock = threading.Lock()
        ProcessCollector(registry=r)
        if state is not None:
            r.register(_StateCollector(state, self.ledger_bytes))

    def observe(self, event: object) -> None:
        """Count one control event (called on the engine thread)."""
        if isinstance(event, DecisionEvent):
            d = event.decision
            self.decisions.labels(d.outcome, d.tier or "none").inc()
            if d.outcome != "resumed":
                self.declines.labels(d.reason_class or "other").inc()
        elif isinstance(event, TurnEvent):
            self._turn(event)
        elif isinstance(event, ParkEvent):
            (self.spills if event.session.on_disk else self.parks).inc()
            with self._lock:  # the ledger is the memory tier's: a spill to disk leaves it
                if event.replaced is not None:
                    self._ledger.pop(event.replaced, None)
                if not event.session.on_disk:
                    self._ledger[event.session.session_id] = event.session.num_bytes
        elif isinstance(event, EvictEvent):
            self.evictions.inc()
            if event.spill_failed is not None:
                self.spill_failures.inc()
            with self._lock:
                self._ledger.pop(event.session_id, None)

    def _turn(self, t: TurnEvent) -> None:
        self.tokens.labels("prompt").inc(t.prompt_tokens)
        self.tokens.labels("cached").inc(t.cached_tokens)
        self.tokens.labels("completion").inc(t.completion_tokens)
        spec = t.speculation
        if spec is not None and spec.on:
            self.draft_tokens.labels("drafted").inc(spec.drafted_tokens)
            self.draft_tokens.labels("accepted").inc(spec.accepted_tokens)
            self.decode_steps.labels("verify").inc(spec.verify_steps)
            self.decode_steps.labels("plain").inc(spec.decode_steps - spec.verify_steps)
        if t.ttft_s is None or t.ttft_s <= 0:
            return
        self.ttft.observe(t.ttft_s)
        self.prefill_speed.observe((t.prompt_tokens - t.cached_tokens) / t.ttft_s)
        decode_s = (t.total_s or 0.0) - t.ttft_s
        if t.completion_tokens > 1 and decode_s > 0:
            self.decode_speed.observe((t.completion_tokens - 1) / decode_s)

    def ledger_bytes(self) -> int:
        with self._lock:
            return sum(self._ledger.values())

    def request_done(self, route: str, method: str, status: int | str, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges read when scraped, so they are never stale: pool, queue, the event ledger."""

    def __init__(self, state: Callable[[], dict], ledger: Callable[[], int]) -> None:
        self._state = state
        self._ledger = ledger

    def collect(self) -> Iterable[Metric]:
        for name, value in {**self._state(), "pool_bytes_ledger": self._ledger()}.items():
            help_text, label = GAUGES[name]
            family = GaugeMetricFamily(f"memra_{name}", help_text, labels=[label] if label else None)
            for label_value, number in (value.items() if label else [((), value)]):
                family.add_metric([label_value] if label else [], number)
            yield family


# name -> (help, label name or None). The state callable returns {name: value} or, for a
# labelled gauge, {name: {label value: value}}.
GAUGES = {
    "pool_sessions": ("Parked sessions by tier (memory, disk)", "tier"),
    "pool_bytes": ("Bytes of parked state by tier (memory, disk), as the pool counts them", "tier"),
    "pool_max_bytes": ("The pool's byte cap (memory tier)", None),
    "pool_max_sessions": ("The pool's session cap", None),
    "pool_bytes_ledger": ("Parked bytes in memory per the park/evict events alone (checks pool_bytes)", None),
    "queue_depth": ("Requests waiting for the model", None),
    "running_requests": ("Requests on the model now (0 to max_batch)", None),
    "threads": ("The engine's intra-op threads per phase now (prefill, decode, batch); the reason: "
                "`memrad status`", "phase"),
}

METRICS = web.AppKey("metrics", Metrics)


def route_label(request: web.Request) -> str:
    """The route's pattern ("/v1/chat/completions"); one label for every unknown path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def count_requests(request: web.Request, handler) -> web.StreamResponse:
    """Outermost middleware: sees the status the client got, errors included."""
    started = time.perf_counter()
    status: int | str = CLIENT_GONE
    try:
        response = await handler(request)
        # A stream's status left as 200 before its client went or its generation failed:
        # count what happened.
        status = CLIENT_GONE if request.get(CLIENT_GONE_KEY) else request.get(STREAM_FAILED_KEY, response.status)
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        request.app[METRICS].request_done(route_label(request), request.method, status,
                                          time.perf_counter() - started)


def parse_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The reading side, for tests and harnesses: {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
