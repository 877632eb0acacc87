"""Requests the HTTP front routes to OpenAI-API engines: forwarded as they came, answered as the
engine answers.

The front has the request's token ids (``--model``'s tokenizer and chat template, as the engine
will tokenize it) and its plan; ``EngineForwarder.forward`` routes it among the workers and the
engines (``Router.route(..., engines=True)``)::

    a worker wins   -> None: the front sends it the gRPC way (the router routes it again, among
                       its workers only)
    an engine wins  -> POST the body to the engine's same path, unchanged but for kvswitch's
                       ``routing`` options (the router's to use, not the engine's)
        cannot connect (refused, unreachable)  -> the engine is marked down, the next is tried
        an error status                        -> passed through, with its body
        200, whole                             -> its body
        200, a stream                          -> its server-sent events as they arrive

The answer names the engine (``x-kvswitch-worker``) and why (``x-kvswitch-route-reason``). The
engine's ``usage`` is read on the way through: its ``prompt_tokens`` against the router's count,
its ``prompt_tokens_details.cached_tokens`` against the router's predicted hit (``EngineMetrics``),
so that a tokenizer or template that differs from the engine's shows.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.background import BackgroundTask

from kvswitch.router.engine_http import (
    EngineConnectError,
    EngineConnectionLost,
    EngineHTTP,
    EngineResponse,
)
from kvswitch.router.limits import RequestLimits
from kvswitch.router.openai_protocol import OpenAIError
from kvswitch.router.openai_stream import until_disconnected
from kvswitch.router.router import NoWorkerError, Route, RoutePlan, Router
from kvswitch.router.workers import InFlight
from kvswitch.security import PLAINTEXT, FleetSecurity

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# What the router passes on of a client's request headers (its key, if any, is the router's).
_PASSED_HEADERS = ("content-type", "accept")


def _without_routing(body: bytes) -> bytes:
    """``body`` without kvswitch's ``routing`` options: the router's, not the engine's (a
    kvswitch worker refuses them; vLLM would warn of a field it does not know)."""
    if b'"routing"' not in body:
        return body
    fields = json.loads(body)
    if not isinstance(fields, dict) or fields.pop("routing", None) is None:
        return body
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()


class EngineMetrics:
    """The router's view of its engines' answers (``kvswitch_router_engine_*``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvswitch_router_engine_requests",
            "Requests forwarded to an OpenAI-API engine, by engine and HTTP status",
            ["engine", "status"],
            registry=registry,
        )
        self.predicted_cached_tokens = Counter(
            "kvswitch_router_engine_predicted_cached_tokens",
            "Prompt tokens the router predicted cached on the engine it chose, of answers that "
            "report their cached tokens",
            ["engine"],
            registry=registry,
        )
        self.cached_tokens = Counter(
            "kvswitch_router_engine_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["engine"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvswitch_router_engine_prompt_tokens",
            "Prompt tokens of the answers that report them, as the router counted them and as "
            "the engine did (counted_by): apart, the router tokenizes otherwise than the engine",
            ["engine", "counted_by"],
            registry=registry,
        )
        self.prompt_mismatches = Counter(
            "kvswitch_router_engine_prompt_token_mismatches",
            "Answers whose prompt_tokens differ from the router's count of the prompt",
            ["engine"],
            registry=registry,
        )

        # Engine id -> its children of the counters above (``labels`` costs a lock and a lookup).
        self._engines: dict[str, _EngineCounters] = {}

    def usage(self, engine: str, plan: RoutePlan, predicted: int, usage: dict[str, Any]) -> None:
        counters = self._engines.get(engine)
        if counters is None:
            counters = self._engines[engine] = _EngineCounters(
                self.prompt_tokens.labels(engine, "router"),
                self.prompt_tokens.labels(engine, "engine"),
                self.prompt_mismatches.labels(engine),
                self.predicted_cached_tokens.labels(engine),
                self.cached_tokens.labels(engine),
            )
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int):
            counters.router_prompt_tokens.inc(len(plan.token_ids))
            counters.engine_prompt_tokens.inc(prompt_tokens)
            if prompt_tokens != len(plan.token_ids):
                counters.prompt_mismatches.inc()
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            counters.predicted_cached_tokens.inc(predicted)
            counters.cached_tokens.inc(cached)


@dataclass(frozen=True, slots=True)
class _EngineCounters:
    """One engine's children of ``EngineMetrics``' usage counters."""

    router_prompt_tokens: Counter
    engine_prompt_tokens: Counter
    prompt_mismatches: Counter
    predicted_cached_tokens: Counter
    cached_tokens: Counter


@dataclass
class _Forward:
    """One request on its way to an engine, and what it counts against the engine."""

    plan: RoutePlan
    route: Route
    flight: InFlight
    predicted: int  # prompt tokens the router predicted cached there


