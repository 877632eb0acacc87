"""The router's own load accounting: what it sent a worker weighs on it until it is done."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest

from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.router.policy import CostPolicy, RouteRequest
from kvswitch.router.server import RouterConfig
from kvswitch.router.workers import DirectoryConfig, WorkerDirectory
from kvswitch.serving import KEEPALIVE_SERVER_OPTIONS
from kvswitch.v1 import worker_pb2, worker_pb2_grpc
from tests.swallowing import SwallowsCancellationOnce


async def directory_of(*worker_ids: str) -> WorkerDirectory:
    index = MemoryIndex()
    for k, worker_id in enumerate(worker_ids):
        info = WorkerInfo(worker_id, f"127.0.0.1:{k + 1}", "m", 16, num_blocks=64)
        await index.register(info, ttl_s=60)
    directory = WorkerDirectory(index)
    await directory.refresh()  # channels are lazy: nothing is dialled
    return directory


def test_a_request_weighs_on_its_worker_until_it_is_done() -> None:
    async def main() -> None:
        directory = await directory_of("a")
        [handle] = directory.handles()
        flight = directory.begin(handle, num_prefill_tokens=300, num_output_tokens=20)
        assert (handle.num_in_flight, handle.num_outstanding_tokens()) == (1, 320)
        directory.first_token(flight)  # prefilled
        assert handle.num_outstanding_tokens() == 20
        directory.produced(flight, 5)
        assert handle.num_outstanding_tokens() == 15
        # Another router's work, seen in the worker's report, counts when it is larger.
        handle.load = worker_pb2.WorkerLoad(num_queued_prefill_tokens=100)
        assert handle.num_outstanding_tokens() == 115
        directory.finish(flight)
        directory.finish(flight)  # twice is once
        assert (handle.num_in_flight, handle.num_outstanding_tokens()) == (0, 100)
        await directory.stop()

    asyncio.run(main())


def test_a_burst_of_new_prompts_avoids_the_busy_worker() -> None:
    """Before any load report shows it, the long request sent to ``a`` keeps new work off it."""

    async def main() -> None:
        directory = await directory_of("a", "b")
        handles = {h.worker_id: h for h in directory.handles()}
        directory.begin(handles["a"], num_prefill_tokens=4000, num_output_tokens=16)
        policy = CostPolicy()
        request = RouteRequest(num_prompt_tokens=500, block_size=16)
        for _ in range(3):
            states = [h.state(num_matched_blocks=0) for h in directory.routable()]
            decision = policy.choose(request, states)
            assert decision.worker_id == "b"
            directory.begin(handles["b"], num_prefill_tokens=500, num_output_tokens=16)
        await directory.stop()

    asyncio.run(main())


def test_prefill_a_request_shares_is_not_charged_to_it_twice() -> None:
    """``a`` is prefilling a 4,000-token document for one request; the next request on the same
    document would reuse that prefill there, but pay all of it on idle ``b``."""

    async def main() -> None:
        directory = await directory_of("a", "b")
        handles = {h.worker_id: h for h in directory.handles()}
        directory.begin(handles["a"], num_prefill_tokens=4016, num_output_tokens=16)
        assert handles["a"].num_outstanding_tokens(num_shared_prefill_tokens=4000) == 32
        # Never below what is still owed: shared tokens beyond the queued prefill count as 0.
        assert handles["a"].num_outstanding_tokens(num_shared_prefill_tokens=9000) == 16
        request = RouteRequest(num_prompt_tokens=4016, block_size=16)
        states = [
            handles["a"].state(num_matched_blocks=250, num_shared_prefill_tokens=4000),
            handles["b"].state(num_matched_blocks=0),
        ]
        assert CostPolicy().choose(request, states).worker_id == "a"
        await directory.stop()

    asyncio.run(main())


def test_a_failed_worker_is_left_out_for_a_while() -> None:
    async def main() -> None:
        now = [0.0]
        index = MemoryIndex()
        for worker_id in ("a", "b"):
            await index.register(WorkerInfo(worker_id, "127.0.0.1:1", "m", 16), ttl_s=60)
        directory = WorkerDirectory(index, DirectoryConfig(down_s=1.0), clock=lambda: now[0])
        await directory.refresh()
        [a] = [h for h in directory.handles() if h.worker_id == "a"]
        directory.mark_down(a)
        assert [h.worker_id for h in directory.routable()] == ["b"]
        assert [h.worker_id for h in directory.routable(exclude={"b"})] == []
        now[0] = 1.0
        assert sorted(h.worker_id for h in directory.routable()) == ["a", "b"]
        await directory.stop()

    asyncio.run(main())


def test_a_loop_waiting_for_changes_stops_when_cancelled_as_a_change_comes() -> None:
    """A cancellation that arrives together with a change must still end the waiting loop: the
    router's health loop waits like this, and its shutdown awaits it (Python 3.11's wait_for
    lost such a cancellation, and the router never stopped)."""

    async def main() -> None:
        directory = WorkerDirectory(MemoryIndex(), DirectoryConfig())
        for _ in range(20):
            rounds = 0

            async def watch() -> None:
                nonlocal rounds
                while True:
                    await directory.wait_for_change(60)
                    rounds += 1

            task = asyncio.create_task(watch())
            await asyncio.sleep(0)  # it waits now
            directory._signal_change()
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2)
            assert done, "the loop went on after its cancellation"
            assert task.cancelled()

    asyncio.run(main())


def test_a_background_loop_stops_even_if_a_round_swallows_its_cancellation() -> None:
    """A round that eats the loop's cancellation (redis-py's timeout can turn one into a
    TimeoutError, which refresh takes for an outage) must not leave the loop running: the
    router's stop awaits it (a CI run hung there)."""

    async def main() -> None:
        directory = WorkerDirectory(MemoryIndex(), DirectoryConfig())
        hang = SwallowsCancellationOnce(TimeoutError("the cancellation, made a timeout"))

        async def swallowing_round() -> None:
            await hang()

        task = asyncio.create_task(directory._every(0.001, swallowing_round))
        await hang.entered.wait()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, "the loop went on after its cancellation"
        assert task.cancelled()

    asyncio.run(main())


