"""The asyncio client: ``await AsyncClient.generate(...)``, ``async for chunk in stream(...)``.

It mirrors ``client.sync_client`` call for call; create and use it inside one event loop.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Unpack

import grpc

from kvswitch.client.channel import TlsOption, call_metadata, channel_credentials, check_timeout_s
from kvswitch.client.request import WHOLE_ANSWER_STREAM_INTERVAL, GenerateOptions, GenerateParams
from kvswitch.client.result import Chunk, GenerateResult, ResultBuilder
from kvswitch.client.retry import Attempts, RetryBudget, RetryPolicy
from kvswitch.v1 import router_pb2, router_pb2_grpc


class AsyncClient:
    """A connection to a kvswitch router for asyncio code; arguments as for ``Client``."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TlsOption = None,
        timeout_s: float | None = None,
        max_retries: int = 3,
        initial_backoff_s: float = 0.05,
    ) -> None:
        self.target = target
        self._metadata = call_metadata(token)
        self._timeout_s = check_timeout_s(timeout_s)
        self._retry = RetryPolicy(max_retries=max_retries, initial_backoff_s=initial_backoff_s)
        self.retry_budget = RetryBudget()  # shared by all its requests
        credentials = channel_credentials(tls)
        self._channel = (
            grpc.aio.insecure_channel(target)
            if credentials is None
            else grpc.aio.secure_channel(target, credentials)
        )
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Runs one request to the end; raises ``KvswitchError`` if it fails."""
        stream = self._start(prompt, timeout_s, options, WHOLE_ANSWER_STREAM_INTERVAL)
        async with stream:
            async for _ in stream:
                pass
            return stream.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        timeout_s: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncStream:
        """Starts one request; ``async for`` over the returned ``AsyncStream`` for its chunks.

        ``timeout_s`` overrides the client's default deadline. The arguments are checked here,
        before anything is sent (``ValueError``)."""
        return self._start(prompt, timeout_s, options)

    def _start(
        self,
        prompt: str | None,
        timeout_s: float | None,
        options: GenerateOptions,
        stream_interval: int = 0,
    ) -> AsyncStream:
        request = GenerateParams.from_options(prompt, options).to_request()
        request.stream_interval = stream_interval
        timeout_s = check_timeout_s(timeout_s) or self._timeout_s
        attempts = Attempts(request.request_id, self._retry, timeout_s, self.retry_budget)
        return AsyncStream(self._stub, request, self._metadata, attempts)

    async def wait_until_connected(self, timeout_s: float) -> None:
        """Returns once a connection to the router is up; ``ConnectionError`` if none is made
        within ``timeout_s`` (nothing listens there, or the name does not resolve)."""
        try:
            # NOTE: asyncio.timeout, not wait_for: before Python 3.12 wait_for can lose a cancel.
            async with asyncio.timeout(timeout_s):
                await self._channel.channel_ready()
        except TimeoutError:
            raise ConnectionError(
                f"no router answered at {self.target} within {timeout_s:g} s"
            ) from None

    async def close(self) -> None:
        """Closes the connection; requests still running are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncStream:
    """The chunks of one request, in order, as they arrive; then ``result``.

    Leaving the iteration early (``break``), ``close()``, the end of an ``async with`` block,
    cancelling the task that reads it or dropping the stream cancels the request on the router.
    A failed request raises ``KvswitchError`` from the iteration.
    """

    def __init__(
        self,
        stub: router_pb2_grpc.RouterStub,
        request: router_pb2.GenerateRequest,
        metadata: tuple[tuple[str, str], ...],
        attempts: Attempts,
    ) -> None:
        self.request_id = request.request_id
        self._stub = stub
        self._request = request
        self._metadata = metadata
        self._attempts = attempts
        self._builder = ResultBuilder(request.request_id)
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._result: GenerateResult | None = None
        self._closed = False

    @property
    def result(self) -> GenerateResult:
        """The whole result; only once the iteration has run to its end."""
        if self._result is None:
            raise RuntimeError(f"stream {self.request_id} has not ended; iterate it to the end")
        return self._result

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        try:
            chunk = await self._next_chunk()
        except BaseException:
            self.close()
            raise
        if chunk is None:
            self.close()
            raise StopAsyncIteration
        return chunk

    async def _next_chunk(self) -> Chunk | None:
        """The next chunk, or None once the stream has ended (its result is then set)."""
        while not self._closed:
            if self._call is None:
                self._call = self._stub.Generate(
                    self._request, timeout=self._attempts.timeout_s(), metadata=self._metadata
                )
            try:
                response = await self._call.read()
            except grpc.RpcError as error:
                self._call = None
                await asyncio.sleep(
                    self._attempts.backoff_s(error, num_messages=self._builder.num_messages)
                )
                continue
            if response is grpc.aio.EOF:
                self._call = None
                self._result = self._builder.finish()
                return None
            self._attempts.answered()
            chunk = self._builder.add(response)
            if chunk is not None:
                return chunk
        return None

    def __del__(self) -> None:
        # NOTE: a dropped stream cancels its call at once. grpc cancels a call only when it frees
        # it, which for an aio call waits for the garbage collector (it sits in a cycle).
        self.close()

    def close(self) -> None:
        """Stops the stream, cancelling the request if it is still running."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
