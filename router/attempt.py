"""One request's way through the workers: a state machine, one small method a state, each
returning the next::

    ROUTE ---------------------------------------------> STREAM ----------------> DONE
      |  a prefill worker computes the prompt first         ^  (the decode worker takes the
      +--> PREFILL -----------------------------------------+   prompt's blocks from the
      |       |-- its first token ends the request --------------------------> DONE
      |       +-- the decode worker left meanwhile --> ROUTE  (no failover)
      +-- the output is complete already (a worker failed before its final) --> DONE

    PREFILL, STREAM: the worker is full or failed ---> FAILOVER ---> ROUTE, or the call ends
                     the worker refused the request -------------> the call ends (its status)

An attempt is one choice of workers. ROUTE charges them as it chooses them (in flight, a pending
guess of the blocks they will hold); whatever ends the attempt (DONE, ROUTE again, FAILOVER, an
error status, the client's cancel) gives back what a worker never took (``_end_attempt``).
Everything a request carries from one attempt to the next is in ``Progress``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from kvswitch.cache_index.hashing import tokens_to_bytes
from kvswitch.router.disagg import DisaggConfig
from kvswitch.router.limits import output_charge
from kvswitch.router.metrics import RouterMetrics
from kvswitch.router.outcome import (
    Outcome,
    abort,
    client_final,
    final_without_worker,
    overloaded,
    prefilled_stats,
)
from kvswitch.router.policy import Decision
from kvswitch.router.router import (
    FleetFullError,
    NoWorkerError,
    Route,
    RoutePlan,
    Router,
    UnknownAdapterError,
)
from kvswitch.router.worker_call import (
    Refused,
    WorkerBusy,
    WorkerFailed,
    kv_source,
    relay,
    release_blocks,
)
from kvswitch.router.workers import InFlight, WorkerDirectory, WorkerHandle
from kvswitch.v1 import common_pb2, router_pb2, worker_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Initial metadata of a stream, sent with its first token: the worker that produced that token.
WORKER_ID_KEY = "kvswitch-worker-id"
# A request whose worker's engine raised (INTERNAL) is retried elsewhere once: if it breaks a
# second engine too, the request itself is the likely cause, and it would break every worker.
MAX_ENGINE_FAILURES = 2
# How often a request waiting for a worker looks again when no worker joined or left (one marked
# down comes back by the clock alone).
_RECHECK_S = 0.25
_FLEET_FULL_RETRY_AFTER_MS = 100  # asked while every worker refused lately (until a load poll)


class Step(enum.Enum):
    ROUTE = "route"  # choose (and charge) the workers for what is left of the request
    PREFILL = "prefill"  # P/D: a prefill worker computes the prompt and its first token
    STREAM = "stream"  # one worker streams the rest, taking held blocks first where there are
    FAILOVER = "failover"  # a worker was full or failed: leave it out, or give up
    DONE = "done"  # the final message is sent


@dataclasses.dataclass
class Progress:
    """What a request has done so far, across its attempts: what it streamed to its client, the
    workers it left out, the blocks a prefill worker holds for it."""

    outcome: Outcome
    sent: list[int] = dataclasses.field(default_factory=list)  # output tokens relayed
    # How many of the last ``sent`` tokens had no text relayed yet (a character not complete):
    # the next worker of the stream sends it.
    num_pending_text_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float = 0.0  # when the latest chunk of tokens was relayed
    # Disaggregated: the worker that prefilled the prompt (and holds its blocks), its final.
    prefilled: tuple[WorkerHandle, worker_pb2.WorkerGenerateFinal] | None = None
    # The prefill worker holding the prompt's blocks under a lease, until a decode worker has
    # taken them; released at once when the request ends before that.
    leased_on: WorkerHandle | None = None
    failed: set[str] = dataclasses.field(default_factory=set)  # workers that failed it
    busy: set[str] = dataclasses.field(default_factory=set)  # at their queue limit: not again
    left: set[str] = dataclasses.field(default_factory=set)  # decode workers gone during prefill
    retry_after_ms: int = 0  # the longest wait the busy ones asked for
    num_engine_failures: int = 0

    def excluded(self) -> set[str]:
        """The workers this request no longer goes to."""
        return self.failed | self.busy | self.left


@dataclasses.dataclass
class _Attempt:
    """One choice of workers, from ROUTE to the attempt's end."""

    route: Route
    decision: Decision  # the decode (or only) worker's, marked when it follows a failover
    resumed: RoutePlan  # what the decode worker gets as its prompt: the prompt + tokens sent
    guessed_plan: RoutePlan  # the chain the decode worker is guessed to hold soon
    guessed: bool  # whether that guess was made (not for a P/D request done at its first token)
    flight: InFlight  # the decode worker's charge
    reached: bool = False  # the decode worker got the request
    error: WorkerBusy | WorkerFailed | None = None  # what sent it to FAILOVER


