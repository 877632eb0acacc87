"""A router's Prometheus metrics (``kvswitch_router_*``; docs/OBSERVABILITY.md lists them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from kvswitch.metrics import ReadCounter, ReadCounters, RequestMetrics

# Known values of the low-cardinality labels; each series starts at 0 so that rate() sees the
# first one. Others are counted too: the caller keeps them to a fixed set.
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected", "unavailable")
FAILOVER_KINDS = ("before_first_token", "mid_stream")
# Why a request was refused with RESOURCE_EXHAUSTED: every worker that could take it was at its
# queue limit, or its client had the most streams open that the router takes from one client.
OVERLOAD_CAUSES = ("workers_full", "client_streams")

# An in-memory index answers in tens of microseconds, Redis in about a millisecond.
INDEX_LOOKUP_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# A decode step: a few ms on a GPU, tens of ms on a CPU or a full batch; seconds mean a stall.
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2)
# A whole request: a few tokens from a warm cache to minutes of output.
E2E_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
# The router's own wait: about a millisecond to plan and route; seconds while no worker serves.
QUEUE_BUCKETS_S = (5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerLoadSample(NamedTuple):
    """What this router has sent to one worker and not seen finish."""

    worker_id: str
    num_in_flight_requests: int
    num_outstanding_tokens: int
    num_replica_requests: int = 0  # the other router replicas' in flight there


class RouterMetrics:
    """One router's metrics, in a registry of its own (``registry``), and the calls that feed them.

    The router calls, per request:

    * ``routed(policy, reason, worker_id)`` for every decision, first tries and failovers alike;
      ``reason`` is the ``Decision.reason`` of ``router/policy.py`` (a fixed string per policy
      branch), "failover: " and that, or "failover". Never put an id or a number in it: each
      distinct value is a time series.
    * ``index_lookup(duration_s)`` for each block-index match.
    * ``failed_over(kind)`` when a worker failed the request and another one is tried; ``kind`` is
      one of ``FAILOVER_KINDS``.
    * ``inter_token(gap_s)`` for each chunk of tokens relayed after the first: the time since
      the previous chunk, per token of this one.
    * ``overloaded(cause)`` when it is refused with RESOURCE_EXHAUSTED; ``cause`` is one of
      ``OVERLOAD_CAUSES``.
    * ``requests.finished(finish_reason, ...)`` once, however the request ended, and with it, if
      it reached its first token, ``served(e2e_s, queue_s, num_predicted_cached_tokens)``. Its
      prompt and cached tokens, its time to first token and its other timings count only if it
      reached its first token, so the cached-token ratios compare the prompts of the same
      requests.
    * ``kv_transferred(num_blocks)`` once for a request whose worker took KV blocks from another.

    The per-worker gauges are read at scrape time from ``worker_loads``, which returns one
    ``WorkerLoadSample`` per live worker: a worker that left simply stops being reported; so are
    ``counters``, the counts other parts keep (``ReadCounters``).
    """

    def __init__(
        self,
        worker_loads: Callable[[], Iterable[WorkerLoadSample]] | None = None,
        counters: Iterable[ReadCounter] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(
            self.registry,
            "kvswitch_router",
            FINISH_REASONS,
            ttft_help="Time from a request's arrival at the router to its first token leaving it",
            cached_help="Of those prompt tokens, the ones the serving worker found in its cache",
        )
        self._decisions = Counter(
            "kvswitch_router_routing_decisions",
            "Routing decisions, by policy, reason and chosen worker",
            ["policy", "reason", "worker_id"],
            registry=self.registry,
        )
        self._index_lookup_s = Histogram(
            "kvswitch_router_index_lookup_seconds",
            "Time for one block-index match of a request's prompt",
            buckets=INDEX_LOOKUP_BUCKETS_S,
            registry=self.registry,
        )
        self._failovers = Counter(
            "kvswitch_router_failovers",
            "Requests sent to another worker after one failed them, by when it failed",
            ["kind"],
            registry=self.registry,
        )
        for kind in FAILOVER_KINDS:
            self._failovers.labels(kind)
        self._overloaded = Counter(
            "kvswitch_router_overloaded_requests",
            "Requests refused with RESOURCE_EXHAUSTED, by cause: every worker that could take it "
            "was at its queue limit, or its client had too many streams open",
            ["cause"],
            registry=self.registry,
        )
        for cause in OVERLOAD_CAUSES:
            self._overloaded.labels(cause)
        self._inter_token_s = Histogram(
            "kvswitch_router_inter_token_latency_seconds",
            "Time between two chunks of output relayed to a client, divided by the tokens of the "
            "later one (one observation per chunk after the first)",
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self._e2e_s = Histogram(
            "kvswitch_router_e2e_request_latency_seconds",
            "Time from a request's arrival at the router to its end, for requests that reached "
            "their first token",
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        )
        self._queue_s = Histogram(
            "kvswitch_router_request_queue_time_seconds",
            "Time from a request's arrival at the router to its sending to the worker that made "
            "its first token (planning, waiting for a worker, routing, attempts that failed); "
            "its wait in that worker's own queue is not in it",
            buckets=QUEUE_BUCKETS_S,
            registry=self.registry,
        )
        self._predicted_cached_tokens = Counter(
            "kvswitch_router_predicted_cached_prompt_tokens",
            "Of the prompt tokens of requests that reached their first token, the ones the "
            "routing decision expected the worker that computed the prompt to hold",
            registry=self.registry,
        )
        self._kv_transfers = Counter(
            "kvswitch_router_kv_transfers",
            "Requests whose worker took KV cache blocks from another worker before it computed "
            "(a prefill worker's, or a peer's cached prefix)",
            registry=self.registry,
        )
        self._kv_transferred_blocks = Counter(
            "kvswitch_router_kv_transferred_blocks",
            "KV cache blocks those workers took",
            registry=self.registry,
        )
        if worker_loads is not None:
            self.registry.register(_WorkerLoadCollector(worker_loads))
        self.registry.register(ReadCounters(counters))

    def routed(self, policy: str, reason: str, worker_id: str) -> None:
        self._decisions.labels(policy, reason, worker_id).inc()

    def index_lookup(self, duration_s: float) -> None:
        self._index_lookup_s.observe(duration_s)

    def failed_over(self, kind: str) -> None:
        self._failovers.labels(kind).inc()

    def overloaded(self, cause: str) -> None:
        self._overloaded.labels(cause).inc()

    def inter_token(self, gap_s: float) -> None:
        self._inter_token_s.observe(gap_s)

    def served(self, e2e_s: float, queue_s: float, num_predicted_cached_tokens: int) -> None:
        self._e2e_s.observe(e2e_s)
        self._queue_s.observe(queue_s)
        self._predicted_cached_tokens.inc(num_predicted_cached_tokens)

    def kv_transferred(self, num_blocks: int) -> None:
        self._kv_transfers.inc()
        self._kv_transferred_blocks.inc(num_blocks)


class _WorkerLoadCollector:
    def __init__(self, worker_loads: Callable[[], Iterable[WorkerLoadSample]]) -> None:
        self._worker_loads = worker_loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "kvswitch_router_worker_in_flight_requests",
            "Requests this router sent to the worker and has not seen finish",
            labels=["worker_id"],
        )
        outstanding = GaugeMetricFamily(
            "kvswitch_router_worker_outstanding_tokens",
            "The worker's outstanding work in tokens, as the routing policy sees it",
            labels=["worker_id"],
        )
        replicas = GaugeMetricFamily(
            "kvswitch_router_worker_replica_requests",
            "Requests the other router replicas have in flight on the worker, as they told",
            labels=["worker_id"],
        )
        for sample in self._worker_loads():
            in_flight.add_metric([sample.worker_id], sample.num_in_flight_requests)
            outstanding.add_metric([sample.worker_id], sample.num_outstanding_tokens)
            replicas.add_metric([sample.worker_id], sample.num_replica_requests)
        yield in_flight
        yield outstanding
        yield replicas
