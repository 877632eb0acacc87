"""``kvswitch.v1.Router`` over a ``Router``: forwards each request, relays its stream, fails over.

One request::

    plan (tokenize, hash) -> choose (index match + guesses, policy) -> Worker.Generate
        ^                                                                   |
        |   failed before its first token: the next best worker             |
        +-- failed mid-stream: another worker, prompt + tokens already sent +
                                                    chunks -> client, then one final message

Towards the workers a request goes by an id of the router's own (``fleet_request_id``: engine
request id, prefill lease, KV pulls), fresh for every request it forwards: the client's
``request_id`` is a label (logs, metrics, what the client reads back), so two routers, or a
client reusing its ids, never collide on a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import numpy as np

from kvswitch.cache_index.hashing import TokenIds, tokens_from_bytes, tokens_to_bytes
from kvswitch.router.disagg import DisaggConfig
from kvswitch.router.forwarded import forwarded_client
from kvswitch.router.limits import (
    ClientStreams,
    RequestLimits,
    check_prompt_length,
    check_request,
    client_of,
    output_budget,
    output_charge,
)
from kvswitch.router.metrics import RouterMetrics
from kvswitch.router.policy import Decision
from kvswitch.router.router import (
    FleetFullError,
    NoTokenizerError,
    NoWorkerError,
    Route,
    RoutePlan,
    Router,
)
from kvswitch.router.workers import InFlight, WorkerHandle
from kvswitch.serving import RETRY_AFTER_KEY, retry_after_ms
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens 0 means this, as on the worker
# Initial metadata of a stream, sent with its first token: the worker that produced that token.
WORKER_ID_KEY = "kvswitch-worker-id"
# How often a request waiting for a worker looks again when no worker joined or left (one marked
# down comes back by the clock alone).
_RECHECK_S = 0.25
# Longer text prompts are tokenized on a thread, shorter ones on the loop (cheaper than the hop).
_INLINE_TOKENIZE_CHARS = 1024
_ANSWER_MARGIN_S = 0.1  # a waiting request gives up this long before its deadline
_CLIENT_RETRY_AFTER_MS = 100  # asked of a client at its limit of open streams
_FLEET_FULL_RETRY_AFTER_MS = 100  # asked while every worker refused lately (until a load poll)
# What the router's own request ids start with, on the workers (their logs, engine, leases).
FLEET_REQUEST_ID_PREFIX = "rt-"
# A request whose worker's engine raised (INTERNAL) is retried elsewhere once: if it breaks a
# second engine too, the request itself is the likely cause, and it would break every worker.
MAX_ENGINE_FAILURES = 2

# A worker that answers with one of these judged the request, not itself: tell the client.
_CLIENT_ERRORS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    # A decode worker's KV transfer failed and the policy says fail (router/disagg.py).
    grpc.StatusCode.ABORTED,
)


class _WorkerFailed(Exception):
    """A worker failed the request in a way another worker may not (it died, it is stopping).

    ``engine_failed``: its engine raised while running the request (INTERNAL). The request may be
    what breaks engines, so it gets one more worker, not ``max_failovers``.
    """

    def __init__(self, handle: WorkerHandle, why: str, *, engine_failed: bool = False) -> None:
        super().__init__(f"worker {handle.worker_id}: {why}")
        self.handle = handle
        self.engine_failed = engine_failed


class _WorkerBusy(Exception):
    """A worker is at its queue limit (RESOURCE_EXHAUSTED): another may take the request."""

    def __init__(self, handle: WorkerHandle, retry_after_ms: int) -> None:
        super().__init__(f"worker {handle.worker_id} is at its queue limit")
        self.handle = handle
        self.retry_after_ms = retry_after_ms


class _Refused(Exception):
    """The worker judged the request itself (bad input, deadline passed): tell the client."""

    def __init__(self, handle: WorkerHandle, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.handle = handle
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
    grpc.StatusCode.ABORTED: "error",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
}


@dataclasses.dataclass
class _Outcome:
    """How a request ended, for the metrics."""

    request_id: str  # the client's (a label), or the fleet id where it named none
    metrics: RouterMetrics
    fleet_request_id: str = ""  # what the workers know it by
    finish_reason: str = "error"
    ttft_s: float | None = None  # as the router saw it: arrival to first token relayed
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    recorded: bool = False

    def finished(self, final: router_pb2.GenerateFinal) -> None:
        self.finish_reason = _FINISH_REASON_NAMES.get(final.finish_reason, "error")
        self.num_prompt_tokens = final.stats.num_prompt_tokens
        self.num_cached_tokens = final.stats.num_cached_tokens
        self.num_output_tokens = final.stats.num_output_tokens
        self.record()

    def record(self) -> None:
        """Count the request, once. Called before its last message leaves (the final response,
        or the error status), so that a client holding its answer finds it counted."""
        if self.recorded:
            return
        self.recorded = True
        self.metrics.requests.finished(
            self.finish_reason,
            ttft_s=self.ttft_s,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
        )


@dataclasses.dataclass
class _Progress:
    """What a request has streamed to its client so far, across the workers that served it."""

    outcome: _Outcome
    sent: list[int] = dataclasses.field(default_factory=list)  # output tokens relayed
    # Disaggregated: the prefill worker holding the prompt's blocks under a lease, until a decode
    # worker has taken them; released at once when the request ends before that.
    leased_on: WorkerHandle | None = None
    # How many of the last ``sent`` tokens had no text relayed yet (a character not complete):
    # the next worker of the stream sends it.
    num_pending_text_tokens: int = 0
    started_s: float = dataclasses.field(default_factory=time.monotonic)
    first_token_s: float | None = None


async def _abort(
    context: grpc.aio.ServicerContext, outcome: _Outcome, code: grpc.StatusCode, details: str
) -> None:
    outcome.finish_reason = _FINISH_REASON_BY_CODE.get(code, "error")
    outcome.record()
    if outcome.fleet_request_id:
        # NOTE: a worker's words name the request by the fleet's id; the client knows its own.
        details = details.replace(outcome.fleet_request_id, outcome.request_id)
    await context.abort(code, details)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``kvswitch.v1.Router`` over a ``Router``: forwards, relays, fails over."""

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
    ) -> None:
        """``front_key``: what the router's HTTP front sends with the calls it makes for its
        clients (``router/forwarded.py``); empty = no front."""
        self._router = router
        self._front_key = front_key
        self._limits = limits if limits is not None else RequestLimits()
        self._client_streams = ClientStreams(self._limits.max_streams_per_client)
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
        outcome = _Outcome(request.request_id or fleet_request_id, self._metrics, fleet_request_id)
        progress = _Progress(outcome)
        # NOTE: a call from the HTTP front counts against the HTTP client it stands for.
        forwarded = forwarded_client(context.invocation_metadata(), self._front_key)
        client = forwarded or client_of(context.peer())
        if not self._client_streams.open(client):
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(_CLIENT_RETRY_AFTER_MS)),))
            await _abort(
                context,
                outcome,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client has {self._client_streams.num_open(client)} streams open, the "
                "most this router takes from one client; retry once one has ended",
            )
        try:
            try:
                check_request(request, self._limits)
            except ValueError as e:
                await _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            await self._generate(request, context, progress)
        except asyncio.CancelledError:
            outcome.finish_reason = "abort"
            raise
        finally:
            self._client_streams.close(client)
            if progress.leased_on is not None:
                # NOTE: ended (failed, refused, cancelled) before a decode worker took the
                # prompt's blocks: nobody will; let them go now, not a lease later.
                self._release_later(progress.leased_on, fleet_request_id)
            outcome.record()  # unless the end already did

    async def _generate(
        self,
        request: router_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        progress: _Progress,
    ) -> None:
        outcome = progress.outcome
        request_id = outcome.fleet_request_id  # towards the workers
        log = {"extra": {"request_id": outcome.request_id, "fleet_request_id": request_id}}
        remaining_s = context.time_remaining()
        wait_s = self._wait_for_worker_s
        if remaining_s is not None:
            # NOTE: give up a little before the deadline, so that the client learns why.
            wait_s = min(wait_s, remaining_s - _ANSWER_MARGIN_S)
        wait_until_s = time.monotonic() + wait_s

        try:
            token_ids = await self._token_ids(request)

            async def plan_request() -> RoutePlan:
                return self._router.plan(
                    token_ids=token_ids,
                    lora=request.lora or None,
                    cache_salt=request.cache_salt or None,
                )

            plan = await self._when_a_worker_serves(plan_request, wait_until_s)
            max_tokens = output_budget(
                request.sampling.max_tokens or DEFAULT_MAX_TOKENS,
                len(plan.token_ids),
                plan.max_model_len,
            )
        except ValueError as e:
            await _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoTokenizerError as e:
            await _abort(context, outcome, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except NoWorkerError as e:
            await _abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(e))

        num_prompt_tokens = len(plan.token_ids)
        sent = progress.sent  # output tokens already relayed to the client
        failed: set[str] = set()
        busy: set[str] = set()  # workers at their queue limit: not tried again for this request
        # Decode workers that left while the prompt was prefilled for them: no failover.
        left: set[str] = set()
        retry_after_ms = 0  # the longest wait those asked for
        num_engine_failures = 0
        # Disaggregated: the worker that prefilled the prompt (and holds its blocks), its final.
        prefilled: tuple[WorkerHandle, worker_pb2.WorkerGenerateFinal] | None = None
        stop_token_ids = set(request.sampling.stop_token_ids)
        if self._router.tokenizer is not None:
            stop_token_ids.update(self._router.tokenizer.stop_token_ids)
        while True:
            if sent and (len(sent) >= max_tokens or sent[-1] in stop_token_ids):
                # The failed worker had sent everything but its final message.
                final = _final_without_worker(plan, sent, max_tokens)
                outcome.finished(final)
                await context.write(router_pb2.GenerateResponse(final=final))
                return
            resumed = self._router.extend(plan, sent)

            async def choose() -> Route:
                return await self._router.route(
                    resumed,  # noqa: B023 (awaited within this iteration)
                    policy=request.routing.policy,
                    weights=dict(request.routing.weights),
                    exclude=failed | busy | left,
                    # NOTE: only a prompt not prefilled yet is: a resumed stream goes to one worker.
                    disagg=self._disagg if not sent else None,
                )

            try:
                # NOTE: only the first choice waits: a failover has the others to go to now.
                route = await self._when_a_worker_serves(
                    choose, wait_until_s if not (failed or busy or left) else 0.0
                )
            except ValueError as e:  # the request's routing overrides
                field = "routing.weights" if request.routing.weights else "routing.policy"
                await _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}")
            except FleetFullError as e:
                await self._overloaded(context, outcome, str(e), _FLEET_FULL_RETRY_AFTER_MS)
            except NoWorkerError as e:
                if busy:
                    why = f"every worker that could take the request ({', '.join(sorted(busy))}) "
                    await self._overloaded(
                        context, outcome, why + "is at its queue limit", retry_after_ms
                    )
                await _abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(e))
            self._metrics.index_lookup(self._router.last_lookup_s)
            decision, handle = route.decision, route.handle
            if failed:
                decision = dataclasses.replace(decision, reason=f"failover: {decision.reason}")
            # NOTE: the decode worker is charged (in flight, its guess) as it is chosen, also
            # while another worker prefills the prompt for it: charged only once the prefill
            # was done, it looked idle to a whole burst routed meanwhile, which piled onto it.
            # The first token, when a prefill worker samples it before the decode worker runs.
            num_first = 1 if route.prefill_handle is not None else 0
            goes_on = max_tokens > 1  # a P/D request's decode worker has output to make
            if num_first or (prefilled is not None and prefilled[0].worker_id not in failed):
                # The decode worker computes only what it neither holds nor can take: the tail
                # past the prompt's full blocks (and, after a prefill, its first token).
                num_tail = len(resumed.token_ids) + num_first
                num_uncached = max(num_tail - len(plan.block_hashes) * plan.block_size, 1)
            else:
                num_uncached = self._router.num_uncached_tokens(resumed, decision)
            # NOTE: what this worker's context leaves, which may be less than the fleet's.
            num_output_left = output_charge(
                max_tokens - len(sent) - num_first,
                len(resumed.token_ids) + num_first,
                handle.info.max_model_len,
            )
            flight = self._directory.begin(handle, num_uncached, num_output_left)
            guessed_plan = resumed  # the chain the decode worker is guessed to hold soon
            guessed = goes_on or not num_first  # not for a P/D request done at its first token
            if guessed:
                self._router.routed(guessed_plan, decision)
            reached = False  # the decode worker got the request
            try:
                if route.prefill_handle is not None:
                    assert route.prefill_decision is not None
                    final = await self._prefill(
                        request,
                        resumed,
                        route.prefill_decision,
                        route.prefill_handle,
                        context,
                        progress,
                        goes_on=goes_on,
                    )
                    prefilled = route.prefill_handle, final
                    if (
                        final.finish_reason == common_pb2.FINISH_REASON_STOP
                        or len(sent) >= max_tokens
                    ):
                        # Done with its first token: nothing to decode, nothing to take.
                        progress.leased_on = None
                        await self._release(route.prefill_handle, request_id)
                        client_final = _final(
                            final, route.prefill_decision, num_prompt_tokens, len(sent)
                        )
                        outcome.finished(client_final)
                        await context.write(router_pb2.GenerateResponse(final=client_final))
                        return
                    if not self._serves(handle):
                        # NOTE: it left (or stopped answering) while the prompt was prefilled;
                        # it never got the request, so nothing failed: choose another.
                        left.add(handle.worker_id)
                        logger.info(
                            "decode worker %s left during the prefill; choosing another",
                            handle.worker_id,
                            **log,
                        )
                        continue
                    resumed = self._router.extend(plan, sent)
                # NOTE: per decision at DEBUG: an INFO line per request costs the router ~0.3 ms.
                logger.debug(
                    "routed to %s (%s: %s, %d of %d blocks matched)",
                    decision.worker_id,
                    decision.policy,
                    decision.reason,
                    decision.num_matched_blocks,
                    len(resumed.block_hashes),
                    **log,
                )
                self._metrics.routed(decision.policy, decision.reason, decision.worker_id)
                worker_request = worker_pb2.WorkerGenerateRequest(
                    request_id=request_id,
                    # NOTE: bytes, not the repeated field: one copy, not 8K varints for 8K ids.
                    prompt_token_ids_u32le=tokens_to_bytes(resumed.token_ids),
                    sampling=_remaining_sampling(request.sampling, max_tokens, len(sent)),
                    lora=request.lora,
                    cache_salt=request.cache_salt,
                    num_resumed_tokens=len(sent),
                    num_pending_text_tokens=progress.num_pending_text_tokens,
                )
                if prefilled is not None and prefilled[0].worker_id not in failed:
                    worker_request.kv_source.CopyFrom(self._kv_source(prefilled[0], request_id))
                elif route.fetch_handle is not None:
                    # Peer block fetch: the prefix from the worker that holds it, not computed.
                    source = self._kv_source(route.fetch_handle, "")
                    source.on_failure = "recompute"
                    worker_request.kv_source.CopyFrom(source)
                reached = True
                worker_final = await self._stream(worker_request, handle, flight, context, progress)
                progress.leased_on = None  # taken (or found here already) before it ran
                final = _final(worker_final, decision, num_prompt_tokens, len(sent))
                if prefilled is not None:
                    _prefilled_stats(final.stats, prefilled)
                elif failed and progress.first_token_s is not None:
                    # The last worker's TTFT misses the time lost on the failed ones.
                    final.stats.ttft_s = progress.first_token_s - progress.started_s
                outcome.finished(final)
                await context.write(router_pb2.GenerateResponse(final=final))
                return
            except _Refused as e:
                # NOTE: refused, the request leaves no guess there (nor on the decode worker it
                # never reached: the `finally` below).
                if e.handle is route.prefill_handle:
                    self._router.withdrawn(plan, route.prefill_decision)
                elif reached:
                    self._router.withdrawn(guessed_plan, decision)
                await _abort(context, outcome, e.code, e.details)
            except _WorkerBusy as e:
                if e.handle is route.prefill_handle:
                    self._router.withdrawn(plan, route.prefill_decision)
                elif reached:
                    self._router.withdrawn(guessed_plan, decision)
                e.handle.full = True
                busy.add(e.handle.worker_id)
                retry_after_ms = max(retry_after_ms, e.retry_after_ms)
                logger.debug("%s; trying another", e, **log)
            except _WorkerFailed as e:
                failed.add(e.handle.worker_id)
                self._directory.mark_down(e.handle)
                self._router.pending.forget_worker(e.handle.worker_id)
                num_engine_failures += e.engine_failed
                if num_engine_failures >= MAX_ENGINE_FAILURES:
                    await _abort(
                        context,
                        outcome,
                        grpc.StatusCode.INTERNAL,
                        f"the request failed the engines of {num_engine_failures} workers; "
                        f"not retried further; last: {e}",
                    )
                if len(failed) > self._max_failovers:
                    await _abort(
                        context,
                        outcome,
                        grpc.StatusCode.UNAVAILABLE,
                        f"{len(failed)} workers failed the request; last: {e}",
                    )
                self._metrics.failed_over("mid_stream" if sent else "before_first_token")
                logger.warning(
                    "%s; %s on another worker",
                    e,
                    f"resuming after {len(sent)} tokens" if sent else "retrying",
                    **log,
                )
            finally:
                self._directory.finish(flight)
                if guessed and not reached:
                    self._router.withdrawn(guessed_plan, decision)

    async def _overloaded(
        self,
        context: grpc.aio.ServicerContext,
        outcome: _Outcome,
        why: str,
        retry_after_ms: int,
    ) -> None:
        """End the request with RESOURCE_EXHAUSTED: every worker that could take it is full."""
        # NOTE: never 0: a RESOURCE_EXHAUSTED without a wait is a limit, which clients never
        # retry (client/retry.py).
        retry_after_ms = max(retry_after_ms, 1)
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after_ms)),))
        await _abort(
            context,
            outcome,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{why}; retry in {retry_after_ms} ms",
        )

    async def _prefill(
        self,
        request: router_pb2.GenerateRequest,
        plan: RoutePlan,
        decision: Decision,
        handle: WorkerHandle,
        context: grpc.aio.ServicerContext,
        progress: _Progress,
        *,
        goes_on: bool,
    ) -> worker_pb2.WorkerGenerateFinal:
        """Disaggregated prefill: the prompt on the prefill worker, its first token relayed to
        the client, its blocks held there for the decode worker. The worker's final message.
        ``goes_on``: a decode worker may follow (the request's output is not one token)."""
        self._router.routed(plan, decision)
        self._metrics.routed(decision.policy, "prefill", decision.worker_id)
        worker_request = worker_pb2.WorkerGenerateRequest(
            request_id=progress.outcome.fleet_request_id,
            prompt_token_ids_u32le=tokens_to_bytes(plan.token_ids),
            sampling=_remaining_sampling(request.sampling, 1, 0),
            lora=request.lora,
            cache_salt=request.cache_salt,
            # NOTE: with nothing to decode, no blocks are held, and the prefill worker ends the
            # text (a character cut short is U+FFFD) where it would leave it to the decode worker.
            hold_blocks_ms=round(self._disagg.lease_s * 1000) if goes_on else 0,
        )
        flight = self._directory.begin(handle, self._router.num_uncached_tokens(plan, decision), 1)
        if goes_on:
            # NOTE: from now: a prefill cancelled as it ends may have left its blocks held.
            progress.leased_on = handle
        try:
            return await self._stream(worker_request, handle, flight, context, progress)
        finally:
            self._directory.finish(flight)

    def _kv_source(self, prefill_handle: WorkerHandle, request_id: str) -> worker_pb2.KVSource:
        return worker_pb2.KVSource(
            peer_address=prefill_handle.info.address,
            transfer_id=request_id,
            transport=self._disagg.transport,
            on_failure=self._disagg.on_transfer_failure,
        )

    def _release_later(self, handle: WorkerHandle, transfer_id: str) -> None:
        """``_release`` in the background: the request that held the lease is over (perhaps
        cancelled, when nothing more may be awaited for it)."""
        task = asyncio.get_running_loop().create_task(self._release(handle, transfer_id))
        self._releases.add(task)  # a reference, so that the task is not collected unfinished
        task.add_done_callback(self._releases.discard)

    def _serves(self, handle: WorkerHandle) -> bool:
        """Whether a request may still go to ``handle``: live, registered, not failing lately."""
        return any(h is handle for h in self._directory.routable(roles=(handle.info.role,)))

    async def _release(self, handle: WorkerHandle, transfer_id: str) -> None:
        """Tell a prefill worker that nobody will fetch the blocks it holds; if it cannot be
        told, its lease runs out."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await handle.stub.ReleaseBlocks(
                worker_pb2.ReleaseBlocksRequest(transfer_id=transfer_id), timeout=1.0
            )

    async def _stream(
        self,
        worker_request: worker_pb2.WorkerGenerateRequest,
        handle: WorkerHandle,
        flight: InFlight,
        context: grpc.aio.ServicerContext,
        progress: _Progress,
    ) -> worker_pb2.WorkerGenerateFinal:
        """Relay a worker's chunks to the client as they come; the worker's final message."""
        responses = self._relay(worker_request, handle, flight, context)
        async with contextlib.aclosing(responses):
            async for response in responses:
                if not response.HasField("chunk"):
                    return response.final
                if progress.first_token_s is None and response.chunk.token_ids:
                    progress.first_token_s = time.monotonic()
                    progress.outcome.ttft_s = progress.first_token_s - progress.started_s
                    await context.send_initial_metadata(((WORKER_ID_KEY, handle.worker_id),))
                elif response.chunk.HasField("num_cached_tokens"):
                    # NOTE: a stream resumed on another worker: the client's first chunk, from
                    # the first worker, already said how much of its prompt was cached.
                    response.chunk.ClearField("num_cached_tokens")
                progress.sent += response.chunk.token_ids
                progress.num_pending_text_tokens = response.chunk.num_pending_text_tokens
                await context.write(router_pb2.GenerateResponse(chunk=response.chunk))
        raise _WorkerFailed(handle, "the stream ended without a final message")

    async def _when_a_worker_serves(
        self, attempt: Callable[[], Awaitable[T]], wait_until_s: float
    ) -> T:
        """``await attempt()``, again whenever the workers change while it raises
        ``NoWorkerError``, until ``wait_until_s`` (``time.monotonic``); then the error stands."""
        while True:
            try:
                return await attempt()
            except NoWorkerError:
                left_s = wait_until_s - time.monotonic()
                if left_s <= 0:
                    raise
                await self._directory.wait_for_change(min(left_s, _RECHECK_S))

    async def _relay(
        self,
        worker_request: worker_pb2.WorkerGenerateRequest,
        handle: WorkerHandle,
        flight: InFlight,
        context: grpc.aio.ServicerContext,
    ):
        """The worker's responses. Its own failures raise ``_WorkerFailed`` (try another worker),
        its verdicts on the request ``_Refused`` (tell the client); the call is cancelled with
        us."""
        try:
            call = handle.stub.Generate(worker_request, timeout=context.time_remaining())
        except grpc.aio.UsageError:  # its channel closed: it left after it was chosen
            raise _WorkerFailed(handle, "it left the fleet") from None
        # NOTE: a worker cut off without a word (its link down, its process stopped) sends
        # nothing, not even an error: once its load poll fails, its streams stop waiting.
        lost = handle.lost
        watcher = asyncio.get_running_loop().create_task(_cancel_when(lost, call))
        try:
            async for response in call:
                if response.HasField("chunk"):
                    self._directory.first_token(flight)
                    self._directory.produced(flight, len(response.chunk.token_ids))
                yield response
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if lost.is_set() and task is not None and not task.cancelling():
                raise _WorkerFailed(handle, "it stopped answering its load polls") from None
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in _CLIENT_ERRORS:
                raise _Refused(handle, code, e.details() or code.name) from None
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _WorkerBusy(handle, retry_after_ms(e.trailing_metadata())) from None
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _Refused(handle, code, "the request's deadline passed") from None
            raise _WorkerFailed(
                handle,
                f"{code.name}: {e.details()}",
                engine_failed=code is grpc.StatusCode.INTERNAL,
            ) from None
        finally:
            watcher.cancel()
            call.cancel()

    async def _token_ids(self, request: router_pb2.GenerateRequest) -> TokenIds:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("the request has no prompt: set text or token_ids")
        if kind == "token_ids":
            token_ids = token_ids_from_proto(request.token_ids)
        elif len(request.text) <= _INLINE_TOKENIZE_CHARS:
            token_ids = self._router.tokenize(request.text)
        else:
            # NOTE: a long prompt would stall every stream this loop relays (about 2.5 us a
            # token with a BPE tokenizer); the tokenizers library lets go of the GIL meanwhile.
            token_ids = await asyncio.to_thread(self._router.tokenize, request.text)
        check_prompt_length(len(token_ids), kind, self._limits)
        return token_ids


async def _cancel_when(event: asyncio.Event, call: grpc.aio.Call) -> None:
    await event.wait()
    call.cancel()


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
    stats.prefill_worker_id = stats.decode_worker_id = stats.worker_id
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


def _prefilled_stats(
    stats: common_pb2.RequestStats,
    prefilled: tuple[WorkerHandle, worker_pb2.WorkerGenerateFinal],
) -> None:
    """A disaggregated request's stats: the prompt's figures are the prefill worker's."""
    handle, prefill_final = prefilled
    stats.prefill_worker_id = handle.worker_id
    stats.ttft_s = prefill_final.stats.ttft_s
    stats.num_cached_tokens = min(prefill_final.stats.num_cached_tokens, stats.num_prompt_tokens)


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
