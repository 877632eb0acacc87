"""The event publisher keeps the index equal to the worker's cache, whatever goes missing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
import redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.cache_index.redis_index import RedisIndex
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.publisher import Backoff, EventPublisher, PublisherConfig
from kvswitch.worker.request import SamplingParams
from tests.swallowing import SwallowsCancellationOnce

FAST = PublisherConfig(interval_s=0.01, heartbeat_s=0.05, ttl_s=0.5)


async def generate(engine: EngineClient, request_id: str, prompt: list[int]) -> None:
    queue = await engine.submit(request_id, prompt, SamplingParams(max_tokens=3))
    while not (await queue.get()).finished:
        pass


async def index_matches_worker(index: BlockIndex, engine: EngineClient, timeout_s: float = 5.0):
    """Wait until the index holds exactly the worker's cached hashes."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        _, cached = await asyncio.wrap_future(engine.snapshot())
        matches = await index.match(engine.namespace, cached)
        # Every cached hash is held (a "chain" of all of them matches in full) and nothing else.
        if (
            cached
            and matches.get("w") == len(cached)
            and (await index.stats()).num_entries == len(set(cached))
        ):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"index {matches} never matched {len(cached)} cached blocks")
        await asyncio.sleep(0.02)


def start_engine(num_blocks: int = 64, max_event_batches: int = 10_000) -> EngineClient:
    config = EngineConfig(kv_cache_bytes=num_blocks * (32 << 10))
    return EngineClient.start(config, max_event_batches=max_event_batches)


def test_publisher_follows_the_cache_and_recovers_from_lost_batches() -> None:
    engine = start_engine(num_blocks=24, max_event_batches=1)

    async def main() -> None:
        index = MemoryIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, FAST)
        publisher.start()
        prompt = [256, *b"a long shared document " * 4]
        await generate(engine, "r0", prompt)
        await index_matches_worker(index, engine)
        chain = hash_prompt_blocks(prompt, 16, engine.namespace)
        assert (await index.match(engine.namespace, chain))["w"] == len(chain)
        # Several requests before the publisher looks again: the one-batch buffer drops
        # batches, the publisher sees the gap and resyncs from a snapshot.
        await publisher.stop()
        publisher = EventPublisher(index, engine, info, FAST)
        for i in range(5):
            await generate(engine, f"r{i + 1}", [256, *bytes([66 + i]) * 60])
        resyncs = publisher.num_resyncs
        publisher.start()
        await index_matches_worker(index, engine)
        assert publisher.num_resyncs > resyncs
        await publisher.stop()
        assert await index.live_workers() == []

    try:
        asyncio.run(main())
    finally:
        engine.stop()


