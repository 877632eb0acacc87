"""The HTTP front's in-process calls (``router/local_call.py``) read as gRPC calls read: messages
in order, then EOF; an abort as AioRpcError with its code, details and trailing metadata; a
cancel reaching the servicer; a stop that gives running calls their grace and takes no more."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvswitch.router.local_call import QUEUED_MESSAGES, LocalStub
from kvswitch.v1 import common_pb2, router_pb2


def chunk(text: str) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(chunk=common_pb2.TokenChunk(text=text))


class Servicer:
    """Answers as the request's text says: ``ok``, ``abort``, ``raise`` or ``hang``."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.metadata: tuple = ()

    async def Generate(self, request: router_pb2.GenerateRequest, context) -> None:
        self.metadata = context.invocation_metadata()
        await context.send_initial_metadata((("x-worker", "w1"),))
        for text in ("a", "b", "c"):
            await context.write(chunk(text))
        if request.text == "abort":
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        if request.text == "raise":
            raise RuntimeError("a bug")
        if request.text == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        await context.write(router_pb2.GenerateResponse(final=router_pb2.GenerateFinal()))


async def read_all(call) -> list[str]:
    texts = []
    while (message := await call.read()) is not grpc.aio.EOF:
        texts.append(message.chunk.text if message.HasField("chunk") else "final")
    return texts


def test_messages_arrive_in_order_then_eof_with_the_callers_metadata() -> None:
    async def main() -> None:
        servicer = Servicer()
        call = LocalStub(servicer).Generate(
            router_pb2.GenerateRequest(text="ok"), metadata=(("k", "v"),)
        )
        assert dict(await call.initial_metadata()) == {"x-worker": "w1"}
        assert await read_all(call) == ["a", "b", "c", "final"]
        assert await call.read() is grpc.aio.EOF
        assert servicer.metadata == (("k", "v"),)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("text", "code", "details"),
    [
        ("abort", grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
        ("raise", grpc.StatusCode.UNKNOWN, "Unexpected RuntimeError: a bug"),
    ],
)
def test_an_abort_or_a_failure_reads_as_a_grpc_error(
    text: str, code: grpc.StatusCode, details: str
) -> None:
    async def main() -> None:
        call = LocalStub(Servicer()).Generate(router_pb2.GenerateRequest(text=text))
        for expected in ("a", "b", "c"):
            assert (await call.read()).chunk.text == expected
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert (error.value.code(), error.value.details()) == (code, details)
        if text == "abort":
            assert dict(error.value.trailing_metadata()) == {"retry-after-ms": "250"}

    asyncio.run(main())


def test_a_cancel_reaches_the_servicer() -> None:
    async def main() -> None:
        servicer = Servicer()
        call = LocalStub(servicer).Generate(router_pb2.GenerateRequest(text="hang"))
        assert [(await call.read()).chunk.text for _ in range(3)] == ["a", "b", "c"]
        assert call.cancel()
        await asyncio.wait_for(servicer.cancelled.wait(), 30)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() is grpc.StatusCode.CANCELLED

    asyncio.run(main())


def test_a_writer_waits_for_a_slow_reader() -> None:
    """As gRPC's flow control would: the servicer's writes wait once enough are unread."""

    class Chatty:
        num_written = 0

        async def Generate(self, request, context) -> None:
            for i in range(1000):
                await context.write(chunk(str(i)))
                self.num_written += 1

    async def main() -> None:
        servicer = Chatty()
        call = LocalStub(servicer).Generate(router_pb2.GenerateRequest())
        for _ in range(10 * QUEUED_MESSAGES):  # NOTE: turns of the loop, not time: no I/O here
            await asyncio.sleep(0)
        assert servicer.num_written == QUEUED_MESSAGES  # then it waits
        texts = await read_all(call)
        assert texts == [str(i) for i in range(1000)]

    asyncio.run(main())


def test_a_stop_gives_running_calls_their_grace_then_cancels_them_and_takes_no_more() -> None:
    async def main() -> None:
        servicer = Servicer()
        stub = LocalStub(servicer)
        quick = stub.Generate(router_pb2.GenerateRequest(text="ok"))
        hung = stub.Generate(router_pb2.GenerateRequest(text="hang"))
        await asyncio.sleep(0)
        await stub.stop(0.5)
        assert servicer.cancelled.is_set()
        assert await read_all(quick) == ["a", "b", "c", "final"]  # ended within its grace
        with pytest.raises(grpc.aio.AioRpcError):
            await read_all(hung)
        late = stub.Generate(router_pb2.GenerateRequest(text="ok"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await late.read()
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())
