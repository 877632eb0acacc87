"""The router's gRPC server: ``kvswitch.v1.Router`` (``router/servicer.py``) plus the standard
health service, on uvloop.

With the embedded index (``memory://``, the default), the router also serves that index as
``kvswitch.v1.CacheIndex`` on its own port, and workers publish to it with
``--index grpc://ROUTER:PORT``. Several routers share a fleet through a Redis index instead.

``serve(config)`` runs a router until SIGINT/SIGTERM; ``start_router(config)`` starts one and
hands back a ``RouterServer`` to stop later (tests, embedding, ``kvswitch up``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from kvswitch.cache_index import grpc_index
from kvswitch.cache_index.connect import DEFAULT_PREFIX, connect_index, redacted
from kvswitch.cache_index.engine_feed import EngineEndpoints
from kvswitch.cache_index.hashing import BlockNaming
from kvswitch.cache_index.index import BlockIndex, reclaim_forever
from kvswitch.checkpoint import RANDOM_PREFIX, check_model_dir
from kvswitch.guard import ServerGuard
from kvswitch.metrics import MetricsServer, ReadCounter, start_metrics_server
from kvswitch.router.disagg import DisaggConfig
from kvswitch.router.engines import EngineFeeds, parse_engines, read_engine_fleet
from kvswitch.router.forwarded import new_front_key
from kvswitch.router.limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from kvswitch.router.local_call import LocalStub
from kvswitch.router.metrics import RouterMetrics, WorkerLoadSample
from kvswitch.router.pending import PendingBlocks
from kvswitch.router.policy import POLICIES, fetch_costs, make_policy
from kvswitch.router.replicas import ReplicaSync
from kvswitch.router.router import Router, TierWeights
from kvswitch.router.servicer import RouterServicer
from kvswitch.router.tenants import TenantLimits
from kvswitch.router.workers import DirectoryConfig, WorkerDirectory
from kvswitch.security import (
    FLEET_WAYS_OUT,
    HTTP_WAYS_OUT,
    FleetSecurity,
    check_exposure,
    parse_api_keys,
)
from kvswitch.serving import announce_ready, host_port, run_event_loop, wait_for_stop_signal
from kvswitch.tokenizer import Tokenizer, TokenizerFileError, load_tokenizer
from kvswitch.v1 import router_pb2_grpc

if TYPE_CHECKING:
    from kvswitch.router.engine_forward import EngineForwarder
    from kvswitch.router.http_server import HttpFront

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvswitch.v1.Router"  # its health-check name
HEALTH_RECHECK_S = 0.25  # between looks at whether a worker is routable, without a change
RECLAIM_INTERVAL_S = 5.0
MESSAGE_READ_FACTOR = 4  # requests up to 4x max_message_bytes are read to be refused by name


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Where a router listens, which index it reads and how it scores workers."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 = a free port chosen by the OS
    index: str = "memory://"  # memory:// = embedded, served to workers on this port
    index_prefix: str = DEFAULT_PREFIX  # a Redis index's keys start with it (fleets share a Redis)
    model: str = ""  # checkpoint directory whose tokenizer to use; empty = the built-in model's
    namespace: str = ""  # the model to route for; empty = the one the live workers serve
    policy: str = "cost"
    prefill_weight: float = 1.0  # cost: what one uncached prompt token costs, in queued tokens
    temperature: float = 0.0  # cost: 0 = always the cheapest; > 0 samples near-ties
    decode_weight: float = 6.0  # cost: what one output token still to decode costs
    min_match: float = 0.1  # cost: a match below this fraction of the prompt counts as none
    private_weight: float = 5.0  # cost: one uncached token of a conversation's own history
    # LoRA adapter affinity (cost policy): what loading an adapter into a slot costs, in prompt
    # tokens, and how much of it a worker is spared with the adapter in a slot or a slot free.
    lora_load_tokens: float = 256.0
    lora_loaded_weight: float = 1.0
    lora_free_slot_weight: float = 0.8
    # Peer block fetch (cost policy): a worker may take a cached prefix from the worker holding
    # it where moving it costs less than computing it. Off while either speed is 0; both as
    # measured (kvswitch bench transfer: blocks_per_s x block size; kvswitch bench ttft).
    peer_fetch_tokens_per_s: float = 0.0  # tokens of KV moved a second between two workers
    peer_fetch_latency_ms: float = 1.0  # what one transfer costs besides its bytes
    prefill_tokens_per_s: float = 0.0  # prompt tokens a worker computes a second
    max_failovers: int = 3  # other workers tried after a worker fails a request
    wait_for_worker_s: float = 30.0  # a request finding no worker waits this long (or its deadline)
    pending_ttl_s: float = 2.0  # how long an unconfirmed "will hold these blocks" guess lives
    refresh_s: float = 0.25  # how often to re-read the live workers
    load_poll_s: float = 0.1  # how often to ask each worker for its load
    lost_after_failed_polls: int = 3  # a worker's streams fail over after this many in a row
    # Disaggregated prefill (router/disagg.py), with workers of role prefill in the fleet.
    min_remote_prefill_tokens: int = 256  # fewer uncached tokens: the decode worker prefills
    max_prefill_queue_tokens: int = 32768  # a prefill worker this loaded takes no more prompts
    kv_lease_s: float = 5.0  # how long a prefill worker holds the blocks for the decode worker
    on_transfer_failure: str = "recompute"  # or "fail": the request, with ABORTED
    kv_transport: str = "auto"  # "nixl", "mapped", "shm", "grpc", or "auto": the first that works
    token: str = ""  # if set, clients must send "authorization: Bearer <token>"
    # What one client may ask (router/limits.py); 0 = no limit.
    max_prompt_tokens: int = 131072
    max_output_tokens: int = 32768  # the most a request's sampling.max_tokens may be
    max_stop_token_ids: int = 256
    max_streams_per_client: int = 1024  # open streams per client address
    # Per tenant (router/tenants.py): named by this header (gRPC metadata, or the HTTP header),
    # else by an HTTP client's API key, else by its address; its open streams and the rate its
    # requests may start at (a bucket of tenant_burst; 0: the rate); 0: no limit.
    tenant_header: str = ""
    max_streams_per_tenant: int = 0
    max_requests_per_tenant_per_s: float = 0.0
    tenant_burst: int = 0
    max_message_bytes: int = 4 << 20  # a larger request is refused (INVALID_ARGUMENT)
    # Whether a request may override the routing policy and its weights (GenerateRequest.routing);
    # off, a request that does is refused (INVALID_ARGUMENT).
    request_overrides: bool = True
    # Every gRPC hop (kvswitch/security.py): TLS when tls_cert is set, mutual with
    # tls_client_auth; fleet_token: what routers and workers present to each other.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    fleet_token: str = ""
    # Listen beyond loopback without the fleet token or mutual TLS, and serve the HTTP API there
    # without API keys (kvswitch/security.py).
    insecure: bool = False
    # How blocks are named (cache_index/hashing.py): xxh3, blake2b-keyed (keyed by a key derived
    # from fleet_token), or "" = blake2b-keyed when there is a fleet token, else xxh3.
    block_hash: str = ""
    metrics_port: int = -1  # Prometheus /metrics; -1 = none, 0 = a free port
    http_port: int = -1  # the OpenAI-compatible HTTP API (docs/OPENAI.md); -1 = none, 0 = free
    # The HTTP API loads and unloads LoRA adapters on the workers (router/lora_updates.py).
    lora_updates: bool = False
    # The HTTP API's keys, comma-separated: clients send "Authorization: Bearer KEY". Empty: the
    # client token (token), if there is one.
    api_key: str = ""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # the HTTP API's largest request body (413)
    # How /v1/embeddings pools a prompt's hidden states ("last" or "mean") when a request does
    # not say; "" = as the checkpoint's sentence-transformers config says, else "last".
    embedding_pooling: str = ""
    grace_s: float = 5.0  # on shutdown, how long running requests may finish
    # OpenAI-API engines (stock vLLM servers; router/engines.py): NAME=URL each, their KV events
    # NAME=tcp://HOST:5557 and replay NAME=tcp://HOST:5558, and the blocks they hash in.
    engine: tuple[str, ...] = ()
    engine_events: tuple[str, ...] = ()
    engine_replay: tuple[str, ...] = ()
    engine_topic: str = ""
    block_size: int = 16
    engine_api_key: str = ""  # what the engines take as "Bearer KEY" (vLLM's --api-key)
    engine_fleet: str = ""  # a JSON file naming more engines, with the fields of the options
    # What an engine's matched block counts for: held by its GPU, or only by a lower tier (CPU).
    gpu_block_weight: float = 1.0
    cpu_block_weight: float = 0.8
    # Scaling out (router/replicas.py): this many router processes on the one port; several
    # routers (these, or on other hosts) tell each other what they route through the index's
    # Redis ("auto": whenever the index is a Redis; "off": never).
    processes: int = 1
    reuse_port: bool = False  # share the ports with other routers (the kernel spreads clients)
    replica_sync: str = "auto"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        make_policy(self.policy, self.policy_weights())  # checks the weights
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, got {self.max_failovers}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.wait_for_worker_s < 0:
            raise ValueError(f"wait_for_worker_s must be >= 0, got {self.wait_for_worker_s}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be -1 or in [0, 65535], got {self.metrics_port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be -1 or in [0, 65535], got {self.http_port}")
        for name in ("peer_fetch_tokens_per_s", "peer_fetch_latency_ms", "prefill_tokens_per_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.pending_ttl_s <= 0:
            raise ValueError(f"pending_ttl_s must be positive, got {self.pending_ttl_s}")
        self._check_processes()
        self.directory_config()
        self.disagg_config()
        self.limits()
        self.security()
        if self.embedding_pooling not in ("", "last", "mean"):
            raise ValueError(
                f"embedding_pooling must be last, mean or empty (the checkpoint's), got "
                f"{self.embedding_pooling!r}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.lora_updates and self.http_port < 0:
            raise ValueError("lora_updates is served by the HTTP API: give --http-port too")
        if parse_api_keys(self.api_key) and self.http_port < 0:
            raise ValueError("api_key is for the HTTP API: serve it with --http-port too")
        self.check_exposure()
        self.block_naming()
        engines = self.engines()
        self.tier_weights()
        self.tenant_limits()  # refuses a bad limit now
        if self.tenant_header and self.tenant_header != self.tenant_header.lower():
            raise ValueError(
                f"tenant_header must be lowercase (gRPC metadata keys are), got "
                f"{self.tenant_header!r}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if engines and not self.namespace:
            raise ValueError(
                "engine: give --namespace too, the model name the engines serve (vLLM's "
                "--served-model-name): requests name it, and blocks are named in it"
            )
        if engines and self.http_port < 0:
            raise ValueError("engine: engines take requests over HTTP: serve --http-port too")

    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(
            self.max_streams_per_tenant, self.max_requests_per_tenant_per_s, self.tenant_burst
        )

    def tier_weights(self) -> TierWeights:
        return TierWeights(self.gpu_block_weight, self.cpu_block_weight)

    def engines(self) -> list[EngineEndpoints]:
        """The OpenAI-API engines named, on the command line and in the fleet file
        (``router/engines.py``); ValueError for a wrong one."""
        engines, events, replays = list(self.engine), list(self.engine_events), []
        replays += self.engine_replay
        if self.engine_fleet:
            for name, url, published, replay in read_engine_fleet(self.engine_fleet):
                engines.append(f"{name}={url}")
                events.append(f"{name}={published}")
                if replay:
                    replays.append(f"{name}={replay}")
        return parse_engines(engines, events, replays, self.engine_topic)

    def security(self) -> FleetSecurity:
        return FleetSecurity.of(self)

    def http_keys(self) -> tuple[str, ...]:
        """What an HTTP client may present: the API keys, else the client token; () = none."""
        return parse_api_keys(self.api_key) or ((self.token,) if self.token else ())

    def check_exposure(self) -> None:
        """ValueError if a port this router listens on beyond loopback would take any caller:
        the gRPC port without the fleet token or mutual TLS, the HTTP API without keys or mutual
        TLS (unless ``insecure``)."""
        security = self.security()
        check_exposure(
            "the router",
            self.host,
            self.port,
            FLEET_WAYS_OUT,
            guarded=security.authenticates_callers,
            insecure=self.insecure,
        )
        if self.http_port >= 0:
            check_exposure(
                "the router's HTTP API",
                self.host,
                self.http_port,
                HTTP_WAYS_OUT,
                guarded=bool(self.http_keys()) or security.tls_client_auth,
                insecure=self.insecure,
            )

    def block_naming(self) -> BlockNaming:
        """How this router names blocks; every worker it routes to must name them alike."""
        return BlockNaming.from_fleet_token(self.fleet_token, self.block_hash)

    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_prompt_tokens=self.max_prompt_tokens,
            max_output_tokens=self.max_output_tokens,
            max_stop_token_ids=self.max_stop_token_ids,
            max_streams_per_client=self.max_streams_per_client,
            max_message_bytes=self.max_message_bytes,
            request_overrides=self.request_overrides,
        )

    def disagg_config(self) -> DisaggConfig:
        return DisaggConfig(
            min_remote_prefill_tokens=self.min_remote_prefill_tokens,
            max_prefill_queue_tokens=self.max_prefill_queue_tokens,
            lease_s=self.kv_lease_s,
            on_transfer_failure=self.on_transfer_failure,
            transport=self.kv_transport,
        )

    def policy_weights(self) -> dict[str, float]:
        if self.policy != "cost":
            return {}
        weights = {
            "prefill_weight": self.prefill_weight,
            "temperature": self.temperature,
            "decode_weight": self.decode_weight,
            "min_match": self.min_match,
            "private_weight": self.private_weight,
            "lora_load_tokens": self.lora_load_tokens,
            "lora_loaded_weight": self.lora_loaded_weight,
            "lora_free_slot_weight": self.lora_free_slot_weight,
        }
        if self.peer_fetch_tokens_per_s > 0 and self.prefill_tokens_per_s > 0:
            weights.update(
                fetch_costs(
                    self.peer_fetch_tokens_per_s,
                    self.peer_fetch_latency_ms / 1000,
                    self.prefill_tokens_per_s,
                )
            )
        return weights

    def _check_processes(self) -> None:
        if self.replica_sync not in ("auto", "off"):
            raise ValueError(f"replica_sync must be auto or off, got {self.replica_sync!r}")
        if self.processes < 1:
            raise ValueError(f"processes must be at least 1, got {self.processes}")
        if self.processes == 1:
            return
        if not self.shares_index():
            raise ValueError(
                "processes > 1 needs an index the processes share: --index redis://HOST:PORT "
                "(each process would hold an embedded index of its own)"
            )
        if 0 in (self.port, self.http_port, self.metrics_port):
            raise ValueError(
                "processes > 1 needs fixed ports: the processes share --port and --http-port, "
                "and process i serves metrics on --metrics-port + i"
            )
        if self.engines():
            raise ValueError(
                "processes > 1 cannot follow engines' KV events (each process would apply "
                "them): follow them with one router, and let others share its index"
            )

    def shares_index(self) -> bool:
        """Whether the index is one other routers can share: a Redis."""
        return self.index.partition("://")[0] in (
            "redis",
            "rediss",
            "redis+cluster",
            "rediss+cluster",
        )

    def syncs_replicas(self) -> bool:
        return self.replica_sync == "auto" and self.shares_index()

    def directory_config(self) -> DirectoryConfig:
        return DirectoryConfig(
            refresh_s=self.refresh_s,
            load_poll_s=self.load_poll_s,
            lost_after_failed_polls=self.lost_after_failed_polls,
        )


# -- the server ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RouterServer:
    """A started router; ``stop`` it when done."""

    address: str  # "host:port" as bound
    router: Router
    servicer: RouterServicer
    server: grpc.aio.Server
    health_servicer: health.aio.HealthServicer
    index: BlockIndex
    tasks: list[asyncio.Task]
    metrics: RouterMetrics
    metrics_server: MetricsServer | None = None
    calls: LocalStub | None = None  # the HTTP front's, in-process
    http_front: HttpFront | None = None
    engine_feeds: EngineFeeds | None = None  # the engines' KV events, followed into the index
    engine_forwarder: EngineForwarder | None = None

    @property
    def metrics_address(self) -> str | None:
        """host:port of /metrics, or None when not served."""
        return self.metrics_server.address if self.metrics_server is not None else None

    @property
    def http_address(self) -> str | None:
        """host:port of the OpenAI-compatible HTTP API, or None when not served."""
        return self.http_front.address if self.http_front is not None else None

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, give running requests ``grace_s`` to finish, then close."""
        await self.health_servicer.enter_graceful_shutdown()
        # NOTE: together: the HTTP front's calls end as the gRPC server's do.
        stopping = [self.server.stop(grace_s)]
        if self.calls is not None:
            stopping.append(self.calls.stop(grace_s))
        if self.http_front is not None:
            stopping.append(self.http_front.stop(grace_s))
        await asyncio.gather(*stopping)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.engine_feeds is not None:
            await self.engine_feeds.stop()
        if self.engine_forwarder is not None:
            await self.engine_forwarder.close()
        if self.router.replicas is not None:
            await self.router.replicas.stop()
        await self.router.directory.stop()
        await self.index.close()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)


