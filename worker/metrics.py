"""A worker's Prometheus metrics (``kvswitch_worker_*``, and its load under vLLM's ``vllm:``
names; docs/OBSERVABILITY.md lists them).

``WorkerMetrics`` owns its registry. The servicer reports each request once, when it ends; the
load gauges are read from the engine core's latest ``LoadReport`` when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Info
from prometheus_client.core import GaugeMetricFamily

from kvswitch.metrics import ReadCounter, ReadCounters, RequestMetrics
from kvswitch.worker.core_protocol import LoadReport

# "rejected": refused before the engine took it (invalid, or the worker is stopping);
# "error": the engine failed it; the rest are the engine's own finish reasons.
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")

# Why a request's KV pull left blocks of its prompt for this worker to compute: the transfer
# failed (peer gone, timeout, refused, not of this fleet), brought fewer blocks than asked for,
# or this worker could hold no blocks for it.
KV_PULL_FAILURES = ("failed", "short", "refused")

# (metric name, help, LoadReport field) of each load gauge.
_LOAD_GAUGES = (
    ("kvswitch_worker_running_requests", "Requests being computed", "num_running_requests"),
    ("kvswitch_worker_waiting_requests", "Requests waiting to start", "num_waiting_requests"),
    (
        "kvswitch_worker_queued_prefill_tokens",
        "Prompt tokens still to compute, waiting requests counted whole (less a prefix that landed "
        "from a prefill worker)",
        "num_queued_prefill_tokens",
    ),
    ("kvswitch_worker_free_blocks", "KV cache blocks free (cached ones too)", "num_free_blocks"),
    ("kvswitch_worker_total_blocks", "KV cache blocks in all", "num_total_blocks"),
    (
        "kvswitch_worker_host_blocks",
        "KV blocks the host tier caches (evicted from the device, loadable; --offload-gb)",
        "num_host_blocks",
    ),
    (
        "kvswitch_worker_host_total_blocks",
        "The host tier's size in blocks",
        "num_host_total_blocks",
    ),
    (
        "kvswitch_worker_host_copies",
        "The host tier's copies in flight: blocks being copied out, loads not landed",
        "num_host_copies",
    ),
)


class _LoadCollector:
    """The load gauges, as of the engine's latest step at the time of the scrape; and the same
    load under vLLM's names (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, labelled ``model_name``; ``vllm:cache_config_info``), for
    routers that read a vLLM fleet's load from ``/metrics``."""

    def __init__(self, load: Callable[[], LoadReport], model: str) -> None:
        self._load = load
        self._model = model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self._load()
        for name, documentation, field in _LOAD_GAUGES:
            yield GaugeMetricFamily(name, documentation, value=getattr(load, field))
        total = load.num_total_blocks
        usage = 1.0 - load.num_free_blocks / total if total else 0.0
        for name, documentation, value in (
            ("vllm:num_requests_running", "Requests being computed", load.num_running_requests),
            ("vllm:num_requests_waiting", "Requests waiting to start", load.num_waiting_requests),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)", usage),
        ):
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self._model], value)
            yield gauge
        # NOTE: vLLM's cache settings as labels of a gauge of 1: what a router reads the cache's
        # size in blocks from, to weigh its usage against other workers'.
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's settings",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(load.block_size), str(total)], 1.0)
        yield info


class WorkerMetrics:
    """One worker's metrics, in a registry of its own (``registry``).

    The servicer calls ``requests.finished`` once per Generate call, however it ended, and
    ``kv_pull_failed`` for each pull that left blocks to compute; the load gauges read ``load()``
    when Prometheus scrapes.
    """

    def __init__(
        self,
        load: Callable[[], LoadReport],
        *,
        worker_id: str,
        model: str,
        role: str,
        counters: Iterable[ReadCounter] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        Info("kvswitch_worker", "The worker's name, model and role", registry=self.registry).info(
            {"worker_id": worker_id, "model": model, "role": role}
        )
        self.requests = RequestMetrics(
            self.registry,
            "kvswitch_worker",
            FINISH_REASONS,
            ttft_help="Time from a request's arrival in the engine to its first token",
            cached_help="Of those prompt tokens, the ones found in the prefix cache",
        )
        self._kv_pull_failures = Counter(
            "kvswitch_worker_kv_pull_failures",
            "Requests whose KV pull from a prefill worker left blocks to compute here, by why",
            ["reason"],
            registry=self.registry,
        )
        for reason in KV_PULL_FAILURES:
            self._kv_pull_failures.labels(reason)
        self.registry.register(_LoadCollector(load, model))
        self.registry.register(ReadCounters(counters))

    def kv_pull_failed(self, reason: str) -> None:
        self._kv_pull_failures.labels(reason).inc()
