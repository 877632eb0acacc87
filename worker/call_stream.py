"""A worker's side of ``GenerateStream``: a router's Generate calls, many over one stream.

Each call runs as a Generate call would (the servicer's own ``Generate``, a task a call) with a
``StreamedContext`` in place of gRPC's: what it writes goes into one outbox, and a single writer
sends everything in the outbox as one message whenever the stream takes another. A decode step
ends many calls' waits at once; their chunks leave together, one gRPC message for all of them
instead of one each (docs/BENCHMARKS.md, "Relaying streamed tokens").

A call ends with its status (OK, or what it aborted with, with its trailing metadata); one the
router cancels ends without one. The router's half-close lets running calls finish; the stream
cancelled (the router gone) cancels every call, which aborts their engine requests.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc

from kvswitch.chunks import join, merges
from kvswitch.serving import cancel_and_wait
from kvswitch.v1 import worker_pb2

logger = logging.getLogger(__name__)

# Messages waiting in a stream's outbox past which its calls' writes wait for the writer.
QUEUED_MESSAGES = 4096
# The most bytes of messages one message of the stream carries (a router's channel reads 4 MiB).
MAX_MESSAGE_BYTES = 1 << 20

Generate = Callable[[worker_pb2.WorkerGenerateRequest, "StreamedContext"], Awaitable[None]]


class StreamedContext:
    """The part of ``grpc.aio.ServicerContext`` a worker's Generate uses, for one call on a
    stream: ``write`` puts the message in the stream's outbox (it does not wait: the stream's
    writer sends what piled up as one message), ``abort`` raises as gRPC's does."""

    def __init__(self, calls: StreamedCalls, call_id: int, timeout_ms: int) -> None:
        self._calls = calls
        self._call_id = call_id
        self._deadline_s = time.monotonic() + timeout_ms / 1000 if timeout_ms else None
        self.expired = False  # cancelled at its deadline
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> float | None:
        if self._deadline_s is None:
            return None
        return max(self._deadline_s - time.monotonic(), 0.0)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    async def write(self, message: worker_pb2.WorkerGenerateResponse) -> None:
        await self._calls.put(worker_pb2.StreamedResponse(call_id=self._call_id, response=message))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError(details)


