"""The HTTP front's calls to its own router, made in-process: the Router service's ``Generate``
run as a task beside the front, its messages handed over a queue, as a gRPC call to this
process's server would bring them, without the loopback hop (a gRPC write, a read and a rebuilt
message on each side, for every chunk relayed: ``kvswitch bench routers``, docs/BENCHMARKS.md).

``LocalStub.Generate`` returns a ``LocalCall`` with what the front reads of a
``grpc.aio.UnaryStreamCall``::

    read()               -> the next GenerateResponse; grpc.aio.EOF once the call ended well;
                            AioRpcError (code, details, trailing metadata) where it did not
    initial_metadata()   -> what the servicer sent before its first chunk
    cancel()             -> the servicer's task cancelled, as a client's cancel reaches it

The servicer sees a ``LocalContext``: the caller's metadata, no deadline, ``abort`` raising as
grpc's does. What the server's guard would check of a call (the router's token, the message's
size) the front has checked already. ``stop`` ends the calls as the server's stop does: none
taken from then on, the running ones given the grace, then cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import grpc

from kvswitch.v1 import router_pb2

logger = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]
QUEUED_MESSAGES = 64  # NOTE: as gRPC's flow control would: a writer waits on a slow reader
_END = object()


class _Pipe:
    """The servicer's messages on their way to the front: a writer waits while
    ``QUEUED_MESSAGES`` wait to be read (as gRPC's flow control would make it); the end is put
    in without waiting."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._ended = False
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None

    async def put(self, item: Any) -> None:
        while len(self._items) >= QUEUED_MESSAGES:
            self._writer = asyncio.get_running_loop().create_future()
            await self._writer
        self._items.append(item)
        self._reader = _wake(self._reader)

    def end(self) -> None:
        self._ended = True
        self._reader = _wake(self._reader)

    async def get(self) -> Any:
        """The next message; ``_END`` once the last was read."""
        while not self._items:
            if self._ended:
                return _END
            self._reader = asyncio.get_running_loop().create_future()
            await self._reader
        self._writer = _wake(self._writer)
        return self._items.popleft()


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class LocalContext:
    """The part of ``grpc.aio.ServicerContext`` the Router service uses."""

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = tuple(metadata)
        self.messages = _Pipe()
        self.initial: asyncio.Future[grpc.aio.Metadata] = asyncio.get_running_loop().create_future()
        self.trailing: tuple[tuple[str, str], ...] = ()
        self.code = grpc.StatusCode.OK
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:0"  # NOTE: the front's calls name their client in the metadata

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self.trailing = tuple(metadata)

    async def send_initial_metadata(self, metadata: Metadata) -> None:
        if not self.initial.done():
            self.initial.set_result(grpc.aio.Metadata(*metadata))

    async def write(self, message: router_pb2.GenerateResponse) -> None:
        if not self.initial.done():
            self.initial.set_result(grpc.aio.Metadata())
        await self.messages.put(message)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError(details)


class LocalCall:
    """One call to the Router service in this process; see the module's docstring."""

    def __init__(self, stub: LocalStub, context: LocalContext, task: asyncio.Task[None]) -> None:
        self._stub = stub
        self._context = context
        self._task = task
        self._ended = False

    async def read(self) -> Any:
        if self._ended:
            return grpc.aio.EOF
        message = await self._context.messages.get()
        if message is not _END:
            return message
        self._ended = True
        context = self._context
        if context.code is grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise grpc.aio.AioRpcError(
            context.code,
            await self.initial_metadata(),
            grpc.aio.Metadata(*context.trailing),
            context.details,
        )

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return await self._context.initial

    def cancel(self) -> bool:
        if self._task.done():
            return False
        self._task.cancel()
        return True

    def done(self) -> bool:
        return self._task.done()


class LocalStub:
    """The Router service of this process, called as a ``RouterStub`` is."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer
        self._running: set[asyncio.Task[None]] = set()
        self._stopping = False

    def Generate(  # NOTE: named as the stub's method
        self,
        request: router_pb2.GenerateRequest,
        *,
        metadata: Metadata = (),
        timeout: float | None = None,
    ) -> LocalCall:
        if timeout is not None:
            raise ValueError("the router's own calls take no deadline")
        context = LocalContext(metadata)
        task = asyncio.get_running_loop().create_task(self._serve(request, context))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return LocalCall(self, context, task)

    async def _serve(self, request: router_pb2.GenerateRequest, context: LocalContext) -> None:
        try:
            if self._stopping:
                context.code, context.details = grpc.StatusCode.UNAVAILABLE, "the router stops"
                return
            await self._servicer.Generate(request, context)
        except grpc.aio.AbortError:
            pass  # NOTE: its code and details are the context's
        except asyncio.CancelledError:
            context.code, context.details = grpc.StatusCode.CANCELLED, "Locally cancelled"
            raise
        except Exception as e:
            logger.exception("the router's call failed")
            context.code = grpc.StatusCode.UNKNOWN
            context.details = f"Unexpected {type(e).__name__}: {e}"
        finally:
            if not context.initial.done():
                context.initial.set_result(grpc.aio.Metadata())
            context.messages.end()

    async def stop(self, grace_s: float) -> None:
        """Take no more calls; those running have ``grace_s`` to end, then are cancelled."""
        self._stopping = True
        running = list(self._running)
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=grace_s)
        for task in late:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*late, return_exceptions=True)

    async def close(self) -> None:
        await self.stop(0)
