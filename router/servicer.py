"""``kvswitch.v1.Router`` over a ``Router``: admits each request, plans it, runs its attempts.

One request::

    admit (the client's open streams, the request's bounds) -> plan (tokenize, hash)
        -> attempts (router/attempt.py): ROUTE -> (PREFILL) -> STREAM -> DONE,
           a worker full or failed: FAILOVER -> ROUTE, resumed after the tokens already sent

Towards the workers a request goes by an id of the router's own (``fleet_request_id``: engine
request id, prefill lease, KV pulls), fresh for every request it forwards: the client's
``request_id`` is a label (logs, metrics, what the client reads back), so two routers, or a
client reusing its ids, never collide on a worker.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import grpc
import numpy as np

from kvswitch.cache_index.hashing import TokenIds, tokens_from_bytes
from kvswitch.router.attempt import WORKER_ID_KEY as WORKER_ID_KEY
from kvswitch.router.attempt import Attempts, Progress, when_a_worker_serves
from kvswitch.router.disagg import DisaggConfig
from kvswitch.router.forwarded import FORWARDED_TENANT_HEADER, forwarded_client
from kvswitch.router.limits import (
    ClientStreams,
    RequestLimits,
    check_prompt_length,
    check_request,
    client_of,
    output_budget,
)
from kvswitch.router.metrics import RouterMetrics
from kvswitch.router.outcome import Outcome, abort
from kvswitch.router.router import NoTokenizerError, NoWorkerError, RoutePlan, Router
from kvswitch.router.tenants import TenantLimits
from kvswitch.router.worker_call import release_blocks
from kvswitch.router.workers import WorkerHandle
from kvswitch.serving import RETRY_AFTER_KEY
from kvswitch.v1 import router_pb2, router_pb2_grpc

DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens 0 means this, as on the worker
_ANSWER_MARGIN_S = 0.1  # a waiting request gives up this long before its deadline
_CLIENT_RETRY_AFTER_MS = 100  # asked of a client at its limit of open streams
# What the router's own request ids start with, on the workers (their logs, engine, leases).
FLEET_REQUEST_ID_PREFIX = "rt-"


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``kvswitch.v1.Router`` over a ``Router``: admits, plans, runs the attempts."""

    def __init__(
        self,
        router: Router,
        metrics: RouterMetrics | None = None,
        *,
        max_failovers: int = 3,
        wait_for_worker_s: float = 0.0,
        disagg: DisaggConfig | None = None,
        limits: RequestLimits | None = None,
        front_key: str = "",
        tenants: TenantLimits | None = None,
        tenant_header: str = "",
    ) -> None:
        """``front_key``: what the router's HTTP front sends with the calls it makes for its
        clients (``router/forwarded.py``); empty = no front. ``tenants``: each tenant's limits,
        a tenant named by the metadata ``tenant_header`` (else by the client)."""
        self._router = router
        self._front_key = front_key
        self._limits = limits if limits is not None else RequestLimits()
        self._client_streams = ClientStreams(self._limits.max_streams_per_client)
        self._tenants = tenants if tenants is not None else TenantLimits()
        self._tenant_header = tenant_header
        self._releases: set[asyncio.Task] = set()  # leases let go of, not waited for
        self._disagg = disagg if disagg is not None else DisaggConfig()
        self._directory = router.directory
        self._metrics = metrics or RouterMetrics()
        self._max_failovers = max_failovers
        self._wait_for_worker_s = wait_for_worker_s

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # NOTE: written with context.write, not as an async generator, so that a cancelled RPC
        # raises CancelledError in here and the worker's call is cancelled with it.
        fleet_request_id = f"{FLEET_REQUEST_ID_PREFIX}{uuid.uuid4().hex}"
        outcome = Outcome(request.request_id or fleet_request_id, self._metrics, fleet_request_id)
        progress = Progress(outcome)
        # NOTE: a call from the HTTP front counts against the HTTP client it stands for.
        forwarded = forwarded_client(context.invocation_metadata(), self._front_key)
        client = forwarded or client_of(context.peer())
        if not self._client_streams.open(client):
            self._metrics.overloaded("client_streams")
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(_CLIENT_RETRY_AFTER_MS)),))
            await abort(
                context,
                outcome,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client has {self._client_streams.num_open(client)} streams open, the "
                "most this router takes from one client; retry once one has ended",
            )
        tenant = None
        try:
            if self._tenants.limits_anything:
                tenant = self._tenant_of(context, client)
                refused = self._tenants.admit(tenant)
                if refused is not None:
                    tenant = None
                    await self._refuse_tenant(context, outcome, *refused)
            try:
                check_request(request, self._limits)
            except ValueError as e:
                await abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            await self._generate(request, context, progress)
        except asyncio.CancelledError:
            outcome.finish_reason = "abort"
            raise
        finally:
            self._client_streams.close(client)
            if tenant is not None:
                self._tenants.close(tenant)
            if progress.leased_on is not None:
                # NOTE: ended (failed, refused, cancelled) before a decode worker took the
                # prompt's blocks: nobody will; let them go now, not a lease later.
                self._release_later(progress.leased_on, fleet_request_id)
            outcome.record()  # unless the end already did

    def _tenant_of(self, context: grpc.aio.ServicerContext, client: str) -> str:
        """The tenant a call counts against: as the HTTP front names it, else the value of the
        tenant header, else the client."""
        metadata = context.invocation_metadata()
        forwarded = forwarded_client(metadata, self._front_key, FORWARDED_TENANT_HEADER)
        if forwarded is not None:
            return forwarded
        if self._tenant_header:
            value = dict(metadata or ()).get(self._tenant_header)
            if isinstance(value, str) and value:
                return value
        return client

    async def _refuse_tenant(
        self,
        context: grpc.aio.ServicerContext,
        outcome: Outcome,
        why: str,
        retry_after_s: float,
    ) -> None:
        self._metrics.overloaded(f"tenant_{why}")
        retry_after_ms = max(math.ceil(retry_after_s * 1000), 1)
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after_ms)),))
        what = (
            f"this tenant has {self._tenants.max_streams} streams open, its most"
            if why == "streams"
            else f"this tenant starts at most {self._tenants.requests_per_s:g} requests a second"
        )
        await abort(
            context,
            outcome,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{what}; retry in {retry_after_ms} ms",
        )

    async def _generate(
        self,
        request: router_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        progress: Progress,
    ) -> None:
        """Plan the request, then run its attempts (router/attempt.py)."""
        remaining_s = context.time_remaining()
        wait_s = self._wait_for_worker_s
        if remaining_s is not None:
            # NOTE: give up a little before the deadline, so that the client learns why.
            wait_s = min(wait_s, remaining_s - _ANSWER_MARGIN_S)
        wait_until_s = time.monotonic() + wait_s
        plan, max_tokens = await self._plan(request, context, progress.outcome, wait_until_s)
        attempts = Attempts(
            router=self._router,
            metrics=self._metrics,
            disagg=self._disagg,
            max_failovers=self._max_failovers,
            request=request,
            context=context,
            progress=progress,
            plan=plan,
            max_tokens=max_tokens,
            wait_until_s=wait_until_s,
        )
        await attempts.run()

    async def _plan(
        self,
        request: router_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        outcome: Outcome,
        wait_until_s: float,
    ) -> tuple[RoutePlan, int]:
        """The request's plan (waiting for a worker to say what model is served, until
        ``wait_until_s``) and its output budget; or the call ends with why not."""
        try:
            token_ids = await self._token_ids(request)

            async def plan_request() -> RoutePlan:
                return self._router.plan(
                    token_ids=token_ids,
                    lora=request.lora or None,
                    cache_salt=request.cache_salt or None,
                )

            plan = await when_a_worker_serves(self._directory, plan_request, wait_until_s)
            max_tokens = output_budget(
                request.sampling.max_tokens or DEFAULT_MAX_TOKENS,
                len(plan.token_ids),
                plan.max_model_len,
            )
            return plan, max_tokens
        except ValueError as e:
            await abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoTokenizerError as e:
            await abort(context, outcome, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except NoWorkerError as e:
            await abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(e))
        raise AssertionError("abort returns only by raising")

    def _release_later(self, handle: WorkerHandle, transfer_id: str) -> None:
        """``release_blocks`` in the background: the request that held the lease is over
        (perhaps cancelled, when nothing more may be awaited for it)."""
        task = asyncio.get_running_loop().create_task(release_blocks(handle, transfer_id))
        self._releases.add(task)  # a reference, so that the task is not collected unfinished
        task.add_done_callback(self._releases.discard)

    async def _token_ids(self, request: router_pb2.GenerateRequest) -> TokenIds:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("the request has no prompt: set text or token_ids")
        if kind == "token_ids":
            token_ids = token_ids_from_proto(request.token_ids)
        elif len(request.text) <= self._router.inline_chars():
            token_ids = self._router.tokenize(request.text)
        else:
            # NOTE: a long prompt would stall every stream this loop relays (``inline_chars``);
            # the tokenizers library lets go of the GIL meanwhile.
            token_ids = await asyncio.to_thread(self._router.tokenize, request.text)
        check_prompt_length(len(token_ids), kind, self._limits)
        return token_ids


def token_ids_from_proto(token_ids: router_pb2.TokenIds) -> np.ndarray:
    """The prompt, from whichever of ``ids`` and ``ids_u32le`` carries it; ValueError if both
    do, or neither."""
    packed = token_ids.ids_u32le
    if packed and token_ids.ids:
        raise ValueError("token_ids sets both ids and ids_u32le; set one")
    if packed:
        try:
            return tokens_from_bytes(packed)
        except ValueError as e:
            raise ValueError(f"token_ids.ids_u32le: {e}") from None
    if not token_ids.ids:
        raise ValueError("the prompt is empty: token_ids sets neither ids nor ids_u32le")
    return np.array(token_ids.ids, np.uint32)
