"""A vLLM engine's published KV events followed into the index over real ZeroMQ sockets: the
engine side is ``KVEventPublisher``, which speaks vLLM's protocol (PUB with numbered batches,
ROUTER replaying its buffer). Each test checks what the index holds afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable

import pytest

from kvswitch.cache_index.engine_feed import EngineEndpoints, EngineEventFeed, status_line
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import BlockIndex
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.cache_index.vllm_events import (
    EngineAllBlocksCleared,
    EngineBlockNames,
    EngineBlockRemoved,
    EngineBlockStored,
)
from kvswitch.cache_index.vllm_publisher import KVEventPublisher
from tests.cache_index.conftest import MakeIndex

B = 4
MODEL = "Qwen/Qwen3-0.6B"
ENGINE = "vllm-0"


def prompt(tag: int, num_blocks: int = 3) -> list[int]:
    return [tag, *range(1000, 1000 + num_blocks * B - 1)]


def stored(tag: int, first_hash: int, num_blocks: int = 3) -> EngineBlockStored:
    """The engine's event for ``prompt(tag)``, its blocks named first_hash, first_hash + 1, ..."""
    hashes = tuple(range(first_hash, first_hash + num_blocks))
    return EngineBlockStored(hashes, None, tuple(prompt(tag, num_blocks)), B, medium="GPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """A publisher on fixed ports, so that a restarted one is found where the old one was."""

    def __init__(self, buffer_steps: int = 100) -> None:
        self.ports = (free_port(), free_port())
        self.buffer_steps = buffer_steps
        self.publisher = self.start()

    def start(self) -> KVEventPublisher:
        # NOTE: "*" binds (as in vLLM's default endpoint); a host name would connect.
        events, replay = (f"tcp://*:{port}" for port in self.ports)
        self.publisher = KVEventPublisher(events, replay, buffer_steps=self.buffer_steps)
        return self.publisher

    @property
    def endpoints(self) -> EngineEndpoints:
        events, replay = (f"tcp://127.0.0.1:{port}" for port in self.ports)
        return EngineEndpoints(ENGINE, "http://127.0.0.1:8000", events, replay)


async def until(condition: Callable[[], bool], feed: EngineEventFeed | None = None) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {feed.status if feed else ''}"
        await asyncio.sleep(0.005)


async def matched(index: BlockIndex, tag: int) -> int:
    return (await index.match(MODEL, hash_prompt_blocks(prompt(tag), B, MODEL))).get(ENGINE, 0)


@contextlib.asynccontextmanager
async def following(engine: Engine, index: BlockIndex, block_size: int = B):
    feed = EngineEventFeed(engine.endpoints, index, EngineBlockNames(MODEL, block_size))
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.wait_subscribed(), 30)
        assert await asyncio.to_thread(engine.publisher.wait_subscribed)
        yield feed, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_restarted_engine_is_cleared_and_a_lost_batch_replayed(make_index: MakeIndex) -> None:
    """On each index backend: the engine's blocks are matched by the prompts' kvswitch names; a
    batch the feed never received is replayed from the engine's buffer; the engine restarted
    (its batches numbered from 0 again) drops everything it held before."""

    async def main() -> None:
        index, engine = await make_index(), Engine()
        try:
            engine.publisher.publish([stored(1, 100)])  # before the feed: it replays it
            async with following(engine, index) as (feed, _):
                await until(lambda: feed.status.num_batches == 1, feed)
                engine.publisher.lose(1)
                engine.publisher.publish([stored(2, 200)])  # lost on the way
                engine.publisher.publish([stored(3, 300)])
                await until(lambda: feed.status.num_batches == 3, feed)
                assert [await matched(index, tag) for tag in (1, 2, 3)] == [3, 3, 3]
                assert feed.status.num_replays == 2 and not feed.status.degraded

                engine.publisher.close()
                engine.start()  # the same ports, batches from 0 again
                engine.publisher.publish([stored(4, 100)])  # the engine's names mean new blocks
                for _ in range(4):  # numbered past what the feed saw of the old process
                    engine.publisher.publish([EngineBlockRemoved((999,), "GPU")])
                # NOTE: the batches published before the feed reconnects are lost on the way;
                # the first that arrives shows the restart, and the rest come from the replay.
                deadline = time.monotonic() + 30
                while not feed.status.num_restarts:
                    assert time.monotonic() < deadline, f"no restart seen: {feed.status}"
                    engine.publisher.publish([EngineBlockRemoved((999,), "GPU")])
                    await asyncio.sleep(0.05)
                # NOTE: seen, the restart is then rebuilt from the new process's replay.
                while await matched(index, 4) != 3:
                    assert time.monotonic() < deadline, f"not rebuilt: {feed.status}"
                    await asyncio.sleep(0.01)
                assert [await matched(index, tag) for tag in (1, 2, 3, 4)] == [0, 0, 0, 3]
                assert not feed.status.degraded
                assert len(feed.names) == 3
        finally:
            engine.publisher.close()
            await index.close()

    asyncio.run(main())


def test_batches_sent_before_the_subscription_took_are_replayed() -> None:
    """The feed's first replay found nothing; the engine's first batch then went out before it
    heard of the subscription (lost on the way), and the second arrived: the first comes from
    the replay, the feed not degraded."""

    async def main() -> None:
        index, engine = MemoryIndex(), Engine()
        try:
            async with following(engine, index) as (feed, _):
                engine.publisher.lose(1)
                engine.publisher.publish([stored(1, 100)])
                engine.publisher.publish([stored(2, 200)])
                await until(lambda: feed.status.num_batches == 2, feed)
                assert not feed.status.degraded
                assert feed.status.num_replays == 2
                assert [await matched(index, tag) for tag in (1, 2)] == [3, 3]
        finally:
            engine.publisher.close()
            await index.close()

    asyncio.run(main())


def test_removals_and_tiers_reach_the_index() -> None:
    async def main() -> None:
        index, engine = MemoryIndex(), Engine()
        try:
            async with following(engine, index) as (feed, _):
                engine.publisher.publish([stored(1, 100), stored(2, 200)])
                engine.publisher.publish([EngineBlockStored((201, 202), None, (), 0, medium="CPU")])
                engine.publisher.publish([EngineBlockRemoved((102,), "GPU")])
                engine.publisher.publish([EngineBlockRemoved((200, 201, 202), "GPU")])
                await until(lambda: feed.status.num_batches == 4, feed)
                # Prompt 1 lost its last block; prompt 2's first block is gone from every tier
                # (its others, on the CPU tier, cannot be reached without it).
                assert [await matched(index, 1), await matched(index, 2)] == [2, 0]
                assert feed.names.media_of(201) == {"CPU"}
                assert await index.worker_block_hashes(ENGINE) == feed.names.block_names()
        finally:
            engine.publisher.close()
            await index.close()

    asyncio.run(main())


def test_batches_older_than_the_replay_buffer_clear_the_engine_and_mark_it_degraded() -> None:
    """Three batches lost, the engine's buffer holding two: what the index held is dropped (it
    may hold blocks the engine evicted meanwhile) and built again from what arrives, the feed
    degraded, until the engine clears its cache (then nothing unknown is left)."""

    async def main() -> None:
        index, engine = MemoryIndex(), Engine(buffer_steps=2)
        try:
            async with following(engine, index) as (feed, _):
                engine.publisher.publish([stored(1, 100)])
                await until(lambda: feed.status.num_batches == 1, feed)
                engine.publisher.lose(3)
                for tag in (2, 3, 4):
                    engine.publisher.publish([stored(tag, 100 * tag)])
                engine.publisher.publish([stored(5, 500)])
                # Batches 1..3 lost; the buffer holds 3 and 4 (prompts 4 and 5) when 4 arrives.
                await until(lambda: feed.status.num_batches == 3, feed)
                degraded = feed.status.degraded
                assert "batches 1..2 are older than the engine's replay buffer" in degraded
                assert "degraded" in status_line(feed)
                # Registered so: every reader of the index (kvswitch index stats) sees it.
                [info] = await index.live_workers()
                assert info.degraded == degraded
                assert [await matched(index, tag) for tag in (1, 2, 3, 4, 5)] == [0, 0, 0, 3, 3]
                engine.publisher.publish([EngineAllBlocksCleared()])
                engine.publisher.publish([stored(6, 600)])
                await until(lambda: feed.status.num_batches == 5, feed)
                assert not feed.status.degraded
                assert not (await index.live_workers())[0].degraded
                assert [await matched(index, tag) for tag in (5, 6)] == [0, 3]
        finally:
            engine.publisher.close()
            await index.close()

    asyncio.run(main())


def test_an_engine_whose_blocks_are_another_size_is_refused_and_left_out() -> None:
    async def main() -> None:
        index, engine = MemoryIndex(), Engine()
        try:
            async with following(engine, index, block_size=16) as (feed, task):
                engine.publisher.publish([stored(1, 100)])
                await asyncio.wait_for(task, 30)  # the feed stops
                assert "the router's --block-size is 16" in feed.status.failed
                assert "failed" in status_line(feed)
                assert await index.worker_block_hashes(ENGINE) == set()
                # Out of the index: no router sharing it routes there.
                assert await index.live_workers() == []
        finally:
            engine.publisher.close()
            await index.close()

    asyncio.run(main())


@pytest.mark.parametrize(("endpoint", "rank", "expected"), [
    ("tcp://*:5557", 0, "tcp://*:5557"),
    ("tcp://*:5557", 2, "tcp://*:5559"),
    ("inproc://cache", 1, "inproc://cache_dp1"),
])  # fmt: skip
def test_each_data_parallel_rank_publishes_on_its_own_port(
    endpoint: str, rank: int, expected: str
) -> None:
    from kvswitch.cache_index.vllm_publisher import offset_port

    assert offset_port(endpoint, rank) == expected