class RouterStartError(Exception):
    """The router could not start: its model directory is missing, its port is taken, or its
    index cannot be reached."""


async def start_router(config: RouterConfig, *, front_key: str = "") -> RouterServer:
    """Bind the port, open the index and start serving; ``RouterStartError`` says why not.
    ``front_key``: what this router's HTTP front proves its calls with (router/forwarded.py); a
    new one if empty (the processes of one router share theirs: a front's call may reach any)."""
    try:
        tokenizer, no_tokenizer_reason = _load_tokenizer(config.model)
    except (ValueError, OSError, TokenizerFileError) as e:
        raise RouterStartError(str(e)) from e
    # NOTE: health checks and the CacheIndex service (workers, on the private network) take
    # any caller; the Router service, a client with the token.
    security = config.security()
    guard = ServerGuard(
        {SERVICE_NAME: config.token, grpc_index.SERVICE_NAME: config.fleet_token},
        {SERVICE_NAME: (config.max_message_bytes, "--max-message-bytes")},
    )
    server = grpc.aio.server(
        interceptors=[guard],
        options=[
            ("grpc.so_reuseport", 1 if config.reuse_port else 0),
            # NOTE: gRPC reads a request up to this size, so that the guard can answer one over
            # max_message_bytes with its size and the limit; a larger one gRPC cuts off itself.
            (
                "grpc.max_receive_message_length",
                MESSAGE_READ_FACTOR * config.max_message_bytes,
            ),
        ],
    )
    address = host_port(config.host, config.port)
    try:
        port = security.add_port(server, address)
    except RuntimeError as e:
        raise RouterStartError(
            f"cannot listen on {address}: the port is taken or the address is not one of this "
            "machine's"
        ) from e
    address = host_port(config.host, port)
    try:
        index = await connect_index(config.index, prefix=config.index_prefix)
    except (ValueError, OSError) as e:
        raise RouterStartError(str(e)) from e

    naming = config.block_naming()
    directory = WorkerDirectory(
        index,
        config.directory_config(),
        security=security,
        naming=naming,
        engine_api_key=config.engine_api_key,
    )
    router = Router(
        index,
        directory,
        tokenizer,
        no_tokenizer_reason=no_tokenizer_reason,
        policy=config.policy,
        weights=config.policy_weights(),
        namespace=config.namespace,
        pending=PendingBlocks(config.pending_ttl_s),
        tier_weights=config.tier_weights(),
    )
    if config.syncs_replicas():
        router.replicas = ReplicaSync.for_router(config.index, config.index_prefix, router)
        router.shared_rotation = True
        router.pending.on_confirm = router.replicas.confirmed
        directory.on_load = router.replicas.load_changed
    metrics = RouterMetrics(
        worker_loads=lambda: _worker_loads(directory), counters=_read_counters(router)
    )
    engine_feeds = forwarder = None
    if config.engines():
        engine_feeds = EngineFeeds.of(
            config.engines(), index, config.namespace, config.block_size, naming
        )
        metrics.registry.register(engine_feeds)
    if config.http_port >= 0:
        # NOTE: whether or not this router follows engines: another router sharing its index
        # may, and the engines it registers there are this one's to route to as well.
        from kvswitch.router.engine_forward import EngineForwarder, EngineMetrics

        forwarder = EngineForwarder(
            router,
            EngineMetrics(metrics.registry),
            config.limits(),
            max_failovers=config.max_failovers,
            wait_for_worker_s=config.wait_for_worker_s,
            security=security,
            api_key=config.engine_api_key,
            follows_engines=engine_feeds is not None,
        )
    if config.http_port >= 0:
        front_key = front_key or new_front_key()
    servicer = RouterServicer(
        router,
        metrics,
        max_failovers=config.max_failovers,
        wait_for_worker_s=config.wait_for_worker_s,
        disagg=config.disagg_config(),
        limits=config.limits(),
        front_key=front_key,
        tenants=config.tenant_limits(),
        tenant_header=config.tenant_header,
    )
    calls = LocalStub(servicer)
    http_front = None
    if config.http_port >= 0:
        # NOTE: imported only when served: FastAPI and uvicorn take about a second to import.
        from kvswitch.router.http_server import start_http_front
        from kvswitch.router.openai_http import FrontConfig

        try:
            http_front = await start_http_front(
                FrontConfig.of(config), router, calls, front_key, forwarder
            )
        except OSError as e:
            await index.close()
            raise RouterStartError(
                f"cannot serve HTTP on {host_port(config.host, config.http_port)}: {e}"
            ) from e
    metrics_server = None
    if config.metrics_port >= 0:
        try:
            metrics_server = start_metrics_server(
                metrics.registry, config.host, config.metrics_port
            )
        except OSError as e:
            raise RouterStartError(
                f"cannot serve metrics on {host_port(config.host, config.metrics_port)}: {e}"
            ) from e
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in (SERVICE_NAME, ""):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.index.startswith("memory://"):
        # NOTE: serving from the start: workers must register here before the router can serve.
        grpc_index.add_index_service(server, index)
        await health_servicer.set(grpc_index.SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    await directory.start()
    if router.replicas is not None:
        try:
            await router.replicas.start()
        except (RedisError, OSError) as e:
            # NOTE: the index answered, so this is a channel this Redis user may not use (an
            # ACL without it): routing alone is how routers ran before they shared anything.
            channel = router.replicas.channel
            logger.warning(
                "routing alone: the other routers' channel %s cannot be used (%s); routers on "
                "this index will not share their guesses nor their requests in flight (an ACL "
                "user needs the channel: &%s)",
                channel,
                e,
                channel,
            )
            await router.replicas.close()
            _route_alone(router)
    if engine_feeds is not None:
        engine_feeds.start()
    loop = asyncio.get_running_loop()
    tasks = [
        loop.create_task(reclaim_forever(index, RECLAIM_INTERVAL_S)),
        loop.create_task(_report_health(directory, health_servicer)),
    ]
    logger.info(
        "router listening on %s: index %s, policy %s, block names %s",
        address,
        redacted(config.index),
        config.policy,
        naming.describe(),
    )
    return RouterServer(
        address,
        router,
        servicer,
        server,
        health_servicer,
        index,
        tasks,
        metrics,
        metrics_server,
        calls=calls,
        http_front=http_front,
        engine_feeds=engine_feeds,
        engine_forwarder=forwarder,
    )


async def serve(config: RouterConfig) -> None:
    """Run a router until SIGINT or SIGTERM, then shut it down gracefully."""
    router = await start_router(config)
    if router.metrics_address is not None:
        logger.info("metrics at http://%s/metrics", router.metrics_address)
    announce_ready("router", router.address)
    await wait_for_stop_signal()
    logger.info("shutting down: %.1f s for running requests to finish", config.grace_s)
    await router.stop(config.grace_s)


def run(config: RouterConfig) -> None:
    """``serve`` on uvloop where it is installed; with ``config.processes`` > 1, as that many
    processes (router/processes.py)."""
    if config.processes > 1:
        from kvswitch.router import processes

        try:
            processes.run(config)
        except RuntimeError as e:
            raise RouterStartError(str(e)) from e
        return
    run_event_loop(serve(config))


async def _report_health(
    directory: WorkerDirectory, health_servicer: health.HealthServicer
) -> None:
    """SERVING while some worker is routable, NOT_SERVING while none is."""
    serving: bool | None = None
    while True:
        now_serving = bool(directory.routable(engines=True))
        if now_serving != serving:
            serving = now_serving
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else (health_pb2.HealthCheckResponse.NOT_SERVING)
            )
            for service in (SERVICE_NAME, ""):
                await health_servicer.set(service, status)
            logger.info("%s", "serving" if serving else "not serving: no routable worker")
        await directory.wait_for_change(HEALTH_RECHECK_S)


