"""The router's gRPC server: ``kvswitch.v1.Router`` plus the standard health service.

One request, as the servicer handles it::

    plan (tokenize, hash) -> choose (index match + guesses, policy) -> Worker.Generate
        ^                                                                   |
        |   failed before its first token: the next best worker             |
        +-- failed mid-stream: another worker, prompt + tokens already sent +
                                                    chunks -> client, then one final message

With the embedded index (``memory://``, the default), the router also serves that index as
``kvswitch.v1.CacheIndex`` on its own port, and workers publish to it with
``--index grpc://ROUTER:PORT``. Several routers share a fleet through a Redis index instead.

``serve(config)`` runs a router until SIGINT/SIGTERM; ``start_router(config)`` starts one and
hands back a ``RouterServer`` to stop later (tests, embedding, ``kvswitch up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cache_index.connect import connect_index
from cache_index.index import BlockIndex, reclaim_forever
from kvswitch.metrics import MetricsServer
from kvswitch.serving import host_port, run_event_loop, wait_for_stop_signal
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.metrics import RouterMetrics, WorkerLoadSample
from router.pending import PendingBlocks
from router.policy import POLICIES, Decision, make_policy
from router.router import NoWorkerError, RoutePlan, Router
from router.workers import DirectoryConfig, InFlight, WorkerDirectory, WorkerHandle
from worker.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = "kvswitch.v1.Router"  # its health-check name
DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens 0 means this, as on the worker
RECLAIM_INTERVAL_S = 5.0

# A worker that answers with one of these judged the request, not itself: tell the client.
_CLIENT_ERRORS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Where a router listens, which index it reads and how it scores workers."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 = a free port chosen by the OS
    index: str = "memory://"  # memory:// = embedded, served to workers on this port
    model: str = ""  # checkpoint directory whose tokenizer to use; empty = the built-in model's
    namespace: str = ""  # the model to route for; empty = the one the live workers serve
    policy: str = "cost"
    prefill_weight: float = 1.0  # cost: what one uncached prompt token costs, in queued tokens
    temperature: float = 0.0  # cost: 0 = always the cheapest; > 0 samples near-ties
    max_failovers: int = 3  # other workers tried after a worker fails a request
    pending_ttl_s: float = 2.0  # how long an unconfirmed "will hold these blocks" guess lives
    refresh_s: float = 0.25  # how often to re-read the live workers
    load_poll_s: float = 0.1  # how often to ask each worker for its load
    token: str = ""  # if set, clients must send "authorization: Bearer <token>"
    metrics_port: int = -1  # Prometheus /metrics; -1 = none, 0 = a free port
    grace_s: float = 5.0  # on shutdown, how long running requests may finish

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
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be -1 or in [0, 65535], got {self.metrics_port}")
        PendingBlocks(self.pending_ttl_s)
        self.directory_config()

    def policy_weights(self) -> dict[str, float]:
        if self.policy != "cost":
            return {}
        return {"prefill_weight": self.prefill_weight, "temperature": self.temperature}

    def directory_config(self) -> DirectoryConfig:
        return DirectoryConfig(refresh_s=self.refresh_s, load_poll_s=self.load_poll_s)


class _WorkerFailed(Exception):
    """A worker failed the request in a way another worker may not (it died, it is stopping)."""

    def __init__(self, worker_id: str, why: str) -> None:
        super().__init__(f"worker {worker_id}: {why}")


class _Refused(Exception):
    """The worker judged the request itself (bad input, deadline passed): tell the client."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


_FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_FINISH_REASON_BY_CODE = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "abort",
    **{code: "rejected" for code in _CLIENT_ERRORS},
}


@dataclasses.dataclass
class _Outcome:
    """How a request ended, for the metrics."""

    request_id: str
    finish_reason: str = "error"
    ttft_s: float | None = None  # as the router saw it: arrival to first token relayed
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def finished(self, final: router_pb2.GenerateFinal) -> None:
        self.finish_reason = _FINISH_REASON_NAMES.get(final.finish_reason, "error")
        self.num_prompt_tokens = final.stats.num_prompt_tokens
        self.num_cached_tokens = final.stats.num_cached_tokens
        self.num_output_tokens = final.stats.num_output_tokens