class FlakyIndex(MemoryIndex):
    """An index that loses everything and refuses calls for a while, like a restarted Redis."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def apply(self, *args, **kwargs):
        if self.down:
            raise ConnectionError("index down")
        return await super().apply(*args, **kwargs)

    async def heartbeat(self, *args, **kwargs):
        if self.down:
            raise ConnectionError("index down")
        return await super().heartbeat(*args, **kwargs)

    async def register(self, *args, **kwargs):
        if self.down:
            raise ConnectionError("index down")
        return await super().register(*args, **kwargs)


def test_publisher_survives_an_index_restart() -> None:
    engine = start_engine()

    async def main() -> None:
        index = FlakyIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, FAST, Backoff(0.01, 0.05))
        publisher.start()
        await generate(engine, "r0", [256, *b"before the restart " * 3])
        await index_matches_worker(index, engine)
        index.down = True
        await index.deregister("w")  # the restarted index starts empty
        await generate(engine, "r1", [256, *b"while it was down " * 3])
        await asyncio.sleep(0.2)
        assert publisher.num_errors > 0
        index.down = False
        await generate(engine, "r2", [256, *b"after the restart " * 3])
        await index_matches_worker(index, engine)
        await publisher.stop()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


class BuggyIndex(MemoryIndex):
    """An index whose apply has a bug that shows once: not an outage, an unexpected error."""

    def __init__(self) -> None:
        super().__init__()
        self.num_bugs = 1

    async def apply(self, *args, **kwargs):
        if self.num_bugs:
            self.num_bugs -= 1
            raise TypeError("a bug, not an outage")
        return await super().apply(*args, **kwargs)


def test_an_unexpected_error_is_logged_with_its_traceback_and_publishing_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = start_engine()

    async def main() -> None:
        index = BuggyIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, FAST, Backoff(0.01, 0.05))
        publisher.start()
        while publisher.num_resyncs == 0:  # registered: the blocks below go through apply
            await asyncio.sleep(0.01)
        await generate(engine, "r0", [256, *b"a bug shows up here " * 3])
        await index_matches_worker(index, engine)
        assert index.num_bugs == 0 and publisher.num_errors == 1
        assert publisher.num_resyncs == 2  # the first registration, and the one after the bug
        await publisher.stop()

    try:
        with caplog.at_level(logging.WARNING, logger="kvswitch.worker.publisher"):
            asyncio.run(main())
    finally:
        engine.stop()
    (record,) = [r for r in caplog.records if "publishing cache events failed" in r.message]
    assert record.levelno == logging.ERROR and record.exc_info[0] is TypeError


class SwallowingIndex(MemoryIndex):
    """An index whose heartbeat hangs and turns the caller's cancellation into ``error`` (an
    outage), or into a heartbeat that went through (``error`` None)."""

    def __init__(self, error: Exception | None) -> None:
        super().__init__()
        self.hang = SwallowsCancellationOnce(error)

    async def heartbeat(self, *args, **kwargs):
        await self.hang()
        return await super().heartbeat(*args, **kwargs)


@pytest.mark.parametrize(
    "error", [ConnectionError("the cancellation, made an outage"), None], ids=["error", "whole"]
)
def test_stop_ends_the_publisher_even_if_an_index_call_swallows_the_cancellation(
    error: Exception | None,
) -> None:
    engine = start_engine()

    async def main() -> None:
        index = SwallowingIndex(error)
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, FAST, Backoff(0.01, 0.05))
        publisher.start()
        await asyncio.wait_for(index.hang.entered.wait(), 5)
        await asyncio.wait_for(publisher.stop(), 2)  # it hung here, retrying forever
        assert publisher.num_errors == 0  # the stop was taken for a stop, not an outage
        assert await index.live_workers() == []

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_publisher_config_is_checked() -> None:
    with pytest.raises(ValueError, match="interval_s <= heartbeat_s < ttl_s"):
        PublisherConfig(interval_s=1.0, heartbeat_s=0.5, ttl_s=2.0)
    backoff = Backoff(initial_s=0.1, max_s=0.3)
    delays = [backoff.next_delay_s() for _ in range(5)]
    assert all(0.05 <= d <= 0.3 for d in delays)
    assert max(delays[3:]) <= 0.3
    backoff.reset()
    assert backoff.next_delay_s() <= 0.1


def test_a_lost_batch_or_a_forgotten_worker_triggers_a_resync() -> None:
    engine = start_engine()

    async def main() -> None:
        index = MemoryIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        # NOTE: not started, so nothing heartbeats: a TTL no machine outlasts here, so that only
        # the deregister below makes the index forget the worker.
        unhurried = PublisherConfig(interval_s=0.01, heartbeat_s=0.05, ttl_s=600.0)
        publisher = EventPublisher(index, engine, info, unhurried)
        await publisher.publish_pending()  # not synced yet: registers and resyncs
        assert publisher.num_resyncs == 1
        await generate(engine, "r1", [256, *b"first document " * 4])
        engine.take_cache_events()  # this batch never reaches the index
        await generate(engine, "r2", [256, *b"second document " * 4])
        await publisher.publish_pending()  # the next batch shows a gap
        assert publisher.num_resyncs == 2
        assert publisher.num_registers == 1  # a gap needs a resync, not a new registration
        await index_matches_worker(index, engine, timeout_s=0.5)
        await index.deregister("w")  # e.g. its registration lapsed
        await generate(engine, "r3", [256, *b"third document " * 4])
        await publisher.publish_pending()  # UNKNOWN_WORKER: register again, resync
        assert publisher.num_resyncs == 3 and publisher.num_registers == 2
        await index_matches_worker(index, engine, timeout_s=0.5)

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_cache_events_are_published_when_they_arrive_not_at_the_next_poll() -> None:
    engine = start_engine()
    # Polling alone would take up to a second to publish: the engine's events must wake it.
    slow = PublisherConfig(interval_s=1.0, heartbeat_s=1.0, ttl_s=5.0)

    async def main() -> None:
        index = MemoryIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, slow)
        publisher.start()
        await asyncio.sleep(0.05)  # registered and resynced (empty)
        prompt = [256, *b"published at once " * 4]
        await generate(engine, "r1", prompt)
        chain = hash_prompt_blocks(prompt, 16, engine.namespace)
        deadline = asyncio.get_running_loop().time() + 0.3
        while (await index.match(engine.namespace, chain)).get("w") != len(chain):
            assert asyncio.get_running_loop().time() < deadline, "published only at a poll"
            await asyncio.sleep(0.01)
        await publisher.stop()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


class TimingOutIndex(MemoryIndex):
    """An index whose next ``num_timeouts`` applies time out: the first after it applied the
    batch (its answer was lost on the way), the others before."""

    def __init__(self) -> None:
        super().__init__()
        self.num_timeouts = 0
        self.timed_out = asyncio.Event()  # all of them
        self.answered = asyncio.Event()  # an apply went through since
        self.answers: list[tuple[int, ApplyStatus]] = []

    def time_out(self, num_timeouts: int) -> None:
        self.num_timeouts, self.lose_answer = num_timeouts, True

    async def apply(self, worker_id, seq, events):
        if self.num_timeouts:
            self.num_timeouts -= 1
            if self.lose_answer:
                self.lose_answer = False
                await super().apply(worker_id, seq, events)
            if not self.num_timeouts:
                self.timed_out.set()
            raise TimeoutError("the index did not answer in time")
        status = await super().apply(worker_id, seq, events)
        self.answers.append((seq, status))
        self.answered.set()
        return status


def test_a_failed_round_tries_the_same_batch_again_and_never_resyncs() -> None:
    engine = start_engine()

    async def main() -> None:
        index = TimingOutIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        steady = PublisherConfig(interval_s=0.01, heartbeat_s=0.05, ttl_s=30.0)
        publisher = EventPublisher(index, engine, info, steady, Backoff(0.01, 0.05))
        await publisher.publish_pending()
        index.time_out(3)
        publisher.start()
        await generate(engine, "r1", [256, *b"a slow index " * 5])
        await asyncio.wait_for(index.timed_out.wait(), 5)
        await asyncio.wait_for(index.answered.wait(), 5)
        await index_matches_worker(index, engine)
        assert publisher.num_errors == 3
        # One registration and one snapshot, however many calls failed: each failed round
        # registered and resynced again before.
        assert publisher.num_registers == 1 and publisher.num_resyncs == 1
        # The batch whose answer was lost came again, and the index knew it had it.
        (seq, first), *rest = index.answers
        assert first is ApplyStatus.DUPLICATE
        assert [s for s, _ in rest] == list(range(seq + 1, seq + 1 + len(rest)))
        assert all(status is ApplyStatus.APPLIED for _, status in rest)
        await publisher.stop()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


class StallingIndex(MemoryIndex):
    """An index whose applies stall until released, counting the heartbeats it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.stalled = asyncio.Event()
        self.num_heartbeats = 0
        self.beats = asyncio.Condition()

    async def apply(self, *args, **kwargs):
        self.stalled.set()
        await self.release.wait()
        return await super().apply(*args, **kwargs)

    async def heartbeat(self, *args, **kwargs):
        alive = await super().heartbeat(*args, **kwargs)
        async with self.beats:
            self.num_heartbeats += alive
            self.beats.notify_all()
        return alive