def test_a_worker_that_does_not_answer_its_load_poll_is_left_out() -> None:
    """Unreachable (here: nothing listens at its address), it takes no new request until a
    report comes again."""

    async def main() -> None:
        directory = await directory_of("a")
        [a] = directory.handles()
        assert directory.routable() == [a]
        await directory.poll_loads()
        assert directory.routable() == []
        await directory.stop()

    asyncio.run(main())


def test_load_polls_go_on_after_a_worker_leaves_with_a_poll_unanswered() -> None:
    """A stalled worker's registration lapses while its load poll waits for an answer: the
    directory drops it and closes its channel, which cancels that poll. The polling loop must
    go on for the others (it once ended there, and with it every stall's detection)."""
    import grpc

    from kvswitch.v1 import worker_pb2_grpc

    class Silent(worker_pb2_grpc.WorkerServicer):
        async def GetLoad(self, request, context):
            await asyncio.sleep(3600)

    class Answering(worker_pb2_grpc.WorkerServicer):
        async def GetLoad(self, request, context):
            return worker_pb2.WorkerLoad(num_free_blocks=7)

    async def serve(servicer: worker_pb2_grpc.WorkerServicer) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    async def main() -> None:
        (silent, silent_address), (answering, answering_address) = [
            await serve(Silent()),
            await serve(Answering()),
        ]
        index = MemoryIndex()
        await index.register(WorkerInfo("a", silent_address, "m", 16, num_blocks=64), ttl_s=60)
        config = DirectoryConfig(refresh_s=0.02, load_poll_s=0.02, rpc_timeout_s=60)
        directory = WorkerDirectory(index, config)
        await directory.start()
        await asyncio.sleep(0.2)  # a poll of a is under way; it is never answered
        await index.deregister("a")
        await asyncio.sleep(0.2)  # the directory drops a and closes its channel
        await index.register(WorkerInfo("b", answering_address, "m", 16, num_blocks=64), 60)
        deadline_s = asyncio.get_running_loop().time() + 5
        while not (handles := directory.handles()) or handles[0].load is None:
            assert asyncio.get_running_loop().time() < deadline_s, "b's load was never polled"
            await asyncio.sleep(0.02)
        assert [(h.worker_id, h.load.num_free_blocks) for h in handles] == [("b", 7)]
        assert directory.num_loop_errors == 0
        await directory.stop()
        await silent.stop(0)
        await answering.stop(0)

    asyncio.run(main())