async def _abort(
    context: grpc.aio.ServicerContext, outcome: _Outcome, code: grpc.StatusCode, details: str
) -> None:
    outcome.finish_reason = _FINISH_REASON_BY_CODE.get(code, "error")
    await context.abort(code, details)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``kvswitch.v1.Router`` over a ``Router``: forwards, relays, fails over."""

    def __init__(
        self, router: Router, metrics: RouterMetrics | None = None, *, max_failovers: int = 3
    ) -> None:
        self._router = router
        self._directory = router.directory
        self._metrics = metrics or RouterMetrics()
        self._max_failovers = max_failovers
        self.num_failovers = 0

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # NOTE: written with context.write, not as an async generator, so that a cancelled RPC
        # raises CancelledError in here and the worker's call is cancelled with it.
        outcome = _Outcome(request.request_id or f"router-{uuid.uuid4().hex}")
        try:
            await self._generate(request, context, outcome)
        except asyncio.CancelledError:
            outcome.finish_reason = "abort"
            raise
        finally:
            self._metrics.request_finished(
                outcome.finish_reason,
                ttft_s=outcome.ttft_s,
                num_prompt_tokens=outcome.num_prompt_tokens,
                num_cached_tokens=outcome.num_cached_tokens,
                num_output_tokens=outcome.num_output_tokens,
            )

    async def _generate(
        self,
        request: router_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        outcome: _Outcome,
    ) -> None:
        request_id = outcome.request_id
        log = {"extra": {"request_id": request_id}}
        try:
            plan = self._plan(request)
            max_tokens = request.sampling.max_tokens or DEFAULT_MAX_TOKENS
        except ValueError as e:
            await _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoWorkerError as e:
            await _abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(e))

        num_prompt_tokens = len(plan.token_ids)
        sent: list[int] = []  # output tokens already relayed to the client
        failed: set[str] = set()
        started_s = time.monotonic()
        first_token_s: float | None = None
        stop_token_ids = set(request.sampling.stop_token_ids)
        stop_token_ids.update(self._router.tokenizer.stop_token_ids)
        while True:
            if sent and (len(sent) >= max_tokens or sent[-1] in stop_token_ids):
                # The failed worker had sent everything but its final message.
                final = _final_without_worker(plan, sent, max_tokens)
                outcome.finished(final)
                await context.write(router_pb2.GenerateResponse(final=final))
                return
            resumed = self._router.extend(plan, sent)
            try:
                decision, handle = await self._router.choose(
                    resumed,
                    policy=request.routing.policy,
                    weights=dict(request.routing.weights),
                    exclude=failed,
                )
            except ValueError as e:
                await _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except NoWorkerError as e:
                await _abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(e))
            self._metrics.index_lookup(self._router.last_lookup_s)
            if failed:
                decision = dataclasses.replace(decision, reason=f"failover: {decision.reason}")
            logger.info(
                "request %s -> %s (%s: %s, %d of %d blocks matched)",
                request_id,
                decision.worker_id,
                decision.policy,
                decision.reason,
                decision.num_matched_blocks,
                len(resumed.block_hashes),
                **log,
            )
            self._router.routed(resumed, decision)
            self._metrics.routed(decision.policy, decision.reason, decision.worker_id)
            flight = self._directory.begin(
                handle, self._router.num_uncached_tokens(resumed, decision), max_tokens - len(sent)
            )
            worker_request = worker_pb2.WorkerGenerateRequest(
                request_id=request_id,
                prompt_token_ids=resumed.token_ids,
                sampling=_remaining_sampling(request.sampling, max_tokens, len(sent)),
                lora=request.lora,
                cache_salt=request.cache_salt,
                num_resumed_tokens=len(sent),
            )
            try:
                responses = self._relay(worker_request, handle, flight, context)
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        if response.HasField("chunk"):
                            if first_token_s is None and response.chunk.token_ids:
                                first_token_s = time.monotonic()
                                outcome.ttft_s = first_token_s - started_s
                            sent += response.chunk.token_ids
                            await context.write(router_pb2.GenerateResponse(chunk=response.chunk))
                            continue
                        final = _final(response.final, decision, num_prompt_tokens, len(sent))
                        if failed and first_token_s is not None:
                            # The last worker's TTFT misses the time lost on the failed ones.
                            final.stats.ttft_s = first_token_s - started_s
                        outcome.finished(final)
                        await context.write(router_pb2.GenerateResponse(final=final))
                        return
                raise _WorkerFailed(decision.worker_id, "the stream ended without a final message")
            except _Refused as e:
                await _abort(context, outcome, e.code, e.details)
            except _WorkerFailed as e:
                failed.add(decision.worker_id)
                self._directory.mark_down(handle)
                self._router.pending.forget_worker(decision.worker_id)
                if len(failed) > self._max_failovers:
                    await _abort(
                        context,
                        outcome,
                        grpc.StatusCode.UNAVAILABLE,
                        f"{len(failed)} workers failed the request; last: {e}",
                    )
                self.num_failovers += 1
                self._metrics.failed_over("mid_stream" if sent else "before_first_token")
                logger.warning(
                    "request %s: %s; %s on another worker",
                    request_id,
                    e,
                    f"resuming after {len(sent)} tokens" if sent else "retrying",
                    **log,
                )
            finally:
                self._directory.finish(flight)

    async def _relay(
        self,
        worker_request: worker_pb2.WorkerGenerateRequest,
        handle: WorkerHandle,
        flight: InFlight,
        context: grpc.aio.ServicerContext,
    ):
        """The worker's responses, with its failures as ``_WorkerFailed`` and the client's
        mistakes aborting the client's RPC. The worker's call is cancelled if we are."""
        call = handle.stub.Generate(worker_request, timeout=context.time_remaining())
        try:
            async for response in call:
                if response.HasField("chunk"):
                    self._directory.first_token(flight)
                    self._directory.produced(flight, len(response.chunk.token_ids))
                yield response
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in _CLIENT_ERRORS:
                raise _Refused(code, e.details() or code.name) from None
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _Refused(code, "the request's deadline passed") from None
            raise _WorkerFailed(handle.worker_id, f"{code.name}: {e.details()}") from None
        finally:
            call.cancel()

    def _plan(self, request: router_pb2.GenerateRequest) -> RoutePlan:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("the request has no prompt: set text or token_ids")
        return self._router.plan(
            text=request.text if kind == "text" else None,
            token_ids=request.token_ids.ids if kind == "token_ids" else None,
            lora=request.lora or None,
            cache_salt=request.cache_salt or None,
        )


def _remaining_sampling(
    sampling: common_pb2.SamplingParams, max_tokens: int, num_sent: int
) -> common_pb2.SamplingParams:
    remaining = common_pb2.SamplingParams()
    remaining.CopyFrom(sampling)
    remaining.max_tokens = max_tokens - num_sent
    return remaining


def _final(
    worker_final: worker_pb2.WorkerGenerateFinal,
    decision: Decision,
    num_prompt_tokens: int,
    num_output_tokens: int,
) -> router_pb2.GenerateFinal:
    """The client's final message: the worker's, counted from the client's view (a resumed
    worker saw the tokens already sent as prompt), with the routing decision."""
    stats = common_pb2.RequestStats()
    stats.CopyFrom(worker_final.stats)
    stats.num_prompt_tokens = num_prompt_tokens
    stats.num_cached_tokens = min(stats.num_cached_tokens, num_prompt_tokens)
    stats.num_output_tokens = num_output_tokens
    route = router_pb2.RouteDecision(
        worker_id=decision.worker_id,
        policy=decision.policy,
        reason=decision.reason,
        num_matched_blocks=decision.num_matched_blocks,
        score=decision.score,
    )
    return router_pb2.GenerateFinal(
        finish_reason=worker_final.finish_reason, stats=stats, route=route
    )


def _final_without_worker(
    plan: RoutePlan, sent: list[int], max_tokens: int
) -> router_pb2.GenerateFinal:
    reason = (
        common_pb2.FINISH_REASON_LENGTH
        if len(sent) >= max_tokens
        else common_pb2.FINISH_REASON_STOP
    )
    stats = common_pb2.RequestStats(
        num_prompt_tokens=len(plan.token_ids), num_output_tokens=len(sent)
    )
    route = router_pb2.RouteDecision(reason="failover: output was complete")
    return router_pb2.GenerateFinal(finish_reason=reason, stats=stats, route=route)


# -- authentication --------------------------------------------------------------------------


class _BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Router calls without ``authorization: Bearer <token>``. Health checks and the
    CacheIndex service (workers, on the private network) pass without one."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(handler_call_details)
        return grpc.unary_stream_rpc_method_handler(_unauthenticated)


async def _unauthenticated(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


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

    @property
    def metrics_address(self) -> str | None:
        """host:port of /metrics, or None when not served."""
        return self.metrics_server.address if self.metrics_server is not None else None

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, give running requests ``grace_s`` to finish, then close."""
        await self.health_servicer.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.router.directory.stop()
        await self.index.close()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)


