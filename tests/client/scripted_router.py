"""A scripted ``kvswitch.v1.Router`` on a real grpc.aio server, on its own event-loop thread.

Each test sets ``router.script`` (what every call answers) and reads ``router.calls`` (what each
call received: the request, its metadata, its deadline, and whether it was cancelled).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc

from kvswitch.cache_index.local_redis import free_port
from kvswitch.client import Chunk, FinishReason, GenerateResult, RouteInfo, Stats
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc

CHUNKS = [
    common_pb2.TokenChunk(token_ids=[72, 101], text="He"),
    common_pb2.TokenChunk(token_ids=[108], text="l"),
    common_pb2.TokenChunk(token_ids=[108, 111], text="lo"),
]
FINAL = router_pb2.GenerateFinal(
    finish_reason=common_pb2.FINISH_REASON_LENGTH,
    stats=common_pb2.RequestStats(
        worker_id="worker-b",
        num_prompt_tokens=36,
        num_cached_tokens=32,
        ttft_s=0.25,
        num_output_tokens=5,
    ),
    route=router_pb2.RouteDecision(
        worker_id="worker-b",
        policy="prefix",
        reason="longest prefix match",
        num_matched_blocks=2,
        score=0.75,
    ),
)

# What the client makes of the default script, for request id "req-1".
EXPECTED = GenerateResult(
    request_id="req-1",
    token_ids=[72, 101, 108, 108, 111],
    text="Hello",
    finish_reason=FinishReason.LENGTH,
    stats=Stats(
        worker_id="worker-b",
        num_prompt_tokens=36,
        num_cached_tokens=32,
        ttft_s=0.25,
        num_output_tokens=5,
        route_reason="longest prefix match",
        # The script's router says nothing of prefill: one worker served it all.
        prefill_worker_id="worker-b",
        decode_worker_id="worker-b",
    ),
    route=RouteInfo(
        worker_id="worker-b",
        policy="prefix",
        reason="longest prefix match",
        num_matched_blocks=2,
        score=0.75,
    ),
)
EXPECTED_CHUNKS = [Chunk([72, 101], "He"), Chunk([108], "l"), Chunk([108, 111], "lo")]


@dataclasses.dataclass
class Script:
    """What every call answers: ``chunks`` then ``final`` (None = end without one), unless
    told to fail or to hang first."""

    chunks: list[common_pb2.TokenChunk] = dataclasses.field(default_factory=lambda: CHUNKS)
    final: router_pb2.GenerateFinal | None = dataclasses.field(default_factory=lambda: FINAL)
    num_failures: int = 0  # the first calls fail with failure_code before sending anything
    failure_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    failure_retry_after_ms: int | None = None  # a failure's retry-after-ms trailer, if any
    fail_after_chunks: int | None = None  # every call fails after sending this many chunks
    hang_after_chunks: int | None = None  # every call waits (until cancelled) after this many


@dataclasses.dataclass
class ReceivedCall:
    """What one call brought to the router."""

    request: router_pb2.GenerateRequest
    metadata: dict[str, str]
    time_remaining_s: float | None
    cancelled: threading.Event  # set when the client cancels the call


class ScriptedRouter(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.address = ""  # "127.0.0.1:<port>", once served
        self.script = Script()
        self.calls: list[ReceivedCall] = []

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        call = ReceivedCall(
            request=request,
            metadata={m.key: m.value for m in context.invocation_metadata() or ()},
            time_remaining_s=context.time_remaining(),
            cancelled=threading.Event(),
        )
        self.calls.append(call)
        num_calls = len(self.calls)
        script = self.script
        if num_calls <= script.num_failures:
            if script.failure_retry_after_ms is not None:
                context.set_trailing_metadata(
                    (("retry-after-ms", str(script.failure_retry_after_ms)),)
                )
            await context.abort(script.failure_code, f"scripted failure {num_calls}")
        # NOTE: a client's cancel reaches a grpc.aio handler as CancelledError at its own await
        # (context.cancelled() does not report it), or, where it came while grpc was sending a
        # chunk yielded, as GeneratorExit at that yield once grpc drops the handler.
        try:
            for num_sent, chunk in enumerate(script.chunks):
                if num_sent == script.fail_after_chunks:
                    await context.abort(script.failure_code, f"failed after {num_sent} chunks")
                if num_sent == script.hang_after_chunks:
                    await asyncio.sleep(60)
                yield router_pb2.GenerateResponse(chunk=chunk)
            if script.final is not None:
                yield router_pb2.GenerateResponse(final=script.final)
        except (asyncio.CancelledError, GeneratorExit):
            call.cancelled.set()
            raise


class BackgroundRouter:
    """A ``ScriptedRouter`` served on 127.0.0.1 (TLS when given server credentials)."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = ScriptedRouter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server = self._run(self._start(credentials))

    async def _start(self, credentials: grpc.ServerCredentials | None) -> grpc.aio.Server:
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, server)
        if credentials is None:
            self.port = server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        self.servicer.address = f"127.0.0.1:{self.port}"
        return server

    def reset(self) -> ScriptedRouter:
        self.servicer.script = Script()
        self.servicer.calls = []
        return self.servicer

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def close(self) -> None:
        self._run(self._server.stop(grace=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def free_address() -> str:
    """A 127.0.0.1 address where nothing listens (its port was free a moment ago)."""
    return f"127.0.0.1:{free_port()}"