async def _serve(servicer: worker_pb2_grpc.WorkerServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=KEEPALIVE_SERVER_OPTIONS)  # the router's pings, as a worker
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class _Refusing(worker_pb2_grpc.WorkerServicer):
    """A worker that answers every load poll with UNAVAILABLE over a sound connection, until
    told to answer."""

    answering = False

    async def GetLoad(self, request, context):
        if not self.answering:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        return worker_pb2.WorkerLoad(num_free_blocks=1)


def test_a_worker_is_lost_after_failed_polls_in_a_row_or_a_refused_connection() -> None:
    """One failed load poll leaves a worker out of routing, but its streams go on (``lost`` stays
    clear) until ``lost_after_failed_polls`` polls failed in a row; an answer in between starts
    the count again. A refused connection (nothing listens: the process is gone) is lost at
    once."""

    async def main() -> None:
        refusing = _Refusing()
        server, address = await _serve(refusing)
        index = MemoryIndex()
        await index.register(WorkerInfo("a", address, "m", 16, num_blocks=64), ttl_s=60)
        await index.register(WorkerInfo("dead", "127.0.0.1:1", "m", 16, num_blocks=64), 60)
        directory = WorkerDirectory(index, DirectoryConfig(lost_after_failed_polls=3))
        await directory.refresh()
        a, dead = sorted(directory.handles(), key=lambda h: h.worker_id)

        def seen() -> tuple[bool, bool, int]:
            return a.lost.is_set(), a.unreachable, a.num_failed_polls

        await directory.poll_loads()
        assert dead.lost.is_set()
        assert not a.lost.is_set(), "one failed poll took a for lost"
        assert seen() == (False, True, 1)
        assert directory.routable() == []
        await directory.poll_loads()
        assert seen() == (False, True, 2)
        refusing.answering = True
        await directory.poll_loads()
        assert seen() == (False, False, 0)
        assert directory.routable() == [a]
        refusing.answering = False
        await directory.poll_loads()
        await directory.poll_loads()
        assert seen() == (False, True, 2)
        await directory.poll_loads()
        assert seen() == (True, True, 3)
        lost = a.lost
        refusing.answering = True
        await directory.poll_loads()
        assert not a.lost.is_set() and lost.is_set()  # a fresh event for the streams to come
        assert directory.routable() == [a]
        await directory.stop()
        await server.stop(0)

    asyncio.run(main())


