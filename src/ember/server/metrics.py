"""Prometheus metrics for operators: `GET /metrics` on `ember serve`.

Exported (names as scraped):

* `ember_http_requests_total{route,method,status}` and
  `ember_http_request_duration_seconds{route,method}` (histogram): every HTTP request,
  labelled by the matched route's path *template* (`/api/v1/training_runs/{run_id}`), or
  `unmatched` — never the raw path, so ids cannot blow up the label set.
* `ember_futures{state}` (gauge, at scrape time): `pending` = futures of this server
  lifetime not finished yet; `complete` / `failed` = futures finished since start-up.
* `ember_futures_finished_total{request_type,state}`: the same completions by kind.
* `ember_run_queue_depth{run_id}` (gauge, at scrape time): requests waiting in each live
  training run's seq_id sequencer (only live runs, so the label set stays bounded).
* `ember_samples_total`, `ember_sampled_tokens_total`: sequences and tokens returned by
  completed `sample` requests; `ember_optim_steps_total`: completed optimizer steps;
  `ember_trained_tokens_total`: target tokens of completed `forward_backward` requests.
* Per API key, labelled `key` = the first 8 hex digits of the key's sha256 (never the key;
  `ember.server.config.short_key_id`): `ember_key_trained_tokens_total{key}`,
  `ember_key_sampled_tokens_total{key}`, `ember_key_runs_created_total{key}` (completed
  `create_model`s) since start-up, and `ember_key_checkpoint_bytes{key}` (gauge, at scrape
  time: bytes of the key's stored checkpoints, for the keys seen since start-up and the
  configured ones).
* `ember_weight_sync_seconds{mode}` (histogram): how long each new weight version took to
  reach its sampler: `memory` = a run's tensors handed over (ephemeral snapshots; with
  `--sampler.weight_sync memory` also `save_weights_for_sampler`), `files` = a checkpoint
  read back from disk (`ServiceAPI.add_weight_sync_listener`).
* `ember_sampler_replica_up{model,replica}` (gauge: 1 while the replica is in its pool's
  ring, 0 while it is out or being replaced) and
  `ember_sampler_replica_requests_total{model,replica}` (requests routed to it since
  start-up) and `ember_sampler_replica_queue_depth{model,replica}` (gauge: requests routed
  to it and not answered yet, queued or running: the depth the router compares against
  `max_imbalance`): base models served by `SamplerConfig.replicas > 1` only (bounded:
  models x replicas).
* `ember_sampler_active_sequences{model}` and `ember_sampler_waiting_requests{model}`
  (gauges): sequences holding a sampler slot now, and requests waiting for one, per base
  model whose sampler reports them (`TorchSampler.load`): what a streaming client that
  hung up must not leave behind.
* `process_*` (prometheus-client's process collector: `process_resident_memory_bytes`,
  CPU seconds, open fds) and `python_gc_*`.

Every app gets its own `CollectorRegistry` (never the global default), so several apps in
one process (tests) do not clash. The service knows nothing of Prometheus, and the metrics
read it through `ServiceAPI` only: completions arrive through `add_future_listener`, weight
syncs through `add_weight_sync_listener`, gauges come from `gauges()` and
`checkpoint_bytes(owner)` at scrape time.

Auth: by default (`ServerConfig.metrics_auth = True`) a scrape needs an accepted API key,
as `X-API-Key` or `Authorization: Bearer` (what Prometheus' `authorization` scrape setting
sends), because the metrics name every tenant's live runs. `--metrics-auth off` serves
them to anyone who reaches the port (the usual Prometheus convention, for a port only the
scraper can reach). The route sits outside `/api/v1`, so no API dependency applies by
accident either way.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.server.config import ADMIN_OWNER, ServerConfig, presented_key, short_key_id
from ember.server.errors import AuthError
from ember.service.api import FutureState, ServiceAPI, ServiceGauges
from ember.service.metric_history import target_tokens

METRICS_PATH = "/metrics"
UNMATCHED = "unmatched"
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
# Long-polls of retrieve_future take up to ServerConfig.long_poll_s (20 s): buckets reach past it.
_SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EmberMetrics:
    """The registry of one app and the instruments the server updates."""

    def __init__(self, service: ServiceAPI | None, config: ServerConfig | None = None) -> None:
        """`service` None: an app without a service (its OpenAPI schema only) reports no gauges."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.key_id = KeyIds(config)
        self.owners_seen: set[str] = set(self.key_id.known)  # whose checkpoint bytes a scrape reports
        self._owners_lock = threading.Lock()
        self.key_trained = Counter("ember_key_trained_tokens", "Target tokens of completed forward_backward "
                                   "requests, per API key", ("key",), registry=r)
        self.key_sampled = Counter("ember_key_sampled_tokens", "Tokens returned by completed sample requests, "
                                   "per API key", ("key",), registry=r)
        self.key_runs = Counter("ember_key_runs_created", "Training runs created (completed create_model), per "
                                "API key", ("key",), registry=r)
        self.requests = Counter("ember_http_requests", "HTTP requests by route template, method and status",
                                ("route", "method", "status"), registry=r)
        self.latency = Histogram("ember_http_request_duration_seconds", "HTTP request latency (to the last "
                                 "body byte)", ("route", "method"), buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("ember_futures_finished", "Futures finished since start-up",
                                ("request_type", "state"), registry=r)
        self.samples = Counter("ember_samples", "Sequences returned by completed sample requests", registry=r)
        self.sampled_tokens = Counter("ember_sampled_tokens", "Tokens in sequences returned by completed "
                                      "sample requests", registry=r)
        self.optim_steps = Counter("ember_optim_steps", "Completed optimizer steps", registry=r)
        self.trained_tokens = Counter("ember_trained_tokens", "Target tokens of completed forward_backward "
                                      "requests", registry=r)
        self.weight_sync = Histogram("ember_weight_sync_seconds", "Seconds for a new weight version to reach its "
                                     "sampler, by mode (memory | files)", ("mode",), buckets=_SYNC_BUCKETS, registry=r)
        if service is not None:
            service.add_weight_sync_listener(lambda mode, seconds: self.weight_sync.labels(mode).observe(seconds))
        self._service = service
        r.register(ServiceCollector(service, self))
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (Linux /proc)
        GCCollector(registry=r)

    def observe_future(self, state: FutureState) -> None:
        """Listener for `ServiceAPI.add_future_listener`: runs on the thread that finished it."""
        self.finished.labels(state.request_type, state.status).inc()
        if state.status != "complete":
            return
        owner = self._owner_of(state.request_id)
        key = self.key_id(owner) if owner is not None else None
        if state.request_type == "OptimStep":
            self.optim_steps.inc()
        elif state.request_type == "CreateModel" and key is not None:
            self.key_runs.labels(key).inc()
        elif state.request_type == "ForwardBackward":
            n = target_tokens(state.result)
            self.trained_tokens.inc(n)
            if key is not None:
                self.key_trained.labels(key).inc(n)
        elif state.request_type == "Sample":
            sequences = getattr(state.result, "sequences", None) or []
            n = sum(len(s.tokens) for s in sequences)
            self.samples.inc(len(sequences))
            self.sampled_tokens.inc(n)
            if key is not None:
                self.key_sampled.labels(key).inc(n)

    def _owner_of(self, request_id: str) -> str | None:
        owner = self._service.future_owner(request_id) if self._service is not None else None
        if owner is not None and owner not in self.owners_seen:
            with self._owners_lock:
                self.owners_seen.add(owner)
        return owner

    def key_usage(self) -> dict[str, dict[str, float]]:
        """key id -> {trained_tokens, sampled_tokens, runs_created} since start-up (`ember admin usage`)."""
        out: dict[str, dict[str, float]] = {}
        for name, counter in (("trained_tokens", self.key_trained), ("sampled_tokens", self.key_sampled),
                              ("runs_created", self.key_runs)):
            for m in counter.collect():
                for s in m.samples:
                    if s.name.endswith("_total"):
                        out.setdefault(s.labels["key"], {})[name] = s.value
        return out

    def finished_count(self, status: str) -> float:
        """Futures finished with `status` since start-up (sum over request types)."""
        return sum(s.value for m in self.finished.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("state") == status)

    def token_totals(self) -> dict[str, float]:
        """Tokens trained and sampled since start-up (the status line's rates)."""
        return {name: sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
                for name, counter in (("trained_tokens", self.trained_tokens), ("sampled_tokens", self.sampled_tokens))}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServiceCollector(Collector):
    """Gauges read from the service at scrape time: O(live runs), and one checkpoint-bytes
    query per key seen (`ember_key_checkpoint_bytes`)."""

    def __init__(self, service: ServiceAPI | None, metrics: EmberMetrics) -> None:
        self.service, self.metrics = service, metrics

    def collect(self):
        gauges = self.service.gauges() if self.service is not None else ServiceGauges()
        futures = GaugeMetricFamily("ember_futures", "Futures by state: pending now; complete and failed "
                                    "since start-up", labels=["state"])
        futures.add_metric(["pending"], gauges.futures_pending)
        for status in ("complete", "failed"):
            futures.add_metric([status], self.metrics.finished_count(status))
        yield futures
        depth = GaugeMetricFamily("ember_run_queue_depth", "Requests waiting in a live training run's seq_id "
                                  "sequencer", labels=["run_id"])
        for run_id, queued in sorted(gauges.run_queue_depths.items()):
            depth.add_metric([run_id], queued)
        yield depth
        yield from _replica_families(gauges)
        yield from _load_families(gauges)
        yield self._checkpoint_bytes()

    def _checkpoint_bytes(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily("ember_key_checkpoint_bytes", "Bytes of an API key's stored checkpoints",
                                   labels=["key"])
        if self.service is None:
            return family
        with self.metrics._owners_lock:
            owners = sorted(self.metrics.owners_seen)
        for owner in owners:
            family.add_metric([self.metrics.key_id(owner)], self.service.checkpoint_bytes(owner))
        return family


class KeyIds:
    """owner -> the short id of its API key (`short_key_id`): the label of per-key usage."""

    def __init__(self, config: ServerConfig | None) -> None:
        self.by_owner: dict[str, str] = {}
        for key, owner in (config.api_keys if config is not None else {}).items():
            self.by_owner.setdefault(owner, short_key_id(key))
        if config is not None and config.admin_api_key:
            self.by_owner[ADMIN_OWNER] = short_key_id(config.admin_api_key)
        self.known = list(self.by_owner)

    def __call__(self, owner: str) -> str:
        if owner in self.by_owner:
            return self.by_owner[owner]
        if owner.startswith("key-"):  # any-`tml-`-key mode: `key_identity` = "key-" + the key's sha256
            return owner[4:12]
        return hashlib.sha256(owner.encode()).hexdigest()[:8]  # an owner without a key (in process)


def _replica_families(gauges: ServiceGauges):
    stats = gauges.replicas
    up = GaugeMetricFamily("ember_sampler_replica_up", "1 while a sampler replica serves requests, 0 while it "
                           "is out of its pool or being replaced", labels=["model", "replica"])
    total = CounterMetricFamily("ember_sampler_replica_requests", "Sample requests routed to a sampler replica",
                                labels=["model", "replica"])
    depth = GaugeMetricFamily("ember_sampler_replica_queue_depth", "Sample requests routed to a sampler replica "
                              "and not answered yet (queued or running)", labels=["model", "replica"])
    for model, replicas in sorted(stats.items()):
        for r in replicas:
            up.add_metric([model, str(r["replica"])], 1.0 if r["up"] else 0.0)
            total.add_metric([model, str(r["replica"])], r["requests_total"])
            depth.add_metric([model, str(r["replica"])], r["in_flight"])
    yield up
    yield total
    yield depth


def _load_families(gauges: ServiceGauges):
    loads = gauges.sampler_load
    active = GaugeMetricFamily("ember_sampler_active_sequences", "Sequences holding a sampler slot now",
                               labels=["model"])
    waiting = GaugeMetricFamily("ember_sampler_waiting_requests", "Sample requests waiting for a sampler slot",
                                labels=["model"])
    for model, load in sorted(loads.items()):
        active.add_metric([model], load["active_slots"])
        waiting.add_metric([model], load["waiting_requests"])
    yield active
    yield waiting


def route_label(scope: Scope) -> str:
    """The matched route's path template; `unmatched` for 404s and anything routed nowhere."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


def method_label(scope: Scope) -> str:
    method = scope.get("method", "")
    return method if method in _METHODS else "other"  # a client may send any verb: keep the set fixed


class MetricsMiddleware:
    """Counts and times every HTTP request. Sits inside PathPrefixMiddleware, so it sees the
    scope the router fills in (`scope["route"]`) and the same templates with or without a prefix."""

    def __init__(self, app: ASGIApp, metrics: EmberMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500  # an exception escaping the app ends as a 500 from the outer error middleware

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            route, method = route_label(scope), method_label(scope)
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route, method).observe(time.perf_counter() - start)


def _metrics_endpoint(metrics: EmberMetrics, require_key: bool) -> Callable:
    async def scrape(request: Request) -> Response:
        if require_key and request.app.state.config.owner_for(presented_key(request.headers)) is None:
            raise AuthError("/metrics needs an API key (X-API-Key or Authorization: Bearer), "
                            "or start the server with --metrics-auth off")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return scrape


def install_metrics(app: FastAPI, service: ServiceAPI | None, *, require_key: bool) -> EmberMetrics:
    """`GET /metrics`, the request middleware and the completion listener on `app`.

    Call it before the outer middlewares (path prefix, request log) are added, so the
    metrics middleware sits inside them."""
    metrics = EmberMetrics(service, getattr(app.state, "config", None))
    if service is not None:
        service.add_future_listener(metrics.observe_future)
    app.add_api_route(METRICS_PATH, _metrics_endpoint(metrics, require_key), methods=["GET"],
                      include_in_schema=False)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.state.metrics = metrics
    return metrics
