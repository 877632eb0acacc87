"""The worker's gRPC server, its lifecycle: ``kvswitch.v1.Worker`` (``worker/servicer.py``) plus the
standard health service, the index publisher and the metrics, started and stopped together.

``serve(config)`` runs a worker until SIGINT/SIGTERM; ``start_worker(config)`` starts one and
hands back a ``WorkerServer`` to stop later (tests, embedding).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.engine_feed import gpu_tier_info
from kvswitch.cache_index.events import CacheEvent
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.vllm_events import to_engine_events
from kvswitch.cache_index.vllm_publisher import KVEventPublisher
from kvswitch.checkpoint import check_model_dir
from kvswitch.guard import ServerGuard
from kvswitch.metrics import MetricsServer, ReadCounter, start_metrics_server
from kvswitch.serving import (
    KEEPALIVE_SERVER_OPTIONS,
    announce_ready,
    host_port,
    run_event_loop,
    wait_for_stop_signal,
)
from kvswitch.tokenizer import (
    Tokenizer,
    TokenizerFileError,
    load_tokenizer,
)
from kvswitch.v1 import worker_pb2_grpc
from kvswitch.worker.block_transfer import BlockTransfers
from kvswitch.worker.engine_client import (
    EngineClient,
    EngineStartError,
    check_engine_modules,
)
from kvswitch.worker.metrics import WorkerMetrics
from kvswitch.worker.peers import FleetPeers
from kvswitch.worker.publisher import EventPublisher, TierSplit
from kvswitch.worker.servicer import WorkerServicer
from kvswitch.worker.startup import process_age_s
from kvswitch.worker.worker_config import MAX_REQUEST_BYTES, WorkerConfig

logger = logging.getLogger(__name__)

__all__ = [
    "WorkerConfig",
    "WorkerFailed",
    "WorkerServer",
    "WorkerStartError",
    "check_engine_modules",
    "run",
    "serve",
    "start_worker",
]

SERVICE_NAME = "kvswitch.v1.Worker"  # its health-check name


class HttpApi(Protocol):
    """A worker's OpenAI-compatible HTTP API, served beside it (``--http-port``)."""

    url: str

    async def stop(self, grace_s: float) -> None: ...


# What starts a worker's HTTP API once it serves: the command line's (kvswitch/app/worker_http.py,
# the router's OpenAI front), given from above: the worker imports nothing of the router.
StartHttp = Callable[["WorkerServer", "Tokenizer | None"], Awaitable[HttpApi]]


# -- the server ----------------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerServer:
    """A started worker; ``stop`` it when done."""

    worker_id: str
    address: str  # "host:port" as bound
    engine: EngineClient
    server: grpc.aio.Server
    health_servicer: health.aio.HealthServicer
    metrics: WorkerMetrics
    servicer: WorkerServicer
    publisher: EventPublisher | None = None
    tier_publisher: EventPublisher | None = None  # the device tier's entry (a host tier)
    metrics_server: MetricsServer | None = None
    transfers: BlockTransfers | None = None  # blocks to and from peer workers
    kv_events: KVEventPublisher | None = None  # vLLM-format events (--kv-events-config)
    http: HttpApi | None = None  # the OpenAI-compatible API (--http-port)
    engine_core_start_s: float = 0.0  # from starting the engine core to its model being loaded
    # Set, with the reason, once the engine core has died: the worker can serve nothing more.
    engine_died: asyncio.Future[str] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def http_url(self) -> str | None:
        """The OpenAI API's base URL (…/v1); None when it is not served."""
        return self.http.url if self.http is not None else None

    @property
    def metrics_address(self) -> str | None:
        """Where ``/metrics`` is served, "host:port" as bound; None when it is not."""
        return self.metrics_server.address if self.metrics_server else None

    async def stop(self, grace_s: float) -> None:
        """Leave the index, report NOT_SERVING, give running RPCs ``grace_s`` to finish, cancel
        the rest, stop the engine core, then the metrics endpoint."""
        if self.tier_publisher is not None:
            await self.tier_publisher.stop()
        if self.publisher is not None:
            await self.publisher.stop()
            await self.publisher.index.close()
        await self.health_servicer.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop(grace_s)
        self.servicer.drain()
        await self.server.stop(grace_s)
        if self.transfers is not None:
            await self.transfers.close()
        await asyncio.to_thread(self.engine.stop)
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)

    async def _engine_has_died(self, message: str) -> None:
        """Tell health checkers at once, so that routers stop sending work here."""
        if not self.engine_died.done():
            self.engine_died.set_result(message)
        await self.health_servicer.enter_graceful_shutdown()


