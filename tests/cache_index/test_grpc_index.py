"""What only the gRPC-served index has: status codes for bad input, chunked snapshots, its URL,
and a worker publishing to a router's embedded index through it. The shared behaviour is in
test_index_contract.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.events import BlockStored
from kvswitch.cache_index.grpc_index import HASHES_PER_CHUNK, GrpcIndex
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import ApplyStatus, WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.v1 import index_pb2, index_pb2_grpc
from kvswitch.worker.publisher import Backoff, EventPublisher
from tests.cache_index.conftest import ServedIndex
from tests.worker.test_publisher import FAST, generate, index_matches_worker, start_engine

NS = "model-a"
TTL_S = 30.0
CHAIN = hash_prompt_blocks(list(range(32)), 4, NS)  # 8 blocks
WORKER = WorkerInfo("w", "127.0.0.1:50051", NS, 4, "both", 64, 256)


def many_hashes(n: int) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(n)]


def run(body: Callable[[ServedIndex], Awaitable[None]]) -> None:
    """Run ``body`` with a fresh served index (a client whose ``served`` is the server's)."""

    async def main() -> None:
        index = await ServedIndex.start()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())


def stored(hashes: list[bytes]) -> index_pb2.CacheEvent:
    return index_pb2.CacheEvent(stored=index_pb2.BlockStored(block_hashes=hashes))


