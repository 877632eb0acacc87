"""What the router's and the workers' metrics share: serving a registry on HTTP ``/metrics``,
and the per-request counters.

Each router and worker owns its own ``CollectorRegistry`` (never prometheus_client's global one),
so that several of them can live in one process, as they do in the tests. The HTTP server is
prometheus_client's own; it answers scrapes on a daemon thread, off the asyncio event loop, so a
scrape never waits for a model step or a request, and a busy event loop never delays a scrape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

# (metric name, help, read): a count its owner keeps as a plain int attribute.
ReadCounter = tuple[str, str, Callable[[], float]]

# Time to first token, in seconds: from a 1 ms cache hit on a small model to a 30 s cold prefill.
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class MetricsServer:
    """A registry served on ``http://<address>/metrics`` until ``stop``."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # as bound

    def stop(self) -> None:
        """Stop answering and free the port. Blocks for up to half a second (the server's poll
        interval): from a coroutine, ``await asyncio.to_thread(server.stop)``."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` at ``host:port`` (port 0 = a free port; ``address`` says which).
    OSError if the port is taken or the host is not one of this machine's addresses."""
    httpd, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    return MetricsServer(httpd, thread)


class ReadCounters:
    """Counters their owners keep as plain ints (``num_*`` attributes: no metrics call where
    they count), read when Prometheus scrapes. Register with ``registry.register``."""

    def __init__(self, counters: Iterable[ReadCounter]) -> None:
        self._counters = list(counters)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, documentation, read in self._counters:
            yield CounterMetricFamily(name, documentation, value=read())


class RequestMetrics:
    """``<prefix>_requests_total`` by finish reason, ``<prefix>_ttft_seconds``, and the prompt,
    cached prompt and output token totals, in ``registry``.

    A request's prompt and cached tokens, and its time to first token, count only if it reached
    its first token (as the engine's own statistics do), so that the cached-token ratio compares
    the prompts of the same requests.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str,
        finish_reasons: Sequence[str],
        *,
        ttft_help: str,
        cached_help: str,
    ) -> None:
        self._requests = Counter(
            f"{prefix}_requests",
            "Requests ended, by finish reason",
            ["finish_reason"],
            registry=registry,
        )
        # Each known reason starts at 0, so that rate() sees a reason's first request.
        for reason in finish_reasons:
            self._requests.labels(reason)
        self._ttft_s = Histogram(
            f"{prefix}_ttft_seconds", ttft_help, buckets=TTFT_BUCKETS_S, registry=registry
        )
        self._prompt_tokens = Counter(
            f"{prefix}_prompt_tokens",
            "Prompt tokens of requests that reached their first token",
            registry=registry,
        )
        self._cached_tokens = Counter(
            f"{prefix}_cached_prompt_tokens", cached_help, registry=registry
        )
        self._output_tokens = Counter(
            f"{prefix}_output_tokens",
            "Tokens generated, counted when their request ends",
            registry=registry,
        )

    def finished(
        self,
        finish_reason: str,
        *,
        ttft_s: float | None = None,
        num_prompt_tokens: int = 0,
        num_cached_tokens: int = 0,
        num_output_tokens: int = 0,
    ) -> None:
        """One request ended; ``ttft_s`` None = it never produced a token."""
        self._requests.labels(finish_reason).inc()
        self._output_tokens.inc(num_output_tokens)
        if ttft_s is not None:
            self._ttft_s.observe(ttft_s)
            self._prompt_tokens.inc(num_prompt_tokens)
            self._cached_tokens.inc(num_cached_tokens)
