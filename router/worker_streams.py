"""A router's Generate calls to one worker, many over one ``GenerateStream``.

gRPC aio costs the router some tens of microseconds of CPU a message whatever the message holds
(its write, its poller thread, the loop's wakeup: docs/BENCHMARKS.md, "Relaying streamed
tokens"), and a decode step gives each of a worker's streams one token. Over one stream a
worker sends what its calls have ready as one message, so a step's tokens for all of them cost
the router one read; its calls' starts and cancels go the other way, as many a message as are
waiting. The stream costs a hand-off on each side, so a worker's first calls (fewer than
``STREAMS_FROM_CALLS`` running there) go as Generate calls of their own. ``WorkerStreams.generate``
returns a ``StreamedCall``, read as the ``grpc.aio`` call of ``WorkerStub.Generate`` is::

    async for response in call   -> the call's WorkerGenerateResponses; AioRpcError (code,
                                    details, trailing metadata) where it did not end OK
    cancel()                     -> the worker told; reading raises CancelledError, as grpc's

A worker that does not serve ``GenerateStream`` (UNIMPLEMENTED: an older version) gets each call
as a ``Generate`` call of its own for ``REPROBE_S``, then a stream is tried again. The stream's
end (the worker gone, its channel closed) ends every call on it with its status (UNAVAILABLE
where it ended without one); the next call opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any

import grpc

from kvswitch.chunks import join, merges
from kvswitch.serving import cancel_and_wait
from kvswitch.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# Calls running on a worker from which the next goes on the stream; below, a Generate call of
# its own. NOTE: the stream saves CPU where a step has tokens of many calls (a quarter of the
# router's at 64 streams), and costs a hand-off on each side: at 4 streams it added about half a
# millisecond a token (docs/BENCHMARKS.md, "A router's calls to a worker over one stream").
STREAMS_FROM_CALLS = 8
# How long a worker that does not serve GenerateStream gets a Generate a call before the router
# tries a stream again (a worker upgraded in place keeps its address and id).
REPROBE_S = 60.0
# The most request bytes one message to a worker carries (the worker takes 64 MiB a message;
# one larger request goes alone).
MAX_BATCH_BYTES = 16 << 20


class StreamedCall:
    """One Generate call on a worker's stream; see the module's docstring."""

    def __init__(self, streams: WorkerStreams, call_id: int, timeout_s: float | None) -> None:
        self._streams = streams
        self.call_id = call_id
        self._responses: deque[worker_pb2.WorkerGenerateResponse] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None  # raised once the responses are read
        self._ended = False  # its status came, or it was cancelled
        self._alone: Any = None  # a Generate call of its own (the worker serves no stream)
        self._alone_responses: Any = None  # its responses, as read
        self._expiry = None
        if timeout_s is not None:
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_later(max(timeout_s, 0.0), self._expire)

    def __aiter__(self) -> StreamedCall:
        return self

    async def __anext__(self) -> worker_pb2.WorkerGenerateResponse:
        while not self._responses:
            if self._alone_responses is not None:
                return await anext(self._alone_responses)
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        response = self._responses.popleft()
        # NOTE: a call read slower than its tokens come: those that came go as one chunk, one
        # message to its client instead of one each.
        if merges(response):
            queued = self._responses
            while queued and merges(queued[0]):
                join(response, queued.popleft())
        return response

    def cancel(self) -> bool:
        if self._alone is not None:
            return self._alone.cancel()
        if self._ended:
            return False
        self._end(asyncio.CancelledError())
        self._streams.cancelled(self.call_id)
        return True

    # What the stream hands the call.

    def received(self, response: worker_pb2.WorkerGenerateResponse) -> None:
        if not self._ended:
            self._responses.append(response)
            self._wake()

    def ended(self, status: worker_pb2.CallStatus) -> None:
        if status.code == grpc.StatusCode.OK.value[0]:
            self._end(None)
            return
        code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        trailing = grpc.aio.Metadata(*status.trailing_metadata.items())
        self._end(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, status.details))

    def failed(self, error: grpc.aio.AioRpcError) -> None:
        """The stream ended under the call."""
        self._end(error)

    def alone(self, call: Any) -> None:
        """The worker serves no stream: this call goes on as ``call``, a Generate of its own."""
        self._alone = call
        self._alone_responses = aiter(call)
        if self._expiry is not None:
            self._expiry.cancel()  # NOTE: the Generate call keeps the deadline
        self._wake()

    def _expire(self) -> None:
        if not self._ended:
            error = grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded",
            )
            self._end(error)
            self._streams.cancelled(self.call_id)

    def _end(self, error: BaseException | None) -> None:
        self._ended = True
        self._error = error
        if self._expiry is not None:
            self._expiry.cancel()
        self._streams.forget(self.call_id)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WorkerStreams:
    """A router's calls to one worker over one ``GenerateStream``, opened with the first call
    and again after it ends."""

    def __init__(
        self,
        stub: worker_pb2_grpc.WorkerStub,
        worker_id: str,
        *,
        streams_from: int = STREAMS_FROM_CALLS,
    ) -> None:
        self._stub = stub
        self._streams_from = streams_from  # calls running here from which a call is streamed
        self._num_alone = 0  # Generate calls of their own running
        self._worker_id = worker_id
        self._served: bool | None = None  # whether the worker serves GenerateStream: None, unknown
        self._unserved_s = 0.0  # when it answered UNIMPLEMENTED (time.monotonic)
        self._ids = itertools.count(1)
        self._calls: dict[int, StreamedCall] = {}
        self._stream: Any = None  # the open GenerateStream call, if any
        self._reader: asyncio.Task[None] | None = None
        self._starts: list[tuple[StreamedCall, worker_pb2.StreamedCall]] = []
        self._cancels: list[int] = []
        self._queued: asyncio.Future[None] | None = None  # the stream's writer waits for work

    def generate(
        self, request: worker_pb2.WorkerGenerateRequest, timeout: float | None = None
    ) -> Any:
        """A call of ``request``: a ``StreamedCall`` once ``streams_from`` calls run here, else
        (or where the worker serves no stream) the stub's own Generate call.
        ``grpc.aio.UsageError`` once the worker's channel closed."""
        if self._served is False:
            if time.monotonic() - self._unserved_s < REPROBE_S:
                return self._alone(request, timeout)
            self._served = None  # NOTE: upgraded in place since? The next stream will tell.
        if self._num_alone + len(self._calls) + 1 < self._streams_from:
            return self._alone(request, timeout)
        if self._stream is None:
            self._open()
        call = StreamedCall(self, next(self._ids), timeout)
        self._calls[call.call_id] = call
        timeout_ms = 0 if timeout is None else max(int(timeout * 1000), 1)
        start = worker_pb2.StreamedCall(
            call_id=call.call_id, request=request, timeout_ms=timeout_ms
        )
        self._starts.append((call, start))
        self._wake_writer()
        return call

    def _alone(self, request: worker_pb2.WorkerGenerateRequest, timeout: float | None) -> Any:
        """A Generate call of its own, counted while it runs."""
        call = self._stub.Generate(request, timeout=timeout)
        self._num_alone += 1
        call.add_done_callback(self._alone_done)
        return call

    def _alone_done(self, _: Any) -> None:
        self._num_alone -= 1

    async def close(self) -> None:
        """End the stream and every call on it (the router stops, the worker left)."""
        if self._reader is not None:
            await cancel_and_wait([self._reader])

    # What a call tells its stream.

    def cancelled(self, call_id: int) -> None:
        if any(call.call_id == call_id for call, _ in self._starts):
            self._starts = [(c, s) for c, s in self._starts if c.call_id != call_id]
            return  # NOTE: never sent: nothing to cancel there
        self._cancels.append(call_id)
        self._wake_writer()

    def forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    # The stream.

    def _open(self) -> None:
        self._stream = self._stub.GenerateStream()
        self._reader = asyncio.get_running_loop().create_task(self._run(self._stream))

    async def _run(self, stream: Any) -> None:
        error: grpc.aio.AioRpcError | None = None
        writer = None
        try:
            try:
                await stream.read()  # NOTE: the worker's first, empty message: it serves streams
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                    self._serve_alone()
                    return
                raise
            self._served = True
            writer = asyncio.get_running_loop().create_task(self._write(stream))
            while True:
                message = await stream.read()
                if message is grpc.aio.EOF:
                    break
                for response in message.responses:
                    call = self._calls.get(response.call_id)
                    if call is None:
                        continue  # NOTE: one this router cancelled, or a deadline ended
                    if response.HasField("response"):
                        call.received(response.response)
                    else:
                        call.ended(response.status)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            # NOTE: this stream's own end (close), or its channel closed under it.
            error = _unavailable(f"the stream to worker {self._worker_id} was cancelled")
            raise
        finally:
            if writer is not None:
                await cancel_and_wait([writer])
            stream.cancel()
            if self._stream is stream:
                self._stream = None
                self._reader = None
            self._fail_all(error or _unavailable(f"worker {self._worker_id} ended the stream"))

    def _serve_alone(self) -> None:
        """The worker serves no GenerateStream: each call, those waiting too, a Generate."""
        logger.info("worker %s serves no GenerateStream: a Generate a call", self._worker_id)
        self._served = False
        self._unserved_s = time.monotonic()
        starts, self._starts = self._starts, []
        for call, start in starts:
            self._calls.pop(call.call_id, None)
            timeout = start.timeout_ms / 1000 if start.timeout_ms else None
            call.alone(self._alone(start.request, timeout))

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        calls = list(self._calls.values())
        self._calls.clear()
        self._starts.clear()
        self._cancels.clear()
        for call in calls:
            call.failed(error)

    def _wake_writer(self) -> None:
        queued, self._queued = self._queued, None
        if queued is not None and not queued.done():
            queued.set_result(None)

    async def _write(self, stream: Any) -> None:
        """Send the calls and cancels waiting, as few messages as fit, while more come."""
        while True:
            while not self._starts and not self._cancels:
                self._queued = asyncio.get_running_loop().create_future()
                await self._queued
            message = worker_pb2.GenerateStreamRequest(cancelled=self._cancels)
            self._cancels = []
            size = 0
            while self._starts and (size == 0 or size < MAX_BATCH_BYTES):
                _, start = self._starts[0]
                size += start.ByteSize()
                if size > MAX_BATCH_BYTES and message.calls:
                    break
                self._starts.pop(0)
                message.calls.append(start)
            try:
                await stream.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, grpc.aio.InternalError) as e:
                # NOTE: the stream broke: its reader ends it and every call on it.
                logger.debug("writing to worker %s failed: %s", self._worker_id, e)
                stream.cancel()
                return


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