class StreamedCalls:
    """One GenerateStream's calls, each run by ``generate`` (a servicer's Generate: a coroutine
    that writes to its context, or an async generator of the messages); ``serve`` runs the
    stream to its end."""

    def __init__(self, generate: Generate, context: grpc.aio.ServicerContext) -> None:
        if inspect.isasyncgenfunction(generate):
            generate = _writing(generate)
        self._generate = generate
        self._context = context
        self._running: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[worker_pb2.StreamedResponse] = []
        self._filled: asyncio.Future[None] | None = None  # the writer waits for the outbox
        self._taken: asyncio.Future[None] | None = None  # writers wait for the outbox to go
        # Call id -> its last message in the outbox, a chunk the call's next chunk may join.
        self._joinable: dict[int, worker_pb2.StreamedResponse] = {}
        self._closing = False  # no more calls come: the writer ends once the outbox is empty
        self._draining = False  # the worker stops: no call is taken, the last one ends the stream
        self._reading: asyncio.Task[None] | None = None  # serve's task, while it reads calls

    def drain(self) -> None:
        """The worker stops: new calls are refused (UNAVAILABLE, as a stopping server refuses
        them: the router sends them elsewhere) and the stream ends once its running calls
        have, instead of at the server's grace."""
        self._draining = True
        self._end_if_drained()

    async def serve(self, requests: AsyncIterator[worker_pb2.GenerateStreamRequest]) -> None:
        await self._context.write(worker_pb2.GenerateStreamResponse())  # NOTE: "served here"
        writer = asyncio.get_running_loop().create_task(self._write())
        try:
            self._reading = asyncio.current_task()
            try:
                async for message in requests:
                    for call in message.calls:
                        self._start(call)
                    for call_id in message.cancelled:
                        task = self._running.pop(call_id, None)
                        if task is not None:
                            task.cancel()
                    self._end_if_drained()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not (self._draining and task is not None and task.uncancel() == 0):
                    raise
            self._reading = None
            # NOTE: the router half-closed, or the worker stops: the calls started run to their
            # ends.
            if self._running:
                await asyncio.wait(list(self._running.values()))
            self._closing = True
            self._wake_writer()
            await writer
        finally:
            await cancel_and_wait([*self._running.values(), writer])

    def send(self, message: worker_pb2.StreamedResponse) -> None:
        """Into the outbox, without waiting."""
        self._outbox.append(message)
        self._wake_writer()

    async def put(self, message: worker_pb2.StreamedResponse) -> None:
        """Into the outbox, joined to the call's chunk there if both merge (the router has not
        read it yet: it gets them as one); then wait while the outbox holds ``QUEUED_MESSAGES``
        (a router that reads slowly slows its calls' writers, as a call's own flow control
        would)."""
        call_id = message.call_id
        waiting = self._joinable.get(call_id)
        if merges(message.response):
            if waiting is not None:
                join(waiting.response, message.response)
                return
            self._joinable[call_id] = message
        elif waiting is not None:
            del self._joinable[call_id]  # NOTE: what follows must not pass this message
        self.send(message)
        while len(self._outbox) >= QUEUED_MESSAGES:
            if self._taken is None:
                self._taken = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._taken)

    def _start(self, call: worker_pb2.StreamedCall) -> None:
        call_id = call.call_id
        refusal = None
        if self._draining:
            refusal = _status(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down")
        elif call_id in self._running:
            refusal = _status(grpc.StatusCode.INVALID_ARGUMENT, f"call {call_id} runs already")
        if refusal is not None:
            self.send(worker_pb2.StreamedResponse(call_id=call_id, status=refusal))
            return
        context = StreamedContext(self, call_id, call.timeout_ms)
        task = asyncio.get_running_loop().create_task(self._run(call, context))
        self._running[call_id] = task
        if call.timeout_ms:
            # NOTE: as gRPC ends a call at its deadline; the router's own clock ends it there too.
            def expire() -> None:
                context.expired = True
                task.cancel()

            timer = asyncio.get_running_loop().call_later(call.timeout_ms / 1000, expire)
            task.add_done_callback(lambda _: timer.cancel())

    async def _run(self, call: worker_pb2.StreamedCall, context: StreamedContext) -> None:
        call_id = call.call_id
        try:
            await self._generate(call.request, context)
        except grpc.aio.AbortError:
            pass  # NOTE: its code and details are the context's
        except asyncio.CancelledError:
            if not context.expired:
                raise  # the router cancelled it, or the stream ended: no status is read
            # NOTE: the router hears of its deadline as a Generate call's caller would.
            context.code, context.details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception as e:
            logger.exception("call %d on a GenerateStream failed", call_id)
            context.code = grpc.StatusCode.UNKNOWN
            context.details = f"Unexpected {type(e).__name__}: {e}"
        if self._running.pop(call_id, None) is None:
            return
        status = _status(context.code, context.details, context.trailing)
        self.send(worker_pb2.StreamedResponse(call_id=call_id, status=status))
        self._end_if_drained()

    def _end_if_drained(self) -> None:
        if self._draining and not self._running and self._reading is not None:
            self._reading.cancel()  # NOTE: out of its read; serve then ends the stream
            self._reading = None

    def _wake_writer(self) -> None:
        filled, self._filled = self._filled, None
        if filled is not None and not filled.done():
            filled.set_result(None)

    async def _write(self) -> None:
        """Send what is in the outbox as one message, again while more comes; end once the
        stream closes with nothing left to send."""
        while True:
            while not self._outbox:
                if self._closing:
                    return
                self._filled = asyncio.get_running_loop().create_future()
                await self._filled
            outbox, self._outbox = self._outbox, []
            self._joinable.clear()
            taken, self._taken = self._taken, None
            if taken is not None:
                taken.set_result(None)
            for start, end in _batches(outbox):
                await self._context.write(
                    worker_pb2.GenerateStreamResponse(responses=outbox[start:end])
                )


def _batches(outbox: list[worker_pb2.StreamedResponse]) -> Iterator[tuple[int, int]]:
    """``outbox`` cut into runs of ``MAX_MESSAGE_BYTES`` at most (a larger message alone): a
    router reads up to gRPC's 4 MiB a message."""
    if len(outbox) == 1:  # NOTE: the common case at light load: nothing to measure
        yield 0, 1
        return
    start, size = 0, 0
    for end, message in enumerate(outbox):
        message_size = message.ByteSize()
        size += message_size
        if size > MAX_MESSAGE_BYTES and end > start:
            yield start, end
            start, size = end, message_size
    yield start, len(outbox)


def _writing(generate: Callable[..., AsyncIterator[Any]]) -> Generate:
    async def write_all(request: Any, context: StreamedContext) -> None:
        async for response in generate(request, context):
            await context.write(response)

    return write_all


def _status(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, str]] = ()
) -> worker_pb2.CallStatus:
    return worker_pb2.CallStatus(
        code=code.value[0], details=details, trailing_metadata=dict(trailing)
    )