class EngineForwarder:
    """Sends the front's requests to engines over keep-alive connections (``close`` them)."""

    def __init__(
        self,
        router: Router,
        metrics: EngineMetrics,
        limits: RequestLimits,
        *,
        max_failovers: int,
        wait_for_worker_s: float,
        security: FleetSecurity = PLAINTEXT,
        api_key: str = "",
        follows_engines: bool = False,
    ) -> None:
        self._follows_engines = follows_engines
        self.limits = limits  # what the front holds a request to, as the servicer would
        self._wait_for_worker_s = wait_for_worker_s  # a request finding none waits this long
        self._router = router
        self._metrics = metrics
        self._max_failovers = max_failovers
        # NOTE: no read timeout: a long prompt's first token, or a long answer, takes its time;
        # a client that gives up cancels the forward, and that closes the engine's connection.
        self._client = EngineHTTP(security, api_key, connect_timeout_s=CONNECT_TIMEOUT_S)

    async def close(self) -> None:
        await self._client.close()

    def has_engines(self) -> bool:
        """Whether the fleet has engines: this router follows some (it waits for them as for
        workers), or another router sharing the index registered some there. Without any, a
        request goes the gRPC way."""
        return self._follows_engines or any(h.is_engine for h in self._router.directory.handles())

    async def forward(
        self,
        request: Request,
        token_ids: Sequence[int],
        body: bytes,
        *,
        lora: str | None,
        cache_salt: str | None,
        num_output_tokens: int,
        stream: bool,
        policy: str = "",
        weights: Mapping[str, float] | None = None,
    ) -> Response | None:
        """The engine's answer to ``request`` (its ``body`` as read, its prompt ``token_ids``),
        where the router sends it to an engine; None where it sends it to a worker.
        ``NoWorkerError`` and ``FleetFullError`` as ``Router.route`` raises them, ValueError
        for a prompt the router refuses."""
        router = self._router
        directory = router.directory
        body = _without_routing(body)
        exclude: set[str] = set()
        deadline_s = time.monotonic() + self._wait_for_worker_s
        while True:
            try:
                plan = router.plan(token_ids=token_ids, lora=lora, cache_salt=cache_salt)
                route = await router.route(
                    plan, policy=policy, weights=weights, exclude=exclude, engines=True
                )
            except NoWorkerError:
                # NOTE: as the servicer does: none yet (the router just started, an engine
                # restarts), or every one tried; waits for one to join or come back.
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise
                await until_disconnected(request, directory.wait_for_change(min(left_s, 0.1)))
                continue
            handle = route.handle
            if not handle.is_engine:
                return None
            decision = route.decision
            router.routed(plan, decision)
            predicted = min(decision.num_matched_blocks * plan.block_size, len(plan.token_ids))
            flight = directory.begin(
                handle, router.num_uncached_tokens(plan, decision), num_output_tokens
            )
            forward = _Forward(plan, route, flight, predicted)
            headers = {k: v for k, v in request.headers.items() if k in _PASSED_HEADERS}
            path = request.scope["path"]  # NOTE: not request.url, a URL built for one field
            try:
                response, content = await until_disconnected(
                    request, self._exchange(handle.info.address, path, body, headers, stream)
                )
            except EngineConnectError as e:
                # NOTE: nothing reached the engine: the request can go to another at no cost.
                self._withdraw(forward)
                directory.mark_down(handle)
                exclude.add(handle.worker_id)
                logger.warning(
                    "engine %s cannot be reached (%s): trying another", handle.worker_id, e
                )
                if len(exclude) > self._max_failovers:
                    raise OpenAIError(
                        502,
                        f"no engine could be reached: {', '.join(sorted(exclude))} tried",
                        code="bad_gateway",
                    ) from None
                continue
            except EngineConnectionLost as e:
                self._withdraw(forward)
                raise OpenAIError(
                    502, f"engine {handle.worker_id}: {e}", code="bad_gateway"
                ) from None
            except BaseException:
                self._withdraw(forward)
                raise
            return self._answer(forward, response, content)

    async def _exchange(
        self, address: str, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[EngineResponse, bytes | None]:
        """The engine's answer; its body too, unless it is a stream to relay."""
        response = await self._client.post(address, path, body, headers)
        if stream and response.status == 200:
            return response, None
        try:
            return response, await response.read()
        finally:
            response.close()

    def _answer(
        self, forward: _Forward, response: EngineResponse, content: bytes | None
    ) -> Response:
        """The client's answer: the engine's ``content`` where it was read whole, else its
        stream relayed."""
        engine = forward.flight.handle.worker_id
        self._metrics.requests.labels(engine, str(response.status)).inc()
        headers = {
            "x-kvswitch-worker": engine,
            "x-kvswitch-route-reason": forward.route.decision.reason,
        }
        media_type = response.headers.get("content-type")
        if content is not None:
            if response.status != 200:
                self._withdraw(forward)
                return Response(content, response.status, headers, media_type=media_type)
            self._router.directory.finish(forward.flight)
            self._read_usage(forward, content)
            return Response(content, 200, headers=headers, media_type=media_type)
        headers["cache-control"] = "no-cache"

        async def close() -> None:  # a stream whose client left before it began
            response.close()
            self._router.directory.finish(forward.flight)

        return StreamingResponse(
            self._relay(forward, response),
            200,
            headers=headers,
            media_type=media_type or "text/event-stream",
            background=BackgroundTask(close),
        )

    async def _relay(self, forward: _Forward, response: EngineResponse) -> AsyncIterator[bytes]:
        """The engine's events as they come, their usage read on the way, and what they say of
        the request's progress counted against the engine's load as a worker's stream is: the
        prompt off its queue at the first event, an output token off it at each later one."""
        directory = self._router.directory
        flight = forward.flight
        pending = b""
        try:
            async for chunk in response.chunks():
                yield chunk
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: {"):
                        continue
                    if not flight.prefilled:
                        directory.first_token(flight)
                    else:
                        directory.produced(flight, 1)
                    if b'"prompt_tokens"' in line:
                        self._read_usage(forward, line[len(b"data: ") :])
        finally:
            response.close()
            self._router.directory.finish(forward.flight)

    def _read_usage(self, forward: _Forward, content: bytes) -> None:
        try:
            usage = json.loads(content).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            engine = forward.flight.handle.worker_id
            self._metrics.usage(engine, forward.plan, forward.predicted, usage)

    def _withdraw(self, forward: _Forward) -> None:
        self._router.directory.finish(forward.flight)
        self._router.withdrawn(forward.plan, forward.route.decision)
