"""A router's Generate calls to a worker over one GenerateStream (``router/worker_streams.py``
against ``worker/call_stream.py``, over real gRPC): each call reads as its own Generate call
would (its messages in order, its status with code, details and trailing metadata, a cancel
reaching the worker, its deadline), a step's messages of many calls cross as one message, the
stream's end fails every call on it, and a worker without the method gets a Generate a call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from kvswitch.router import worker_streams
from kvswitch.router.worker_streams import StreamedCall, WorkerStreams
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.call_stream import (
    MAX_MESSAGE_BYTES,
    QUEUED_MESSAGES,
    StreamedCalls,
    StreamedContext,
    _batches,
)

WAIT_S = 30  # NOTE: only bounds a wait for an event that should come; never a measure


def chunk(token: int, text: str = "") -> worker_pb2.WorkerGenerateResponse:
    return worker_pb2.WorkerGenerateResponse(
        chunk=common_pb2.TokenChunk(token_ids=[token], text=text, num_pending_text_tokens=token)
    )


FINAL = worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerGenerateFinal())


class Steps:
    """A decode step at a time, when the test says: every call waiting on it goes on at once."""

    def __init__(self) -> None:
        self._step = asyncio.Event()
        self.waiting = 0  # calls waiting for the next step

    def next(self) -> None:
        step, self._step = self._step, asyncio.Event()
        step.set()
        self.waiting = 0

    async def wait(self) -> None:
        self.waiting += 1
        await self._step.wait()


class Worker(worker_pb2_grpc.WorkerServicer):
    """Answers as a request's ``lora`` says: ``steps`` (a token a step, ``max_tokens`` of them),
    ``full`` (RESOURCE_EXHAUSTED with a retry-after), ``bad`` (INVALID_ARGUMENT), ``raise`` or
    ``hang``. Counts the messages its streams sent and the calls that were cancelled."""

    def __init__(self, *, streams: bool = True) -> None:
        self.steps = Steps()
        self.cancelled: list[str] = []
        self.cancel_seen = asyncio.Event()
        self.messages_sent = 0
        self.generate_calls = 0
        self.started = 0  # calls that began to run
        self.open_streams: list[StreamedCalls] = []
        self.streams_ended = 0  # GenerateStream calls that returned
        self.streams = streams

    async def run(self, request: worker_pb2.WorkerGenerateRequest, context) -> None:
        kind = request.lora
        self.started += 1
        if kind == "full":
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if kind == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many")
        if kind == "raise":
            raise RuntimeError("a bug")
        if kind == "burst":  # a first chunk, then max_tokens - 1 more at once
            first = chunk(0)
            first.chunk.num_cached_tokens = 3
            await context.write(first)
            for token in range(1, request.sampling.max_tokens):
                await context.write(chunk(token, text=chr(ord("a") + token)))
            await context.write(FINAL)
            return
        try:
            if kind == "hang":
                await asyncio.Event().wait()
            for token in range(request.sampling.max_tokens):
                await self.steps.wait()
                await context.write(chunk(token))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            self.cancel_seen.set()
            raise
        await context.write(FINAL)

    async def Generate(self, request, context) -> None:
        self.generate_calls += 1
        await self.run(request, context)

    async def GenerateStream(self, requests, context) -> None:
        if not self.streams:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        calls = StreamedCalls(self.run, _Counting(context, self))
        self.open_streams.append(calls)
        await calls.serve(requests)
        self.streams_ended += 1


class _Counting:
    """A servicer context that counts the messages written through it."""

    def __init__(self, context, worker: Worker) -> None:
        self._context = context
        self._worker = worker

    async def write(self, message) -> None:
        self._worker.messages_sent += 1
        await self._context.write(message)


async def serve(worker: Worker, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def request(
    kind: str, max_tokens: int = 0, request_id: str = ""
) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id or kind,
        lora=kind,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def read_all(call: StreamedCall) -> list[int]:
    tokens = []
    async for response in call:
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        else:
            tokens.append(-1)  # the final message
    return tokens


@contextlib.asynccontextmanager
async def connected(worker: Worker) -> AsyncIterator:
    server, port = await serve(worker)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    # NOTE: every call on the stream, the first too (the router streams from a few calls on)
    streams = WorkerStreams(worker_pb2_grpc.WorkerStub(channel), "w1", streams_from=1)
    try:
        yield server, port, channel, streams
    finally:
        await streams.close()
        await channel.close()
        await server.stop(0)


async def until(predicate, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


@pytest.mark.parametrize("serves_streams", [True, False], ids=["stream", "generate-alone"])
def test_many_calls_read_their_own_messages_in_order_and_a_step_crosses_in_one_message(
    serves_streams: bool,
) -> None:
    num_calls, num_tokens = 16, 5

    async def main() -> None:
        worker = Worker(streams=serves_streams)
        async with connected(worker) as (_, _, _, streams):
            calls = [
                streams.generate(request("steps", num_tokens, f"r{i}")) for i in range(num_calls)
            ]
            reads = [asyncio.create_task(read_all(call)) for call in calls]
            for _ in range(num_tokens):
                await until(lambda: worker.steps.waiting == num_calls, "every call waits a step")
                worker.steps.next()
            results = await asyncio.wait_for(asyncio.gather(*reads), WAIT_S)
            assert results == [[*range(num_tokens), -1]] * num_calls
            if serves_streams:
                # NOTE: num_calls * (num_tokens + 2) messages of the calls' own (chunks, the
                # final, the status); a step's chunks went together: far fewer messages.
                assert worker.generate_calls == 0
                assert worker.messages_sent <= 1 + 2 * (num_tokens + 2)
            else:
                assert worker.generate_calls == num_calls

    asyncio.run(main())


def test_a_call_ends_with_its_own_status_and_the_others_go_on() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (_, _, _, streams):
            going = streams.generate(request("steps", 2))
            reading = asyncio.create_task(read_all(going))
            for kind, code in [
                ("full", grpc.StatusCode.RESOURCE_EXHAUSTED),
                ("bad", grpc.StatusCode.INVALID_ARGUMENT),
                ("raise", grpc.StatusCode.UNKNOWN),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await asyncio.wait_for(read_all(streams.generate(request(kind))), WAIT_S)
                assert failed.value.code() is code
                if kind == "full":
                    assert dict(failed.value.trailing_metadata()) == {"retry-after-ms": "250"}
                    assert failed.value.details() == "queue full"
                if kind == "raise":
                    assert "RuntimeError: a bug" in failed.value.details()
            worker.steps.next()
            await until(lambda: worker.steps.waiting == 1, "the second step waited")
            worker.steps.next()
            assert await asyncio.wait_for(reading, WAIT_S) == [0, 1, -1]

    asyncio.run(main())


def test_a_cancelled_call_reaches_the_worker_and_reads_as_cancelled() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (_, _, _, streams):
            hung = streams.generate(request("hang", request_id="hung"))
            other = streams.generate(request("steps", 1, "other"))
            reading = asyncio.create_task(read_all(other))
            await until(lambda: worker.steps.waiting == 1, "the other call runs")
            assert hung.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read_all(hung)
            await asyncio.wait_for(worker.cancel_seen.wait(), WAIT_S)
            assert worker.cancelled == ["hung"]
            assert not hung.cancel()  # once
            worker.steps.next()
            assert await asyncio.wait_for(reading, WAIT_S) == [0, -1]

    asyncio.run(main())


def test_a_call_past_its_deadline_ends_deadline_exceeded_there_and_here() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (_, _, _, streams):
            call = streams.generate(request("hang", request_id="late"), timeout=0.2)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(read_all(call), WAIT_S)
            assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(worker.cancel_seen.wait(), WAIT_S)
            assert worker.cancelled == ["late"]

    asyncio.run(main())


def test_the_streams_end_fails_every_call_on_it_and_the_next_call_opens_another() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (server, port, _, streams):
            calls = [streams.generate(request("hang", request_id=f"r{i}")) for i in range(3)]
            await until(lambda: worker.started == 3, "the calls run")
            await server.stop(0)  # the worker gone
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await asyncio.wait_for(read_all(call), WAIT_S)
                assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
            again = Worker()
            server, _ = await serve(again, port)  # the same address, a new worker
            try:
                call = streams.generate(request("steps", 1))
                await until(lambda: again.steps.waiting == 1, "the call reached it")
                again.steps.next()
                assert await asyncio.wait_for(read_all(call), WAIT_S) == [0, -1]
            finally:
                await server.stop(0)

    asyncio.run(main())


def test_a_draining_worker_refuses_new_calls_and_ends_the_stream_with_its_last_call() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (_, _, _, streams):
            running = streams.generate(request("steps", 1, "running"))
            reading = asyncio.create_task(read_all(running))
            await until(lambda: worker.steps.waiting == 1, "the call runs")
            (calls,) = worker.open_streams
            calls.drain()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(read_all(streams.generate(request("steps", 1))), WAIT_S)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert worker.streams_ended == 0  # NOTE: the running call goes on
            worker.steps.next()
            assert await asyncio.wait_for(reading, WAIT_S) == [0, -1]
            await until(lambda: worker.streams_ended == 1, "the stream ended with its last call")

    asyncio.run(main())


def test_chunks_that_arrived_before_the_read_come_as_one_the_first_alone() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (_, _, _, streams):
            call = streams.generate(request("burst", 5))
            await until(lambda: call._ended, "the whole call arrived")
            chunks = [response async for response in call]
            assert [list(c.chunk.token_ids) for c in chunks[:2]] == [[0], [1, 2, 3, 4]]
            assert chunks[0].chunk.num_cached_tokens == 3
            assert chunks[1].chunk.text == "bcde"
            assert chunks[1].chunk.num_pending_text_tokens == 4  # the last one's
            assert chunks[2].HasField("final") and len(chunks) == 3

    asyncio.run(main())


def test_a_streams_messages_stay_under_the_routers_limit_and_a_large_one_goes_alone() -> None:
    def response(num_floats: int) -> worker_pb2.StreamedResponse:
        embedding = common_pb2.TokenChunk(embedding=[1.0] * num_floats)
        return worker_pb2.StreamedResponse(
            call_id=1, response=worker_pb2.WorkerGenerateResponse(chunk=embedding)
        )

    large = MAX_MESSAGE_BYTES // 4 + 1  # floats: one message over the limit alone
    outbox = [response(10), response(large), response(10), response(10)]
    assert list(_batches(outbox)) == [(0, 1), (1, 2), (2, 4)]
    small = [response(1000)] * 600  # about 4 KB each: 2.4 MB in all
    cuts = list(_batches(small))
    assert cuts[0][0] == 0 and cuts[-1][1] == 600 and len(cuts) == 3
    for start, end in cuts:
        assert sum(m.ByteSize() for m in small[start:end]) <= MAX_MESSAGE_BYTES


class Held:
    """A stream whose messages the router takes only when the test says."""

    def __init__(self) -> None:
        self.messages: list = []
        self.go = asyncio.Event()

    async def write(self, message) -> None:
        self.messages.append(message)
        if len(self.messages) > 1:  # NOTE: the greeting passes
            await self.go.wait()


async def one_call() -> AsyncIterator[worker_pb2.GenerateStreamRequest]:
    yield worker_pb2.GenerateStreamRequest(calls=[worker_pb2.StreamedCall(call_id=1)])
    await asyncio.Event().wait()  # the router reads on


def test_a_slow_reader_makes_the_calls_writers_wait() -> None:
    async def main() -> None:
        held = Held()
        written = 0

        async def write_many(request, context: StreamedContext) -> None:
            nonlocal written
            for token in range(2 * QUEUED_MESSAGES):
                alone = chunk(token)
                alone.chunk.num_cached_tokens = 0  # NOTE: joins no other: a message each
                await context.write(alone)
                written += 1

        calls = StreamedCalls(write_many, held)
        serving = asyncio.create_task(calls.serve(one_call()))
        await until(lambda: len(held.messages) == 2, "the first batch went")
        for _ in range(100):
            await asyncio.sleep(0)
        # NOTE: the first message took what was written before the writer ran; then the writes
        # wait once QUEUED_MESSAGES more are queued (the write that filled it waits too).
        assert written == len(held.messages[1].responses) + QUEUED_MESSAGES - 1
        held.go.set()
        await until(lambda: written == 2 * QUEUED_MESSAGES, "the writes went on")
        serving.cancel()

    asyncio.run(main())


def test_chunks_the_router_has_not_taken_join_in_the_outbox_in_their_order() -> None:
    async def main() -> None:
        held = Held()
        wrote = asyncio.Event()

        async def write_four(request, context: StreamedContext) -> None:
            await context.write(chunk(0))  # NOTE: taken at once: the writer then waits
            await until(lambda: len(held.messages) == 2, "the first went")
            scored = chunk(3)
            scored.chunk.logprobs.logprobs.append(-0.5)
            for response in (chunk(1, "b"), chunk(2, "c"), scored, chunk(4, "e"), FINAL):
                await context.write(response)
            wrote.set()

        serving = asyncio.create_task(StreamedCalls(write_four, held).serve(one_call()))
        await asyncio.wait_for(wrote.wait(), WAIT_S)
        held.go.set()
        await until(lambda: len(held.messages) == 3, "the rest went")
        rest = [r.response for r in held.messages[2].responses if r.HasField("response")]
        assert [list(r.chunk.token_ids) for r in rest[:3]] == [[1, 2], [3], [4]]
        assert rest[0].chunk.text == "bc" and rest[0].chunk.num_pending_text_tokens == 2
        assert list(rest[1].chunk.logprobs.logprobs) == [-0.5]
        assert rest[3].HasField("final") and len(rest) == 4
        serving.cancel()

    asyncio.run(main())


def test_a_worker_without_streams_is_asked_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        worker = Worker(streams=False)
        async with connected(worker) as (_, _, _, streams):
            first = streams.generate(request("burst", 2))
            assert len(await asyncio.wait_for(read_all(first), WAIT_S)) == 3
            assert worker.generate_calls == 1
            worker.streams = True  # NOTE: upgraded in place: same address, same id
            again = streams.generate(request("burst", 2))  # within REPROBE_S: a Generate
            assert len(await asyncio.wait_for(read_all(again), WAIT_S)) == 3
            assert worker.generate_calls == 2
            monkeypatch.setattr(worker_streams, "REPROBE_S", 0.0)
            later = streams.generate(request("burst", 2))
            assert len(await asyncio.wait_for(read_all(later), WAIT_S)) == 3
            assert worker.generate_calls == 2 and len(worker.open_streams) == 1

    asyncio.run(main())


def test_the_first_calls_to_a_worker_go_alone_and_the_stream_takes_them_from_a_few_on() -> None:
    async def main() -> None:
        worker = Worker()
        async with connected(worker) as (_, _, channel, _):
            streams = WorkerStreams(worker_pb2_grpc.WorkerStub(channel), "w2", streams_from=3)
            calls = [streams.generate(request("hang", request_id=f"r{i}")) for i in range(3)]
            await until(lambda: worker.started == 3, "the calls run")
            assert worker.generate_calls == 2 and len(worker.open_streams) == 1
            calls[0].cancel()  # NOTE: two alone end: 1 runs, the next goes alone again
            calls[1].cancel()
            await until(lambda: streams._num_alone == 0, "the ended calls no longer count")
            streams.generate(request("hang", request_id="r3"))
            await until(lambda: worker.started == 4, "the fourth runs")
            assert worker.generate_calls == 3
            for call in calls:
                call.cancel()
            await streams.close()

    asyncio.run(main())
