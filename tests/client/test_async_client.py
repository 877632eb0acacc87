"""``AsyncClient`` against a scripted router over real gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvswitch.client import AsyncClient, Chunk, KvswitchError, KvswitchTimeoutError
from tests.client.scripted_router import (
    EXPECTED,
    EXPECTED_CHUNKS,
    ScriptedRouter,
    free_address,
)


def test_generate_assembles_the_result(router: ScriptedRouter) -> None:
    async def main() -> None:
        async with AsyncClient(router.address, token="s3cret", timeout_s=5.0) as client:
            assert await client.generate("Hello?", request_id="req-1") == EXPECTED

    asyncio.run(main())
    [call] = router.calls
    assert call.request.text == "Hello?"
    assert call.metadata["authorization"] == "Bearer s3cret"
    assert call.time_remaining_s is not None and 4.0 < call.time_remaining_s < 5.1


def test_stream_yields_chunks_in_order_then_the_result(router: ScriptedRouter) -> None:
    async def main() -> None:
        async with AsyncClient(router.address) as client:
            stream = client.stream("Hello?", request_id="req-1")
            with pytest.raises(RuntimeError, match="stream req-1 has not ended"):
                _ = stream.result
            assert [chunk async for chunk in stream] == EXPECTED_CHUNKS
            assert stream.result == EXPECTED

    asyncio.run(main())


def test_unavailable_before_the_first_chunk_is_retried_with_the_same_id(
    router: ScriptedRouter,
) -> None:
    router.script.num_failures = 2

    async def main() -> None:
        async with AsyncClient(router.address, initial_backoff_s=0.01) as client:
            result = await client.generate("a", request_id="req-2")
        assert result.token_ids == EXPECTED.token_ids

    asyncio.run(main())
    assert [call.request.request_id for call in router.calls] == ["req-2"] * 3


def test_no_retry_once_a_chunk_has_arrived(router: ScriptedRouter) -> None:
    router.script.fail_after_chunks = 1
    received: list[Chunk] = []

    async def main() -> None:
        async with AsyncClient(router.address, initial_backoff_s=0.01) as client:
            async for chunk in client.stream("a"):
                received.append(chunk)

    with pytest.raises(KvswitchError) as error:
        asyncio.run(main())
    assert received == EXPECTED_CHUNKS[:1]
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(router.calls) == 1


def test_retries_run_out(router: ScriptedRouter) -> None:
    router.script.num_failures = 100

    async def main() -> None:
        async with AsyncClient(router.address, max_retries=2, initial_backoff_s=0.01) as client:
            await client.generate("a")

    with pytest.raises(KvswitchError) as error:
        asyncio.run(main())
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert error.value.details == "scripted failure 3"
    assert len(router.calls) == 3


def test_invalid_argument_is_not_retried(router: ScriptedRouter) -> None:
    router.script.num_failures = 1
    router.script.failure_code = grpc.StatusCode.INVALID_ARGUMENT

    async def main() -> None:
        async with AsyncClient(router.address, initial_backoff_s=0.01) as client:
            await client.generate("a", request_id="req-5")

    with pytest.raises(KvswitchError) as error:
        asyncio.run(main())
    assert str(error.value) == "request req-5 failed with INVALID_ARGUMENT: scripted failure 1"
    assert len(router.calls) == 1


def test_a_passed_deadline_is_a_timeout_error(router: ScriptedRouter) -> None:
    router.script.hang_after_chunks = 1

    async def main() -> None:
        async with AsyncClient(router.address) as client:
            await client.generate("a", timeout_s=0.3)

    start_s = time.monotonic()
    with pytest.raises(KvswitchTimeoutError) as error:
        asyncio.run(main())
    assert 0.25 < time.monotonic() - start_s < 2.0
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert router.calls[0].cancelled.wait(timeout=60)


async def _break_after_one_chunk(client: AsyncClient) -> None:
    async for _ in client.stream("a"):
        break


async def _close_after_one_chunk(client: AsyncClient) -> None:
    stream = client.stream("a")
    await anext(stream)
    stream.close()
    assert [chunk async for chunk in stream] == []


async def _leave_with_after_one_chunk(client: AsyncClient) -> None:
    async with client.stream("a") as stream:
        await anext(stream)


async def _cancel_the_reading_task(client: AsyncClient) -> None:
    task = asyncio.create_task(client.generate("a"))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    "stop",
    [
        _break_after_one_chunk,
        _close_after_one_chunk,
        _leave_with_after_one_chunk,
        _cancel_the_reading_task,
    ],
)
def test_stopping_a_stream_cancels_the_call(router: ScriptedRouter, stop) -> None:
    router.script.hang_after_chunks = 1

    async def main() -> None:
        async with AsyncClient(router.address) as client:
            await stop(client)
            assert await asyncio.to_thread(router.calls[0].cancelled.wait, 60)
            # The connection still serves the next request.
            router.script.hang_after_chunks = None
            assert (await client.generate("b")).text == "Hello"

    asyncio.run(main())


def test_bad_arguments_fail_before_anything_is_sent(router: ScriptedRouter) -> None:
    async def main() -> None:
        async with AsyncClient(router.address) as client:
            with pytest.raises(ValueError, match="pass exactly one of prompt"):
                client.stream()
            with pytest.raises(ValueError, match="max_tokens must be an int >= 0"):
                await client.generate("a", max_tokens=-1)

    asyncio.run(main())
    assert router.calls == []


def test_wait_until_connected_returns_once_a_router_answers_and_says_when_none_does(
    router: ScriptedRouter,
) -> None:
    async def main() -> None:
        async with AsyncClient(router.address) as client:
            await client.wait_until_connected(5.0)
        async with AsyncClient(free_address()) as client:
            with pytest.raises(ConnectionError, match=r"no router answered at 127\.0\.0\.1:"):
                await client.wait_until_connected(0.3)

    asyncio.run(main())