class WorkerStartError(Exception):
    """The worker could not start: one of its ports is taken, or its model does not load."""


class WorkerFailed(Exception):
    """The worker stopped serving on its own account: its engine core died."""


async def start_worker(config: WorkerConfig, start_http: StartHttp | None = None) -> WorkerServer:
    """Bind the port, start the engine core and serve; ``WorkerStartError`` says why not.
    ``start_http`` serves the HTTP API where ``config.http_port`` asks for one."""
    if config.http_port >= 0 and start_http is None:
        raise WorkerStartError(
            "this worker serves no HTTP API where it is started from: run kvswitch worker"
        )
    # NOTE: without so_reuseport 0, gRPC lets a second server bind the same port and share its
    # traffic. Binding before the model loads makes a taken port fail at once.
    server = grpc.aio.server(
        interceptors=[ServerGuard({SERVICE_NAME: config.fleet_token})],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            *KEEPALIVE_SERVER_OPTIONS,
        ],
    )
    try:
        port = config.security().add_port(server, host_port(config.host, config.port))
    except RuntimeError as e:
        raise WorkerStartError(
            f"cannot listen on {host_port(config.host, config.port)}: the port is taken or the "
            "address is not one of this machine's"
        ) from e
    worker_id = config.worker_id or host_port(_public_host(config.host), port)
    engine_started_s = time.perf_counter()
    try:
        tokenizer = _load_tokenizer(config.model)
        engine = await asyncio.to_thread(
            EngineClient.start, config.engine_config(), in_process=config.engine_in_process
        )
    except (ValueError, OSError, TokenizerFileError, EngineStartError) as e:
        raise WorkerStartError(f"cannot load the model: {e}") from e
    engine_core_s = time.perf_counter() - engine_started_s
    try:
        worker = await _serve_engine(config, server, port, worker_id, engine, tokenizer, start_http)
    except BaseException:
        await server.stop(0)
        await asyncio.to_thread(engine.stop)
        raise
    worker.engine_core_start_s = engine_core_s
    return worker


def _publish_kv_events(config: WorkerConfig, engine: EngineClient) -> KVEventPublisher | None:
    """The worker's cache events published as a vLLM engine publishes them, where
    ``kv_events_config`` says so; ``WorkerStartError`` if its endpoints cannot be bound."""
    settings = config.kv_events()
    if not settings.publishes:
        return None
    try:
        publisher = KVEventPublisher(
            settings.endpoint,
            settings.replay_endpoint or "",
            topic=settings.topic,
            buffer_steps=settings.buffer_steps,
            hwm=settings.hwm,
        )
    except zmq.ZMQError as e:
        raise WorkerStartError(f"cannot publish KV events on {settings.endpoint}: {e}") from e
    block_size = config.block_size

    def publish(events: list[CacheEvent]) -> None:
        engine_events = to_engine_events(events, block_size)
        if engine_events:
            publisher.publish(engine_events)

    engine.on_event_batch(publish)
    logger.info(
        "publishing KV events as vLLM does on %s%s",
        publisher.endpoint,
        f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "",
    )
    return publisher


