"""A worker's own OpenAI-compatible HTTP API (``kvswitch worker --http-port``), as a vLLM server
serves one: ``/v1/completions`` (text or token-id prompts), ``/v1/chat/completions``,
``/v1/models``, plus ``/health`` and ``/metrics`` (the worker's gauges, vLLM's among them).

It needs no index and no router: the router's front (``router/openai_http.py``) serves it, its
calls made to this worker's own ``Worker.Generate`` on loopback through ``WorkerAsRouter``, which
takes a ``Router.Generate`` request and answers as a router would, the route naming this worker.
It lives here, above both, since the worker imports nothing of the router: ``kvswitch worker``
hands ``start_worker_http`` to the worker's server, which calls it once it serves.
With the worker's ``--kv-events-config`` it can then stand in for a vLLM server behind any router
that reads vLLM's events, kvswitch's engine mode among them (docs/ENGINES.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvswitch.cache_index.hashing import tokens_to_bytes
from kvswitch.router.forwarded import new_front_key
from kvswitch.router.http_server import HttpFront, loopback_target, serve_http
from kvswitch.router.limits import DEFAULT_MAX_BODY_BYTES
from kvswitch.router.openai_http import FrontConfig, OpenAIFront
from kvswitch.router.openai_protocol import OpenAIError
from kvswitch.router.router import NoTokenizerError
from kvswitch.router.servicer import WORKER_ID_KEY
from kvswitch.tokenizer import Tokenizer
from kvswitch.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.server import WorkerServer
from kvswitch.worker.worker_config import MAX_REQUEST_BYTES, WorkerConfig

ROUTE_REASON = "served here: a worker's own HTTP API"


class WorkerModels:
    """The one model a worker serves, under its name in the index."""

    def __init__(
        self, name: str, tokenizer: Tokenizer | None, loras: Callable[[], Sequence[str]] = tuple
    ) -> None:
        self._name = name
        self.tokenizer = tokenizer
        self._loras = loras  # the LoRA adapters the worker serves now

    def tokenize(self, text: str) -> np.ndarray:
        if self.tokenizer is None:
            raise NoTokenizerError(
                "this worker's model has no tokenizer: send the prompt as token ids"
            )
        return self.tokenizer.encode_array(text)

    def names(self) -> list[str]:
        return [self._name]

    def adapters(self) -> dict[str, str]:
        return {lora: self._name for lora in self._loras()}

    async def wait_for_change(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)  # a worker's model never changes


class WorkerAsRouter:
    """A ``RouterStub`` whose ``Generate`` runs the request on one worker (``stub``): the
    prompt tokenized here, the answer in the router's messages."""

    def __init__(
        self, stub: worker_pb2_grpc.WorkerStub, worker_id: str, models: WorkerModels
    ) -> None:
        self._stub = stub
        self._worker_id = worker_id
        self._models = models

    def Generate(
        self, call: router_pb2.GenerateRequest, *, metadata: Sequence[tuple[str, str]] = ()
    ) -> WorkerCall:
        # NOTE: only the worker's token goes on: the rest names a router's front.
        authorization = tuple((k, v) for k, v in metadata if k == "authorization")
        return WorkerCall(self, call, authorization)

    async def _start(
        self, call: router_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...]
    ) -> grpc.aio.UnaryStreamCall:
        if call.HasField("routing"):
            raise OpenAIError(
                400, "a worker serves each request itself: routing is a router's", param="routing"
            )
        if call.WhichOneof("prompt") == "text":
            text = call.text
            try:
                tokenizer = self._models.tokenizer
                if tokenizer is None or len(text) <= tokenizer.inline_chars:
                    ids = self._models.tokenize(text)
                else:
                    ids = await asyncio.to_thread(self._models.tokenize, text)
            except NoTokenizerError as e:
                raise OpenAIError(400, str(e), param="prompt") from None
            prompt = tokens_to_bytes(ids)
        else:
            prompt = call.token_ids.ids_u32le
        request = worker_pb2.WorkerGenerateRequest(
            request_id=call.request_id,
            prompt_token_ids_u32le=prompt,
            sampling=call.sampling,
            lora=call.lora,
            cache_salt=call.cache_salt,
            pooling=call.pooling,
        )
        return self._stub.Generate(request, metadata=metadata)

    def _final(self, final: worker_pb2.WorkerGenerateFinal) -> router_pb2.GenerateResponse:
        route = router_pb2.RouteDecision(worker_id=self._worker_id, reason=ROUTE_REASON)
        return router_pb2.GenerateResponse(
            final=router_pb2.GenerateFinal(
                finish_reason=final.finish_reason, stats=final.stats, route=route
            )
        )


class WorkerCall:
    """One request on the worker, read as a ``Router.Generate`` stream (``read``, ``cancel``,
    ``initial_metadata``): started at the first ``read``."""

    def __init__(
        self,
        owner: WorkerAsRouter,
        call: router_pb2.GenerateRequest,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self._owner = owner
        self._call = call
        self._metadata = metadata
        self._rpc: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False

    async def read(self) -> Any:
        if self._rpc is None:
            if self._cancelled:
                raise asyncio.CancelledError
            self._rpc = await self._owner._start(self._call, self._metadata)
        message = await self._rpc.read()
        if message is grpc.aio.EOF:
            return message
        if message.HasField("final"):
            return self._owner._final(message.final)
        return router_pb2.GenerateResponse(chunk=message.chunk)

    def cancel(self) -> bool:
        self._cancelled = True
        return self._rpc.cancel() if self._rpc is not None else False

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((WORKER_ID_KEY, self._owner._worker_id),)


async def start_worker_http(
    config: WorkerConfig, worker: WorkerServer, tokenizer: Tokenizer | None
) -> HttpFront:
    """Serve ``worker``'s OpenAI API on ``config.host``:``config.http_port``; OSError if the
    port cannot be bound."""
    front = FrontConfig(
        host=config.host,
        http_port=config.http_port,
        model=config.model,
        token=config.fleet_token,
        max_message_bytes=MAX_REQUEST_BYTES,
        max_body_bytes=DEFAULT_MAX_BODY_BYTES,
        max_output_tokens=0,  # the worker cuts an answer at its context
        wait_for_worker_s=0.0,
        security=config.security(),
        keys=config.http_keys(),
    )
    channel = front.security.channel(loopback_target(worker.address))
    models = WorkerModels(worker.engine.namespace, tokenizer, lambda: worker.engine.load.loras)
    stub = WorkerAsRouter(worker_pb2_grpc.WorkerStub(channel), worker.worker_id, models)
    api = OpenAIFront(front, models, stub, new_front_key())  # type: ignore[arg-type]
    registry = worker.metrics.registry

    async def health(request: Request) -> Response:
        died = worker.engine_died
        if died.done():
            return JSONResponse({"error": died.result()}, status_code=503)
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        body = await asyncio.to_thread(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    api.app.add_api_route("/health", health, methods=["GET"])
    api.app.add_api_route("/metrics", metrics, methods=["GET"])
    return await serve_http(api, front, channel)
