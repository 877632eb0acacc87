"""OpenAI-API engines in a router's fleet: stock vLLM servers (or kvswitch workers serving
``--http-port`` and ``--kv-events-config``), routed by the KV events they publish.

An engine is named on the router's command line (``--engine NAME=URL``, ``--engine-events
NAME=ENDPOINT``, ``--engine-replay NAME=ENDPOINT``). The router follows each engine's events into
its index (``EngineFeeds``: one ``EngineEventFeed`` each), which registers the engine there as a
worker whose address is its URL; every router sharing the index sees it. The directory polls an
engine's load from its ``/metrics`` and its health from ``/health`` (``poll_engine``), and the HTTP
front forwards the requests routed to it (``router/engine_forward.py``); a gRPC client's request
never goes to one (an engine has no ``Worker`` service).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvswitch.cache_index.engine_feed import EngineEndpoints, EngineEventFeed, status_line
from kvswitch.cache_index.hashing import BlockNaming
from kvswitch.cache_index.index import BlockIndex, WorkerInfo
from kvswitch.cache_index.vllm_events import EngineBlockNames
from kvswitch.options import named_values
from kvswitch.router.engine_http import EngineConnectError, EngineConnectionLost, EngineHTTP
from kvswitch.router.engine_load import EngineMetricsError, parse_engine_load
from kvswitch.v1 import worker_pb2

logger = logging.getLogger(__name__)

ENGINE_SCHEMES = ("http://", "https://")
FEED_RETRY_S = 1.0  # a feed that failed (its index unreachable) starts again after this


def is_engine(info: WorkerInfo) -> bool:
    """Whether ``info`` registers an OpenAI-API engine (its address a URL), not a worker."""
    return info.address.startswith(ENGINE_SCHEMES)


def parse_engines(
    engines: Sequence[str], events: Sequence[str], replays: Sequence[str], topic: str = ""
) -> list[EngineEndpoints]:
    """The engines ``--engine NAME=URL``, ``--engine-events NAME=ENDPOINT`` and
    ``--engine-replay NAME=ENDPOINT`` name; ValueError, saying which option is wrong."""
    urls = named_values(engines, "engine", "NAME=http://HOST:8000")
    publishers = named_values(events, "engine_events", "NAME=tcp://HOST:5557")
    replay = named_values(replays, "engine_replay", "NAME=tcp://HOST:5558")
    for option, names in (("engine_events", publishers), ("engine_replay", replay)):
        unknown = sorted(set(names) - set(urls))
        if unknown:
            raise ValueError(f"{option} names {', '.join(unknown)}, which no --engine names")
    missing = sorted(set(urls) - set(publishers))
    if missing:
        raise ValueError(
            f"engine_events: give each engine's KV events endpoint (vLLM's --kv-events-config "
            f"endpoint); none for {', '.join(missing)}: the router would route it blind"
        )
    endpoints = []
    for name, url in urls.items():
        if not url.startswith(ENGINE_SCHEMES):
            raise ValueError(f"engine {name}: {url!r} is no http:// or https:// URL")
        base = url.rstrip("/").removesuffix("/v1")
        endpoints.append(EngineEndpoints(name, base, publishers[name], replay.get(name, ""), topic))
    return endpoints


_FLEET_FIELDS = {"name", "url", "events", "replay"}


def read_engine_fleet(path: str) -> list[tuple[str, str, str, str]]:
    """The engines of a fleet file (``--engine-fleet``), each (name, url, events, replay): JSON,
    a list of objects with the fields of the options (``replay`` optional), or an object whose
    ``engines`` is that list. ValueError naming the file and what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"engine_fleet: cannot read {path}: {e.strerror or e}") from None
    try:
        fleet = json.loads(text)
    except ValueError as e:
        raise ValueError(f"engine_fleet: {path} is not JSON: {e}") from None
    entries = fleet.get("engines") if isinstance(fleet, dict) else fleet
    if not isinstance(entries, list):
        raise ValueError(f'engine_fleet: {path} holds no list of engines (or {{"engines": [...]}})')
    engines = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"engine_fleet: {path}: engine {i} is not an object")
        unknown = sorted(set(entry) - _FLEET_FIELDS)
        missing = sorted({"name", "url", "events"} - set(entry))
        if unknown or missing:
            raise ValueError(
                f"engine_fleet: {path}: engine {i} "
                + (f"has unknown fields {unknown}" if unknown else f"lacks {missing}")
                + f"; the fields are {sorted(_FLEET_FIELDS)}"
            )
        if not all(isinstance(entry[key], str) for key in entry):
            raise ValueError(f"engine_fleet: {path}: engine {i}'s fields must be strings")
        engines.append((entry["name"], entry["url"], entry["events"], entry.get("replay", "")))
    return engines