class RouterStartError(Exception):
    """The router could not start: its port is taken, or its index cannot be reached."""


async def start_router(config: RouterConfig) -> RouterServer:
    """Bind the port, open the index and start serving; ``RouterStartError`` says why not."""
    interceptors = [_BearerTokenInterceptor(config.token)] if config.token else []
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    address = host_port(config.host, config.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RouterStartError(
            f"cannot listen on {address}: the port is taken or the address is not one of this "
            "machine's"
        ) from e
    address = host_port(config.host, port)
    try:
        index = await connect_index(config.index)
        tokenizer = load_tokenizer(config.model or None)
    except (ValueError, OSError) as e:
        raise RouterStartError(str(e)) from e

    directory = WorkerDirectory(index, config.directory_config())
    router = Router(
        index,
        directory,
        tokenizer,
        policy=config.policy,
        weights=config.policy_weights(),
        namespace=config.namespace,
        pending=PendingBlocks(config.pending_ttl_s),
    )
    metrics = RouterMetrics(worker_loads=lambda: _worker_loads(directory))
    metrics_server = None
    if config.metrics_port >= 0:
        try:
            metrics_server = metrics.serve(config.host, config.metrics_port)
        except OSError as e:
            raise RouterStartError(
                f"cannot serve metrics on {host_port(config.host, config.metrics_port)}: {e}"
            ) from e
    servicer = RouterServicer(router, metrics, max_failovers=config.max_failovers)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    serving = [SERVICE_NAME, ""]
    if config.index.startswith("memory://"):
        from cache_index import grpc_index

        grpc_index.add_index_service(server, index)
        serving.append(grpc_index.SERVICE_NAME)
    for service in serving:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    await directory.start()
    tasks = [asyncio.get_running_loop().create_task(reclaim_forever(index, RECLAIM_INTERVAL_S))]
    logger.info("router listening on %s: index %s, policy %s", address, config.index, config.policy)
    return RouterServer(
        address, router, servicer, server, health_servicer, index, tasks, metrics, metrics_server
    )


async def serve(config: RouterConfig) -> None:
    """Run a router until SIGINT or SIGTERM, then shut it down gracefully."""
    router = await start_router(config)
    if router.metrics_address is not None:
        logger.info("metrics at http://%s/metrics", router.metrics_address)
    print(f"kvswitch router listening on {router.address}", flush=True)
    await wait_for_stop_signal()
    logger.info("shutting down: %.1f s for running requests to finish", config.grace_s)
    await router.stop(config.grace_s)


def run(config: RouterConfig) -> None:
    """``serve`` on uvloop where it is installed."""
    run_event_loop(serve(config))


def _worker_loads(directory: WorkerDirectory) -> list[WorkerLoadSample]:
    return [
        WorkerLoadSample(h.worker_id, h.num_in_flight, h.num_outstanding_tokens())
        for h in directory.handles()
    ]