def _log_startup(imports_s: float | None, engine_core_s: float) -> None:
    """How long this process took to serve, and on what (``worker/startup.py``)."""
    total_s = process_age_s() if imports_s is not None else None
    if imports_s is None or total_s is None:
        logger.info(
            "serving %.2f s after the engine core started", engine_core_s,
            extra={"startup_engine_core_s": round(engine_core_s, 3)},
        )  # fmt: skip
        return
    logger.info(
        "serving %.2f s after the process began: %.2f s to import and parse, %.2f s for the "
        "engine core to load the model, %.2f s the rest",
        total_s, imports_s, engine_core_s, total_s - imports_s - engine_core_s,
        extra={
            "startup_total_s": round(total_s, 3),
            "startup_imports_s": round(imports_s, 3),
            "startup_engine_core_s": round(engine_core_s, 3),
        },
    )  # fmt: skip


async def _serve_engine(
    config: WorkerConfig,
    server: grpc.aio.Server,
    port: int,
    worker_id: str,
    engine: EngineClient,
    tokenizer: Tokenizer | None,
    start_http: StartHttp | None,
) -> WorkerServer:
    publisher: EventPublisher | None = None  # once the index is open; its counts read at scrapes
    tier_publisher: EventPublisher | None = None  # the device tier's entry, with a host tier
    metrics = WorkerMetrics(
        lambda: engine.load,
        worker_id=worker_id,
        model=engine.namespace,
        role=config.role,
        counters=_read_counters(engine, lambda: publisher),
    )
    metrics_server = None
    if config.metrics_port >= 0:
        try:
            metrics_server = start_metrics_server(
                metrics.registry, config.host, config.metrics_port
            )
        except OSError as e:
            raise WorkerStartError(
                f"cannot serve metrics on {host_port(config.host, config.metrics_port)}: {e}"
            ) from e
    kv_events = _publish_kv_events(config, engine)
    transfers = BlockTransfers(engine, config.security())
    servicer = WorkerServicer(
        engine,
        worker_id=worker_id,
        tokenizer=tokenizer,
        metrics=metrics,
        max_hashes_per_chunk=config.max_hashes_per_chunk,
        transfers=transfers,
        max_requests=config.max_num_seqs + config.max_waiting_requests,
        peers=FleetPeers(lambda: publisher.index if publisher else None, engine.namespace),
        allow_pull_blocks=config.allow_pull_blocks,
        stream_interval=config.stream_interval,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in (SERVICE_NAME, ""):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    if config.index:
        try:
            index = await connect_index(
                config.index, prefix=config.index_prefix, security=config.security()
            )
        except (ValueError, OSError) as e:
            if metrics_server is not None:
                metrics_server.stop()
            raise WorkerStartError(f"cannot open the block index: {e}") from e
        info = WorkerInfo(
            worker_id,
            host_port(_public_host(config.host), port),
            engine.namespace,
            config.block_size,
            config.role,
            engine.facts.num_blocks,
            engine.facts.max_model_len,
            engine.block_naming.mode,
            engine.block_naming.key_id,
        )
        if engine.facts.num_host_blocks:
            # NOTE: a host tier: the worker's entry holds both tiers' hashes, a second entry
            # the device's alone, so that the router weighs each matched block by its tier.
            split = TierSplit(engine)
            publisher = EventPublisher(index, split.all, info)
            tier_publisher = EventPublisher(index, split.device, gpu_tier_info(info))
            tier_publisher.start()
        else:
            publisher = EventPublisher(index, engine, info)
        publisher.start()
    worker = WorkerServer(
        worker_id,
        host_port(config.host, port),
        engine,
        server,
        health_servicer,
        metrics,
        servicer,
        publisher=publisher,
        tier_publisher=tier_publisher,
        metrics_server=metrics_server,
        transfers=transfers,
        kv_events=kv_events,
    )
    loop = asyncio.get_running_loop()
    engine.on_death(
        lambda message: asyncio.run_coroutine_threadsafe(worker._engine_has_died(message), loop)
    )
    if start_http is not None and config.http_port >= 0:
        try:
            worker.http = await start_http(worker, tokenizer)
        except OSError as e:
            await worker.stop(0)
            raise WorkerStartError(
                f"cannot serve HTTP on {host_port(config.host, config.http_port)}: {e}"
            ) from e
    logger.info(
        "worker %s listening on %s: model %s, %d KV blocks of %d tokens, block names %s, "
        "engine core %s",
        worker_id,
        worker.address,
        engine.namespace,
        engine.facts.num_blocks,
        config.block_size,
        engine.block_naming.describe(),
        f"pid {engine.pid}" if engine.pid is not None else "in process",
    )
    if metrics_server is not None:
        logger.info("metrics on http://%s/metrics", metrics_server.address)
    return worker


async def serve(
    config: WorkerConfig, *, imports_s: float | None = None, start_http: StartHttp | None = None
) -> None:
    """Run a worker until SIGINT or SIGTERM, then shut it down gracefully. Raises
    ``WorkerFailed`` (after shutting down) if its engine core dies first. ``imports_s``: how long
    this process took to get here, for its startup line."""
    worker = await start_worker(config, start_http)
    _log_startup(imports_s, worker.engine_core_start_s)
    announce_ready(f"worker {worker.worker_id}", worker.address)
    stop_signal = asyncio.create_task(wait_for_stop_signal())
    await asyncio.wait([stop_signal, worker.engine_died], return_when=asyncio.FIRST_COMPLETED)
    stop_signal.cancel()
    if worker.engine_died.done():
        logger.error("stopping: %s", worker.engine_died.result())
        await worker.stop(0)
        raise WorkerFailed(worker.engine_died.result())
    logger.info("shutting down: %.1f s for running requests to finish", config.grace_s)
    await worker.stop(config.grace_s)
    logger.info("worker %s stopped", worker.worker_id)


def run(config: WorkerConfig, start_http: StartHttp | None = None) -> None:
    """``serve`` on uvloop where it is installed, in a process started to run it."""
    run_event_loop(serve(config, imports_s=process_age_s(), start_http=start_http))


def _read_counters(
    engine: EngineClient, publisher: Callable[[], EventPublisher | None]
) -> list[ReadCounter]:
    """What the worker counts and logs no more than now and then: exported at scrape time."""

    def published(field: str) -> Callable[[], float]:
        return lambda: getattr(publisher(), field, 0)

    return [
        (
            "kvswitch_worker_failed_steps",
            "Engine steps that raised: their requests failed, the others went on",
            lambda: engine.counters.num_failed_steps,
        ),
        (
            "kvswitch_worker_preemptions",
            "Requests preempted to free KV cache blocks, to be recomputed",
            lambda: engine.counters.num_preemptions,
        ),
        (
            "kvswitch_worker_lora_slot_loads",
            "LoRA adapters put in a device slot (from host memory or their folder)",
            lambda: engine.counters.num_lora_slot_loads,
        ),
        (
            "kvswitch_worker_lora_disk_loads",
            "LoRA adapters read from their folder again, dropped from host memory before",
            lambda: engine.counters.num_lora_disk_loads,
        ),
        (
            "kvswitch_worker_dropped_event_batches",
            "Batches of cache events dropped because the publisher fell behind (a resync follows)",
            lambda: engine.num_dropped_event_batches,
        ),
        (
            "kvswitch_worker_index_errors",
            "Calls to the block index that failed, each tried again after a backoff",
            published("num_errors"),
        ),
        (
            "kvswitch_worker_index_resyncs",
            "Times this worker sent the index its whole set of cached blocks (after a gap)",
            published("num_resyncs"),
        ),
        (
            "kvswitch_worker_index_registers",
            "Times this worker registered with the index (at start, and after it forgot it)",
            published("num_registers"),
        ),
    ]


def _load_tokenizer(model: str) -> Tokenizer | None:
    """The model's tokenizer, or None for a model that has none. A checkpoint directory that
    does not exist is an error: it is a typo, not a model."""
    check_model_dir(model)
    try:
        return load_tokenizer(model or None)
    except ValueError as e:
        # The worker runs on token ids; without a tokenizer its chunks just carry no text.
        logger.warning("%s; streaming token ids without text", e)
        return None


def _public_host(host: str) -> str:
    return socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host