def _route_alone(router: Router) -> None:
    """Unhook the replica channel: the router keeps its own counts only."""
    router.replicas = None
    router.shared_rotation = False
    router.pending.on_confirm = None
    router.directory.on_load = None


def _worker_loads(directory: WorkerDirectory) -> list[WorkerLoadSample]:
    return [
        WorkerLoadSample(
            h.worker_id, h.num_in_flight, h.num_outstanding_tokens(), h.peer.num_requests
        )
        for h in directory.handles()
    ]


def _read_counters(router: Router) -> list[ReadCounter]:
    """What the router counts and logs no more than now and then: exported at scrape time."""
    return [
        (
            "kvswitch_router_index_errors",
            "Block-index lookups that failed (the index unreachable); those requests were routed "
            "on load alone",
            lambda: router.num_lookup_errors,
        ),
        (
            "kvswitch_router_pending_guesses_confirmed",
            "Guesses that a worker was about to cache a prompt's blocks, confirmed by the index",
            lambda: router.pending.num_confirmed,
        ),
        (
            "kvswitch_router_pending_guesses_expired",
            "Such guesses that lapsed unconfirmed: the worker never reported those blocks in time",
            lambda: router.pending.num_expired,
        ),
        (
            "kvswitch_router_replica_routes",
            "Requests the other router replicas said they routed (router/replicas.py)",
            lambda: router.replicas.num_routes_applied if router.replicas else 0,
        ),
        (
            "kvswitch_router_replica_guesses_taken",
            "Guesses taken from a running router replica as this one started (or rejoined)",
            lambda: router.replicas.num_guesses_taken if router.replicas else 0,
        ),
        (
            "kvswitch_router_replica_errors",
            "Messages to or from the other router replicas lost to a Redis error",
            lambda: router.replicas.num_errors if router.replicas else 0,
        ),
        (
            "kvswitch_router_background_errors",
            "Unexpected errors in the router's background loops (worker refresh, load polling), "
            "each logged with its traceback; the loops go on",
            lambda: router.directory.num_loop_errors,
        ),
    ]


def _load_tokenizer(model: str) -> tuple[Tokenizer | None, str]:
    """The model's tokenizer, or None and why for a model that has none (``random:NAME``, or a
    checkpoint with neither tokenizer.json nor tokenizer.model), whose prompts must come as
    token ids. A missing directory is an error: it is a typo, not a model."""
    if model.startswith(RANDOM_PREFIX):
        return None, f"{model} has random weights and no tokenizer"
    check_model_dir(model)
    try:
        return load_tokenizer(model or None), ""
    except ValueError as e:
        logger.warning("%s; text prompts will be refused", e)
        return None, (
            f"{model} has neither tokenizer.json nor tokenizer.model, so text cannot be tokenized"
        )