@dataclass(eq=False)  # a collector: registered by identity
class EngineFeeds:
    """The feeds of a router's engines, each in a task of its own (``start``, ``stop``)."""

    feeds: list[EngineEventFeed]

    @classmethod
    def of(
        cls,
        endpoints: Sequence[EngineEndpoints],
        index: BlockIndex,
        namespace: str,
        block_size: int,
        naming: BlockNaming,
    ) -> EngineFeeds:
        return cls(
            [
                EngineEventFeed(e, index, EngineBlockNames(namespace, block_size, naming))
                for e in endpoints
            ]
        )

    def __post_init__(self) -> None:
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._follow(feed), name=f"feed-{feed.engine.name}")
            for feed in self.feeds
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _follow(self, feed: EngineEventFeed) -> None:
        logger.info(
            "following engine %s at %s: events %s%s",
            feed.engine.name,
            feed.engine.address,
            feed.engine.events,
            f", replay {feed.engine.replay}" if feed.engine.replay else "",
        )
        while True:
            try:
                await feed.run()
            except feed.index.unavailable_errors as e:  # Redis restarting, a network blip
                logger.warning(
                    "engine %s: the index cannot be reached (%s); following it again in %g s",
                    feed.engine.name,
                    e,
                    FEED_RETRY_S,
                )
            except Exception:
                logger.exception(
                    "engine %s: its feed failed; following it again in %g s",
                    feed.engine.name,
                    FEED_RETRY_S,
                )
            else:
                # NOTE: run returns only once the engine is refused: loudly, and for good (its
                # blocks would be named wrong, and routed on wrong).
                logger.error("engine %s refused: %s", feed.engine.name, feed.status.failed)
                return
            await asyncio.sleep(FEED_RETRY_S)
            # NOTE: events may have gone by meanwhile: followed again from the start.
            feed.reset()

    def status_lines(self) -> list[str]:
        return [status_line(feed) for feed in self.feeds]

    def collect(self) -> Iterator[Metric]:
        """The feeds' state at a scrape (``kvswitch_router_engine_feed_*``): a Prometheus
        collector, ``registry.register(feeds)``."""
        for name, family, documentation, value in _FEED_METRICS:
            metric = family(f"kvswitch_router_engine_feed_{name}", documentation, labels=["engine"])
            for feed in self.feeds:
                metric.add_metric([feed.engine.name], float(value(feed)))
            yield metric


_FEED_METRICS: list[tuple[str, type, str, Callable[[EngineEventFeed], float]]] = [
    (
        "degraded",
        GaugeMetricFamily,
        "1 while the index holds less of the engine's cache than it has",
        lambda feed: bool(feed.status.degraded),
    ),
    (
        "failed",
        GaugeMetricFamily,
        "1 once the engine's events are refused (a block size mismatch)",
        lambda feed: bool(feed.status.failed),
    ),
    (
        "blocks",
        GaugeMetricFamily,
        "The engine's blocks named in the index",
        lambda feed: len(feed.names),
    ),
    (
        "batches",
        CounterMetricFamily,
        "Event batches applied",
        lambda feed: feed.status.num_batches,
    ),
    (
        "replays",
        CounterMetricFamily,
        "Times lost batches were asked for again",
        lambda feed: feed.status.num_replays,
    ),
    (
        "restarts",
        CounterMetricFamily,
        "Times the engine was seen to restart",
        lambda feed: feed.status.num_restarts,
    ),
    (
        "cleared",
        CounterMetricFamily,
        "Times the engine's entries were dropped, to be built again",
        lambda feed: feed.status.num_cleared,
    ),
    (
        "orphan_blocks",
        CounterMetricFamily,
        "Stored blocks left unnamed: their parent was never seen",
        lambda feed: feed.names.stats.num_orphans,
    ),
]


async def poll_engine(
    client: EngineHTTP, info: WorkerInfo, timeout_s: float
) -> worker_pb2.WorkerLoad:
    """An engine's load from its ``/metrics``, if its ``/health`` says it serves; ``EngineDown``
    when either does not answer as a serving engine does."""
    try:
        async with asyncio.timeout(timeout_s):
            (health, _), (metrics, page) = await asyncio.gather(
                _get(client, info.address, "/health"), _get(client, info.address, "/metrics")
            )
    except TimeoutError:
        raise EngineDown(f"no answer in {timeout_s:g} s") from None
    except (EngineConnectError, EngineConnectionLost) as e:
        raise EngineDown(f"{type(e).__name__}: {e}") from None
    if health != 200:
        raise EngineDown(f"/health answers {health}")
    if metrics != 200:
        raise EngineDown(f"/metrics answers {metrics}")
    try:
        load = parse_engine_load(page.decode("utf-8", "replace"))
    except EngineMetricsError as e:
        raise EngineDown(f"/metrics: {e}") from None
    return worker_pb2.WorkerLoad(
        worker_id=info.worker_id,
        num_running_requests=load.num_running_requests,
        num_waiting_requests=load.num_waiting_requests,
        # NOTE: free blocks compare across workers only in blocks: 0 where the engine does not
        # say how many it has (it loses ties on free space to one that does).
        num_free_blocks=round((1 - min(max(load.kv_cache_usage, 0.0), 1.0)) * load.num_blocks),
        num_total_blocks=load.num_blocks,
        block_size=info.block_size,
    )


async def _get(client: EngineHTTP, url: str, path: str) -> tuple[int, bytes]:
    """The status and the body of a GET of ``path`` from the engine at ``url``."""
    response = await client.get(url, path)
    try:
        return response.status, await response.read()
    finally:
        response.close()


class EngineDown(Exception):
    """An engine's health or load poll did not answer as a serving engine's does."""