def test_a_worker_that_left_the_index_before_it_stopped_is_not_taken_for_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopping worker leaves the index, then stops answering: a load poll that fails before
    the next refresh finds it gone, and says so without a warning."""

    async def main() -> None:
        directory = await directory_of("gone")  # nothing listens at its address
        [gone] = directory.handles()
        await directory.index.deregister("gone")
        await directory.poll_loads()
        assert gone.removed and not gone.lost.is_set()
        assert directory.handles() == []
        await directory.stop()

    with caplog.at_level(logging.INFO, logger="kvswitch.router.workers"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "worker gone joined at 127.0.0.1:1 (both)",
        "worker gone left",
    ]


def test_a_black_holed_worker_does_not_hold_up_the_other_workers_load_reports() -> None:
    """``a`` never answers its load poll; ``b`` answers at once. Each worker is polled on its own
    timer, so b's load goes on being refreshed while a's one poll waits (polled in one round for
    all, b's report waited for a's answer: once per ``rpc_timeout_s``)."""

    class BlackHole(worker_pb2_grpc.WorkerServicer):
        def __init__(self) -> None:
            self.num_polls = 0
            self.polled = asyncio.Event()

        async def GetLoad(self, request, context):
            self.num_polls += 1
            self.polled.set()
            await asyncio.sleep(3600)

    class Counting(worker_pb2_grpc.WorkerServicer):
        num_polls = 0

        async def GetLoad(self, request, context):
            self.num_polls += 1
            return worker_pb2.WorkerLoad(num_free_blocks=self.num_polls)

    async def main() -> None:
        black_hole, counting = BlackHole(), Counting()
        (silent, silent_address), (answering, answering_address) = [
            await _serve(black_hole),
            await _serve(counting),
        ]
        index = MemoryIndex()
        await index.register(WorkerInfo("a", silent_address, "m", 16, num_blocks=64), ttl_s=60)
        await index.register(WorkerInfo("b", answering_address, "m", 16, num_blocks=64), 60)
        # NOTE: a's poll waits a minute for its answer; the bounds below are far from both.
        config = DirectoryConfig(refresh_s=60, load_poll_s=0.01, rpc_timeout_s=60)
        directory = WorkerDirectory(index, config)
        await directory.start()
        a, b = sorted(directory.handles(), key=lambda h: h.worker_id)
        await asyncio.wait_for(black_hole.polled.wait(), timeout=10)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                while b.load is None or b.load.num_free_blocks < 20:
                    await asyncio.sleep(0.01)
        assert b.load is not None and b.load.num_free_blocks >= 20, (
            f"b's load was refreshed {counting.num_polls} times while a's poll waited"
        )
        # All of that while a's first poll was still waiting for its answer.
        assert (black_hole.num_polls, a.load, a.num_failed_polls) == (1, None, 0)
        assert directory.num_loop_errors == 0
        await directory.stop()
        await silent.stop(0)
        await answering.stop(0)

    asyncio.run(main())


def test_the_lost_threshold_is_checked() -> None:
    with pytest.raises(ValueError, match="lost_after_failed_polls must be at least 1"):
        DirectoryConfig(lost_after_failed_polls=0)
    with pytest.raises(ValueError, match="lost_after_failed_polls"):
        RouterConfig(lost_after_failed_polls=0)
    assert RouterConfig(lost_after_failed_polls=5).directory_config().lost_after_failed_polls == 5


def test_a_poll_answered_after_a_later_one_does_not_undo_it() -> None:
    """A background poll sent before an adapter's unload, answered after the poll that followed
    the unload (``poll_loads``), must not bring the adapter back into the router's view."""

    class Held(worker_pb2_grpc.WorkerServicer):
        def __init__(self) -> None:
            self.loras = ["a"]  # what the worker serves now
            self.first = asyncio.Event()  # the first poll answers when set
            self.num_polls = 0

        async def GetLoad(self, request, context):
            self.num_polls += 1
            if self.num_polls == 1:
                served = list(self.loras)  # NOTE: read as the poll arrives, answered later
                await self.first.wait()
                return worker_pb2.WorkerLoad(worker_id="w", loras=served)
            return worker_pb2.WorkerLoad(worker_id="w", loras=self.loras)

    async def main() -> None:
        worker = Held()
        server, address = await _serve(worker)
        index = MemoryIndex()
        await index.register(WorkerInfo("w", address, "m", 16), ttl_s=60)
        directory = WorkerDirectory(index)
        await directory.refresh()
        [handle] = directory.handles()
        try:
            stale = asyncio.create_task(directory.poll_loads())
            async with asyncio.timeout(30):
                while worker.num_polls < 1:
                    await asyncio.sleep(0.01)
            worker.loras = []  # the adapter unloaded
            await directory.poll_loads()
            assert handle.load is not None and list(handle.load.loras) == []
            worker.first.set()
            await asyncio.wait_for(stale, 30)
            assert list(handle.load.loras) == []
        finally:
            await directory.stop()
            await server.stop(0)

    asyncio.run(main())