def test_bad_input_is_invalid_argument() -> None:
    async def body(index: ServedIndex) -> None:
        await index.register(WORKER, TTL_S)
        async with grpc.aio.insecure_channel(index.target) as channel:
            stub = index_pb2_grpc.CacheIndexStub(channel)

            async def status_of(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call
                return error.value.code(), error.value.details()

            invalid = grpc.StatusCode.INVALID_ARGUMENT
            match = stub.Match(index_pb2.MatchRequest(namespace=NS, block_hashes=[b"short"]))
            assert await status_of(match) == (
                invalid,
                "Match.block_hashes: block hashes are 16 bytes each, got one of 5",
            )
            bad_hash = stored([CHAIN[0], b"short"])
            apply = stub.Apply(index_pb2.ApplyRequest(worker_id="w", seq=1, events=[bad_hash]))
            assert await status_of(apply) == (
                invalid,
                "BlockStored.block_hashes: block hashes are 16 bytes each, got one of 5",
            )
            no_kind = index_pb2.ApplyRequest(worker_id="w", seq=1, events=[index_pb2.CacheEvent()])
            assert await status_of(stub.Apply(no_kind)) == (
                invalid,
                "a CacheEvent must set one of stored, removed or cleared",
            )
            register = stub.Register(index_pb2.RegisterRequest(ttl_s=TTL_S))
            assert await status_of(register) == (invalid, "worker_id must not be empty")
            chunks = [
                index_pb2.ResyncChunk(worker_id="w", seq=1, block_hashes=CHAIN[:4]),
                index_pb2.ResyncChunk(worker_id="w", seq=2, block_hashes=CHAIN[4:]),
            ]
            assert await status_of(stub.Resync(iter(chunks))) == (
                invalid,
                "every ResyncChunk of a stream must repeat its worker_id and seq",
            )
            assert await status_of(stub.Resync(iter([]))) == (
                invalid,
                "a Resync stream must send at least one ResyncChunk",
            )
        # Nothing bad was applied: the worker is still at batch 0, with nothing.
        assert await index.served.apply("w", 1, []) is ApplyStatus.APPLIED
        assert await index.served.worker_block_hashes("w") == set()

    run(body)


def test_the_client_raises_what_the_other_backends_raise() -> None:
    async def body(index: ServedIndex) -> None:
        with pytest.raises(ValueError, match="ttl_s must be positive, got 0"):
            await index.register(WORKER, 0)
        await index.register(WORKER, TTL_S)
        with pytest.raises(ValueError, match="16 bytes each, got one of 5"):
            await index.match(NS, [CHAIN[0], b"short"])
        with pytest.raises(ValueError, match="start at 1, got 0"):
            await index.apply("w", 0, [])
        with pytest.raises(ValueError, match="must be >= 0, got -1"):
            await index.resync("w", -1, CHAIN)
        with pytest.raises(KeyError, match="'ghost' is not registered"):
            await index.resync("ghost", 1, CHAIN)

    run(body)


def test_every_event_field_crosses_the_wire() -> None:
    class Recording(MemoryIndex):
        async def apply(self, worker_id, seq, events):
            self.events = list(events)
            return await super().apply(worker_id, seq, events)

    events = [
        BlockStored(tuple(CHAIN[:2])),
        BlockStored(tuple(CHAIN[2:3])),
    ]

    async def main() -> None:
        index = await ServedIndex.start(Recording())
        try:
            await index.register(WORKER, TTL_S)
            assert await index.apply("w", 1, events) is ApplyStatus.APPLIED
            assert index.served.events == events
        finally:
            await index.close()

    asyncio.run(main())


def test_a_snapshot_larger_than_one_message_goes_in_chunks() -> None:
    hashes = many_hashes(4 * HASHES_PER_CHUNK + 1)  # 4.5 MiB of hashes, over gRPC's 4 MiB

    async def body(index: ServedIndex) -> None:
        await index.register(WORKER, TTL_S)
        async with grpc.aio.insecure_channel(index.target) as channel:
            whole = index_pb2.ResyncChunk(worker_id="w", seq=3, block_hashes=hashes)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await index_pb2_grpc.CacheIndexStub(channel).Resync(iter([whole]))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await index.resync("w", 3, hashes)
        assert await index.served.worker_block_hashes("w") == set(hashes)
        assert await index.worker_block_hashes("w") == set(hashes)
        assert await index.match(NS, hashes[:5]) == {"w": 5}
        assert await index.apply("w", 4, []) is ApplyStatus.APPLIED

    run(body)


def test_connect_index_opens_a_grpc_url() -> None:
    async def main() -> None:
        served = await ServedIndex.start()
        index = await connect_index(f"grpc://{served.target}")
        try:
            assert isinstance(index, GrpcIndex)
            await index.register(WORKER, TTL_S)
            assert await served.served.live_workers() == [WORKER]
            with pytest.raises(ValueError, match="names no server"):
                await connect_index("grpc://")
        finally:
            await index.close()
            await served.close()

    asyncio.run(main())


def test_a_server_that_is_down_is_a_connection_error() -> None:
    async def main() -> None:
        served = await ServedIndex.start()
        await served.close()  # the port is free again
        with pytest.raises(ConnectionError, match=f"no block index answered at {served.target}"):
            await GrpcIndex.connect(served.target, timeout_s=0.2)
        index = GrpcIndex(served.target)
        try:
            with pytest.raises(ConnectionError, match="unavailable"):
                await index.heartbeat("w", TTL_S)
        finally:
            await index.close()

    asyncio.run(main())


def test_a_slow_server_is_a_timeout() -> None:
    class Slow(MemoryIndex):
        async def stats(self):
            await asyncio.sleep(1.0)
            return await super().stats()

    async def main() -> None:
        served = await ServedIndex.start(Slow())
        index = GrpcIndex(served.target, timeout_s=0.1)
        try:
            with pytest.raises(TimeoutError, match="did not answer in time"):
                await index.stats()
        finally:
            await index.close()
            await served.close()

    asyncio.run(main())


def test_a_worker_publishes_to_a_router_embedded_index() -> None:
    """A worker's publisher reaches the router's MemoryIndex through gRPC, and finds it again
    after the router restarts empty on the same port."""
    engine = start_engine()

    async def main() -> None:
        router = await ServedIndex.start()
        index = GrpcIndex(router.target)
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, FAST, Backoff(0.01, 0.05))
        publisher.start()
        prompt = [256, *b"a long shared document " * 4]
        await generate(engine, "r0", prompt)
        await index_matches_worker(router.served, engine)
        chain = hash_prompt_blocks(prompt, 16, engine.namespace)
        assert await router.served.match(engine.namespace, chain) == {"w": len(chain)}

        await router.close()
        while publisher.num_errors == 0:  # ConnectionError: the publisher backs off, retries
            await asyncio.sleep(0.01)
        router = await ServedIndex.start(port=int(router.target.rsplit(":", 1)[1]))
        await generate(engine, "r1", [256, *b"after the restart " * 3])
        await index_matches_worker(router.served, engine)
        await publisher.stop()
        assert await router.served.live_workers() == []
        await index.close()
        await router.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()