class Attempts:
    """Runs one request's attempts until its final message is sent or the call ends with an
    error status (``context.abort`` raises). Not reused: one per request."""

    def __init__(
        self,
        *,
        router: Router,
        metrics: RouterMetrics,
        disagg: DisaggConfig,
        max_failovers: int,
        request: router_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        progress: Progress,
        plan: RoutePlan,
        max_tokens: int,
        wait_until_s: float,
    ) -> None:
        """``max_tokens``: the request's output budget (its context's share); ``wait_until_s``
        (``time.monotonic``): how long the first ROUTE may wait for a worker."""
        self._router = router
        self._directory: WorkerDirectory = router.directory
        self._metrics = metrics
        self._disagg = disagg
        # Prompt logprobs or an embedding: computed where the prompt is, never taken from a
        # peer (whose blocks bring no hidden states).
        self._wants_prompt = bool(request.pooling) or request.sampling.HasField("prompt_logprobs")
        self._max_failovers = max_failovers
        self._request = request
        self._context = context
        self._progress = progress
        self._outcome = progress.outcome
        self._plan = plan
        self._max_tokens = max_tokens
        self._wait_until_s = wait_until_s
        self._stop_token_ids = set(request.sampling.stop_token_ids)
        if router.tokenizer is not None:
            self._stop_token_ids.update(router.tokenizer.stop_token_ids)
        self._fleet_request_id = progress.outcome.fleet_request_id  # towards the workers
        self._log = {
            "extra": {
                "request_id": progress.outcome.request_id,
                "fleet_request_id": self._fleet_request_id,
            }
        }
        self._attempt: _Attempt | None = None
        self._states: dict[Step, Callable[[], Awaitable[Step]]] = {
            Step.ROUTE: self._route,
            Step.PREFILL: self._prefill,
            Step.STREAM: self._stream,
            Step.FAILOVER: self._failover,
        }

    async def run(self) -> None:
        """Step from ROUTE to DONE. A worker full or failed sends its attempt to FAILOVER; one
        that refuses the request ends the call. An attempt ends (``_end_attempt``) as the next
        state is ROUTE or DONE, or as the call ends any other way."""
        step = Step.ROUTE
        try:
            while step is not Step.DONE:
                try:
                    step = await self._states[step]()
                except (WorkerBusy, WorkerFailed) as e:
                    assert self._attempt is not None
                    self._attempt.error = e
                    step = Step.FAILOVER
                except Refused as e:
                    await self._refused(e)
                if step in (Step.ROUTE, Step.DONE):
                    self._end_attempt()
        finally:
            self._end_attempt()

    # -- the states ------------------------------------------------------------------------------

    async def _route(self) -> Step:
        """Choose the workers for what is left of the request and charge them: PREFILL when a
        prefill worker computes the prompt first, else STREAM; DONE when nothing is left."""
        progress, sent = self._progress, self._progress.sent
        if sent and (len(sent) >= self._max_tokens or sent[-1] in self._stop_token_ids):
            # The failed worker had sent everything but its final message.
            await self._finish(final_without_worker(self._plan, sent, self._max_tokens))
            return Step.DONE
        resumed = self._router.extend(self._plan, sent)
        route = await self._choose(resumed)
        self._metrics.index_lookup(self._router.last_lookup_s)
        decision = route.decision
        if progress.failed:
            decision = dataclasses.replace(decision, reason=f"failover: {decision.reason}")
        self._attempt = self._charge(route, decision, resumed)
        if not sent:  # what the router expects the worker that computes the prompt to hold
            prompt_decision = route.prefill_decision or decision
            num_uncached = self._router.num_uncached_tokens(resumed, prompt_decision)
            self._outcome.num_predicted_cached_tokens = len(resumed.token_ids) - num_uncached
        return Step.PREFILL if route.prefill_handle is not None else Step.STREAM

    async def _prefill(self) -> Step:
        """The prompt on the prefill worker, its first token relayed to the client, its blocks
        held there for the decode worker: STREAM. DONE when that token ends the request; ROUTE
        when the decode worker left meanwhile."""
        attempt, progress = self._current(), self._progress
        handle, decision = attempt.route.prefill_handle, attempt.route.prefill_decision
        assert handle is not None and decision is not None
        goes_on = self._max_tokens > 1  # a decode worker has output to make
        self._router.routed(attempt.resumed, decision)
        self._metrics.routed(decision.policy, "prefill", decision.worker_id)
        worker_request = worker_pb2.WorkerGenerateRequest(
            request_id=self._fleet_request_id,
            prompt_token_ids_u32le=tokens_to_bytes(attempt.resumed.token_ids),
            sampling=_remaining_sampling(self._request.sampling, 1, 0),
            lora=self._request.lora,
            cache_salt=self._request.cache_salt,
            # NOTE: with nothing to decode, no blocks are held, and the prefill worker ends the
            # text (a character cut short is U+FFFD) where it would leave it to the decode worker.
            hold_blocks_ms=round(self._disagg.lease_s * 1000) if goes_on else 0,
            priority=self._request.priority,
        )
        num_uncached = self._router.num_uncached_tokens(attempt.resumed, decision)
        flight = self._directory.begin(handle, num_uncached, 1)
        if goes_on:
            # NOTE: from now: a prefill cancelled as it ends may have left its blocks held.
            progress.leased_on = handle
        try:
            final = await self._relay_to_client(worker_request, handle, flight)
        finally:
            self._directory.finish(flight)
        progress.prefilled = handle, final
        if final.finish_reason == common_pb2.FINISH_REASON_STOP or (
            len(progress.sent) >= self._max_tokens
        ):
            # Done with its first token: nothing to decode, nothing to take.
            progress.leased_on = None
            await release_blocks(handle, self._fleet_request_id)
            num_prompt_tokens = len(self._plan.token_ids)
            await self._finish(client_final(final, decision, num_prompt_tokens, len(progress.sent)))
            return Step.DONE
        decode = attempt.route.handle
        if not self._serves(decode):
            # NOTE: it left (or stopped answering) while the prompt was prefilled; it never
            # got the request, so nothing failed: choose another.
            progress.left.add(decode.worker_id)
            logger.info(
                "decode worker %s left during the prefill; choosing another",
                decode.worker_id,
                **self._log,
            )
            return Step.ROUTE
        attempt.resumed = self._router.extend(self._plan, progress.sent)
        return Step.STREAM

    async def _stream(self) -> Step:
        """The decode (or only) worker streams the rest of the output to the client, after
        taking the blocks another worker holds for it (a prefill's, a peer's cached prefix):
        DONE."""
        attempt, progress = self._current(), self._progress
        decision, resumed = attempt.decision, attempt.resumed
        # NOTE: per decision at DEBUG: an INFO line per request costs the router ~0.3 ms.
        logger.debug(
            "routed to %s (%s: %s, %d of %d blocks matched)",
            decision.worker_id,
            decision.policy,
            decision.reason,
            decision.num_matched_blocks,
            len(resumed.block_hashes),
            **self._log,
        )
        self._metrics.routed(decision.policy, decision.reason, decision.worker_id)
        worker_request = worker_pb2.WorkerGenerateRequest(
            request_id=self._fleet_request_id,
            # NOTE: bytes, not the repeated field: one copy, not 8K varints for 8K ids.
            prompt_token_ids_u32le=tokens_to_bytes(resumed.token_ids),
            sampling=_remaining_sampling(
                self._request.sampling, self._max_tokens, len(progress.sent)
            ),
            lora=self._request.lora,
            cache_salt=self._request.cache_salt,
            num_resumed_tokens=len(progress.sent),
            num_pending_text_tokens=progress.num_pending_text_tokens,
            # The first chunk carried the embedding: a resumed stream asks for none.
            pooling=self._request.pooling if not progress.sent else "",
            priority=self._request.priority,
            stream_interval=self._request.stream_interval,
        )
        source = self._blocks_from(attempt.route)
        if source is not None:
            worker_request.kv_source.CopyFrom(source)
        attempt.reached = True
        worker_final = await self._relay_to_client(
            worker_request, attempt.route.handle, attempt.flight
        )
        progress.leased_on = None  # taken (or found here already) before it ran
        final = client_final(worker_final, decision, len(self._plan.token_ids), len(progress.sent))
        if progress.prefilled is not None:
            prefilled_stats(final.stats, progress.prefilled)
        elif progress.failed and progress.first_token_s is not None:
            # The last worker's TTFT misses the time lost on the failed ones.
            final.stats.ttft_s = progress.first_token_s - self._outcome.started_s
        await self._finish(final)
        return Step.DONE

    async def _failover(self) -> Step:
        """The attempt's worker was full or failed: leave it out and ROUTE again. Ends the call
        (UNAVAILABLE, INTERNAL) once too many workers failed it."""
        attempt, progress = self._current(), self._progress
        e = attempt.error
        if isinstance(e, WorkerBusy):
            self._take_back_guess(attempt, e.handle)
            e.handle.full = True
            progress.busy.add(e.handle.worker_id)
            progress.retry_after_ms = max(progress.retry_after_ms, e.retry_after_ms)
            logger.debug("%s; trying another", e, **self._log)
            return Step.ROUTE
        assert isinstance(e, WorkerFailed)
        progress.failed.add(e.handle.worker_id)
        self._directory.mark_down(e.handle)
        self._router.pending.forget_worker(e.handle.worker_id)
        progress.num_engine_failures += e.engine_failed
        if progress.num_engine_failures >= MAX_ENGINE_FAILURES:
            await abort(
                self._context,
                self._outcome,
                grpc.StatusCode.INTERNAL,
                f"the request failed the engines of {progress.num_engine_failures} workers; "
                f"not retried further; last: {e}",
            )
        if len(progress.failed) > self._max_failovers:
            await abort(
                self._context,
                self._outcome,
                grpc.StatusCode.UNAVAILABLE,
                f"{len(progress.failed)} workers failed the request; last: {e}",
            )
        sent = progress.sent
        self._metrics.failed_over("mid_stream" if sent else "before_first_token")
        logger.warning(
            "%s; %s on another worker",
            e,
            f"resuming after {len(sent)} tokens" if sent else "retrying",
            **self._log,
        )
        return Step.ROUTE

    # -- the parts -------------------------------------------------------------------------------

    async def _choose(self, resumed: RoutePlan) -> Route:
        """The route for ``resumed``, or the call ends: INVALID_ARGUMENT for bad routing
        overrides, RESOURCE_EXHAUSTED when every worker is full, UNAVAILABLE when none serves."""
        progress, request = self._progress, self._request

        async def choose() -> Route:
            return await self._router.route(
                resumed,
                policy=request.routing.policy,
                weights=dict(request.routing.weights),
                exclude=progress.excluded(),
                # NOTE: only a prompt not prefilled yet is: a resumed stream goes to one worker.
                # Prompt logprobs and embeddings are computed where the prompt is.
                disagg=self._disagg if not progress.sent and not self._wants_prompt else None,
            )

        try:
            # NOTE: only the first choice waits: a failover has the others to go to now.
            return await when_a_worker_serves(
                self._directory,
                choose,
                self._wait_until_s if not progress.excluded() else 0.0,
            )
        except ValueError as e:  # the request's routing overrides
            field = "routing.weights" if request.routing.weights else "routing.policy"
            await abort(
                self._context, self._outcome, grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}"
            )
        except UnknownAdapterError as e:
            await abort(self._context, self._outcome, grpc.StatusCode.NOT_FOUND, str(e))
        except FleetFullError as e:
            await overloaded(self._context, self._outcome, str(e), _FLEET_FULL_RETRY_AFTER_MS)
        except NoWorkerError as e:
            if progress.busy:
                busy = ", ".join(sorted(progress.busy))
                why = f"every worker that could take the request ({busy}) is at its queue limit"
                await overloaded(self._context, self._outcome, why, progress.retry_after_ms)
            await abort(self._context, self._outcome, grpc.StatusCode.UNAVAILABLE, str(e))
        raise AssertionError("abort returns only by raising")

    def _charge(self, route: Route, decision: Decision, resumed: RoutePlan) -> _Attempt:
        """Count the request on its decode (or only) worker as it is chosen: in flight, and a
        guess of the blocks it will hold."""
        progress, plan = self._progress, self._plan
        # NOTE: the decode worker is charged (in flight, its guess) as it is chosen, also
        # while another worker prefills the prompt for it: charged only once the prefill
        # was done, it looked idle to a whole burst routed meanwhile, which piled onto it.
        # The first token, when a prefill worker samples it before the decode worker runs.
        num_first = 1 if route.prefill_handle is not None else 0
        prefilled = progress.prefilled
        if num_first or (prefilled is not None and prefilled[0].worker_id not in progress.failed):
            # The decode worker computes only what it neither holds nor can take: the tail
            # past the prompt's full blocks (and, after a prefill, its first token).
            num_tail = len(resumed.token_ids) + num_first
            num_uncached = max(num_tail - len(plan.block_hashes) * plan.block_size, 1)
        else:
            num_uncached = self._router.num_uncached_tokens(resumed, decision)
        # NOTE: what this worker's context leaves, which may be less than the fleet's.
        num_output_left = output_charge(
            self._max_tokens - len(progress.sent) - num_first,
            len(resumed.token_ids) + num_first,
            route.handle.info.max_model_len,
        )
        flight = self._directory.begin(route.handle, num_uncached, num_output_left)
        # Not for a P/D request done at its first token: no decode worker will hold anything.
        guessed = self._max_tokens > 1 or not num_first
        if guessed:
            self._router.routed(resumed, decision)
        return _Attempt(route, decision, resumed, resumed, guessed, flight)

    def _blocks_from(self, route: Route) -> worker_pb2.KVSource | None:
        """Where the decode worker takes blocks from before it computes: the prefill worker's
        lease (the P/D handoff), a peer's cached prefix, or nowhere."""
        prefilled = self._progress.prefilled
        if prefilled is not None and prefilled[0].worker_id not in self._progress.failed:
            return kv_source(prefilled[0], self._fleet_request_id, self._disagg)
        if route.fetch_handle is not None and not self._wants_prompt:
            # Peer block fetch: the prefix from the worker that holds it, not computed.
            source = kv_source(route.fetch_handle, "", self._disagg)
            source.on_failure = "recompute"
            return source
        return None

    async def _relay_to_client(
        self,
        worker_request: worker_pb2.WorkerGenerateRequest,
        handle: WorkerHandle,
        flight: InFlight,
    ) -> worker_pb2.WorkerGenerateFinal:
        """Relay a worker's chunks to the client as they come; the worker's final message."""
        progress, context = self._progress, self._context
        sent_s = time.monotonic()
        responses = relay(worker_request, handle, flight, self._directory, context.time_remaining())
        async with contextlib.aclosing(responses):
            async for response in responses:
                if not response.HasField("chunk"):
                    return response.final
                if progress.first_token_s is None and response.chunk.token_ids:
                    progress.first_token_s = progress.last_token_s = time.monotonic()
                    progress.outcome.ttft_s = progress.first_token_s - progress.outcome.started_s
                    progress.outcome.queue_s = sent_s - progress.outcome.started_s
                    await context.send_initial_metadata(((WORKER_ID_KEY, handle.worker_id),))
                else:
                    self._count_inter_token(len(response.chunk.token_ids))
                    if response.chunk.HasField("num_cached_tokens"):
                        # NOTE: a stream resumed on another worker: the client's first chunk,
                        # from the first worker, already said how much of its prompt was cached.
                        response.chunk.ClearField("num_cached_tokens")
                progress.sent += response.chunk.token_ids
                progress.num_pending_text_tokens = response.chunk.num_pending_text_tokens
                await context.write(router_pb2.GenerateResponse(chunk=response.chunk))
        raise WorkerFailed(handle, "the stream ended without a final message")

    def _count_inter_token(self, num_tokens: int) -> None:
        """A chunk after the first token: the time since the previous one, per token of it."""
        if num_tokens:
            now_s = time.monotonic()
            self._metrics.inter_token((now_s - self._progress.last_token_s) / num_tokens)
            self._progress.last_token_s = now_s

    async def _refused(self, e: Refused) -> None:
        """The worker judged the request: the client hears its verdict (the call ends)."""
        # NOTE: refused, the request leaves no guess there (nor on the decode worker it never
        # reached: ``_end_attempt``), and no charge: all given back before the client hears the
        # verdict, so that nothing it sends next is routed around what is already gone.
        self._take_back_guess(self._current(), e.handle)
        self._end_attempt()
        await abort(self._context, self._outcome, e.code, e.details)

    def _take_back_guess(self, attempt: _Attempt, handle: WorkerHandle) -> None:
        """``handle`` turned the request away: its guess goes (a decode worker's, if it was
        reached; one never reached loses its guess as the attempt ends)."""
        if handle is attempt.route.prefill_handle:
            self._router.withdrawn(self._plan, attempt.route.prefill_decision)
        elif attempt.reached:
            self._router.withdrawn(attempt.guessed_plan, attempt.decision)

    def _end_attempt(self) -> None:
        """Give back what the attempt charged and its worker never took; once an attempt."""
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            return
        self._directory.finish(attempt.flight)
        if attempt.guessed and not attempt.reached:
            self._router.withdrawn(attempt.guessed_plan, attempt.decision)

    async def _finish(self, final: router_pb2.GenerateFinal) -> None:
        self._outcome.finished(final)
        await self._context.write(router_pb2.GenerateResponse(final=final))

    def _current(self) -> _Attempt:
        assert self._attempt is not None, "a state past ROUTE runs within an attempt"
        return self._attempt

    def _serves(self, handle: WorkerHandle) -> bool:
        """Whether a request may still go to ``handle``: live, registered, not failing lately."""
        return any(h is handle for h in self._directory.routable(roles=(handle.info.role,)))


async def when_a_worker_serves(
    directory: WorkerDirectory, attempt: Callable[[], Awaitable[T]], wait_until_s: float
) -> T:
    """``await attempt()``, again whenever the workers change while it raises ``NoWorkerError``,
    until ``wait_until_s`` (``time.monotonic``); then the error stands."""
    while True:
        try:
            return await attempt()
        except NoWorkerError:
            left_s = wait_until_s - time.monotonic()
            if left_s <= 0:
                raise
            await directory.wait_for_change(min(left_s, _RECHECK_S))


def _remaining_sampling(
    sampling: common_pb2.SamplingParams, max_tokens: int, num_sent: int
) -> common_pb2.SamplingParams:
    remaining = common_pb2.SamplingParams()
    remaining.CopyFrom(sampling)
    remaining.max_tokens = max_tokens - num_sent
    if num_sent:  # the first chunk carried them
        remaining.ClearField("prompt_logprobs")
    return remaining
