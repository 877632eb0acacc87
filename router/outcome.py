"""How a request ends: the client's final message, or an error status, and the one metrics record
of either.

The final message is the last worker's, counted as the client sees the request: a resumed worker
saw the tokens already sent as prompt, and a disaggregated request's prompt figures are its prefill
worker's.
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from kvswitch.router.metrics import RouterMetrics
from kvswitch.router.policy import Decision
from kvswitch.router.router import RoutePlan
from kvswitch.router.worker_call import CLIENT_ERRORS
from kvswitch.router.workers import WorkerHandle
from kvswitch.serving import RETRY_AFTER_KEY
from kvswitch.v1 import common_pb2, router_pb2, worker_pb2

_FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_FINISH_REASON_BY_CODE = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "abort",
    **{code: "rejected" for code in CLIENT_ERRORS},
    grpc.StatusCode.ABORTED: "error",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
}


@dataclasses.dataclass
class Outcome:
    """How a request ended, for the metrics."""

    request_id: str  # the client's (a label), or the fleet id where it named none
    metrics: RouterMetrics
    fleet_request_id: str = ""  # what the workers know it by
    finish_reason: str = "error"
    started_s: float = dataclasses.field(default_factory=time.monotonic)  # arrival
    ttft_s: float | None = None  # as the router saw it: arrival to first token relayed
    # Arrival to the sending to the worker that made the first token; set with ``ttft_s``.
    queue_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # What the routing decision expected the worker that computes the prompt to hold.
    num_predicted_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_transferred_blocks: int = 0

    recorded: bool = False

    def finished(self, final: router_pb2.GenerateFinal) -> None:
        self.finish_reason = _FINISH_REASON_NAMES.get(final.finish_reason, "error")
        self.num_prompt_tokens = final.stats.num_prompt_tokens
        self.num_cached_tokens = final.stats.num_cached_tokens
        self.num_output_tokens = final.stats.num_output_tokens
        self.num_transferred_blocks = final.stats.num_transferred_blocks
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
        if self.ttft_s is not None:
            e2e_s = time.monotonic() - self.started_s
            self.metrics.served(e2e_s, self.queue_s, self.num_predicted_cached_tokens)
        if self.num_transferred_blocks:
            self.metrics.kv_transferred(self.num_transferred_blocks)


async def abort(
    context: grpc.aio.ServicerContext, outcome: Outcome, code: grpc.StatusCode, details: str
) -> None:
    """End the call with ``code`` (raises, as ``context.abort`` does), counted first."""
    outcome.finish_reason = _FINISH_REASON_BY_CODE.get(code, "error")
    outcome.record()
    if outcome.fleet_request_id:
        # NOTE: a worker's words name the request by the fleet's id; the client knows its own.
        details = details.replace(outcome.fleet_request_id, outcome.request_id)
    await context.abort(code, details)


async def overloaded(
    context: grpc.aio.ServicerContext, outcome: Outcome, why: str, retry_after_ms: int
) -> None:
    """End the request with RESOURCE_EXHAUSTED: every worker that could take it is full."""
    # NOTE: never 0: a RESOURCE_EXHAUSTED without a wait is a limit, which clients never
    # retry (client/retry.py).
    retry_after_ms = max(retry_after_ms, 1)
    outcome.metrics.overloaded("workers_full")
    context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after_ms)),))
    await abort(
        context,
        outcome,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{why}; retry in {retry_after_ms} ms",
    )


def client_final(
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


def prefilled_stats(
    stats: common_pb2.RequestStats,
    prefilled: tuple[WorkerHandle, worker_pb2.WorkerGenerateFinal],
) -> None:
    """A disaggregated request's stats: the prompt's figures are the prefill worker's."""
    handle, prefill_final = prefilled
    stats.prefill_worker_id = handle.worker_id
    stats.ttft_s = prefill_final.stats.ttft_s
    stats.num_cached_tokens = min(prefill_final.stats.num_cached_tokens, stats.num_prompt_tokens)


def final_without_worker(
    plan: RoutePlan, sent: list[int], max_tokens: int
) -> router_pb2.GenerateFinal:
    """The final message of a request whose failed worker had sent every token but that."""
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