def test_a_stalled_index_write_never_lets_the_registration_lapse() -> None:
    engine = start_engine()

    async def main() -> None:
        index = StallingIndex()
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        # NOTE: a TTL of 20 heartbeats, so that a loaded machine's scheduling does not lapse it.
        config = PublisherConfig(interval_s=0.01, heartbeat_s=0.05, ttl_s=1.0)
        publisher = EventPublisher(index, engine, info, config)
        publisher.start()
        await generate(engine, "r1", [256, *b"stalls the index " * 4])
        await asyncio.wait_for(index.stalled.wait(), 5)
        # Heartbeats go on while the write stalls, for longer than the TTL ...
        num_beats = index.num_heartbeats + round(2 * config.ttl_s / config.heartbeat_s)
        async with index.beats:
            await asyncio.wait_for(
                index.beats.wait_for(lambda: index.num_heartbeats >= num_beats), 10
            )
        assert [w.worker_id for w in await index.live_workers()] == ["w"]  # ... and it lives
        index.release.set()
        await index_matches_worker(index, engine)
        assert publisher.num_registers == 1 and publisher.num_resyncs == 1
        await publisher.stop()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


async def until_busy(admin: redis.Redis, timeout_s: float = 60.0) -> None:
    """Until a script holds the Redis busy: it answers BUSY to everyone else."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.ping()
        except redis.exceptions.BusyLoadingError:
            return
        except redis.exceptions.ResponseError as e:
            if str(e).startswith("BUSY"):
                return
            raise
        assert time.monotonic() < deadline, "the script never started"
        await asyncio.sleep(0.01)


def test_a_busy_redis_makes_no_worker_register_or_resync_again() -> None:
    """A script holds a real Redis busy (it answers everyone else BUSY): the publisher's calls
    fail and are tried again, and once it is free the same registration goes on with the same
    batches. Before, each failed round registered again and resent every block."""
    engine = start_engine()
    steady = PublisherConfig(interval_s=0.01, heartbeat_s=0.05, ttl_s=30.0)

    async def main(server: LocalRedis) -> None:
        index = await RedisIndex.connect(server.url, prefix="busy", retry=Retry(NoBackoff(), 0))
        info = WorkerInfo("w", "127.0.0.1:1", engine.namespace, 16)
        publisher = EventPublisher(index, engine, info, steady, Backoff(0.01, 0.05))
        publisher.start()
        await generate(engine, "r0", [256, *b"before it is busy " * 4])
        await index_matches_worker(index, engine)
        with redis.Redis(port=server.port) as admin:
            admin.config_set("busy-reply-threshold", 10)

            def hold_busy() -> None:
                with redis.Redis(port=server.port) as client:
                    client.eval("while true do end", 0)  # until SCRIPT KILL

            num_errors = publisher.num_errors
            busy = asyncio.get_running_loop().run_in_executor(None, hold_busy)
            try:
                await until_busy(admin)
                await generate(engine, "r1", [256, *b"while it is busy " * 4])
                deadline = time.monotonic() + 60
                while publisher.num_errors < num_errors + 3:  # its calls are answered BUSY
                    assert time.monotonic() < deadline, "no call was answered BUSY"
                    await asyncio.sleep(0.01)
            finally:
                # NOTE: also when the test fails: a script left running holds the executor's
                # thread, and asyncio.run waits for that thread for ever.
                with contextlib.suppress(redis.exceptions.ResponseError):
                    admin.script_kill()
        with pytest.raises(redis.exceptions.ResponseError, match="killed"):
            await asyncio.wait_for(busy, 60)
        await index_matches_worker(index, engine)
        assert publisher.num_registers == 1 and publisher.num_resyncs == 1
        await publisher.stop()
        await index.close()

    try:
        with LocalRedis() as server:
            asyncio.run(main(server))
    finally:
        engine.stop()
