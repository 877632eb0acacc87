"""A cancel reaches a task whatever Redis call it is in: a command, a script, a pipeline, a
pub/sub's subscribe, on one Redis and on a cluster (see ``redis_clients``).

Each test starts a call, lets the loop turn 0, 1, 2, ... times, cancels, and expects the task to
end cancelled (or done before the cancel). Before Python 3.12 some of those turns fall between a
write's end and ``asyncio.wait_for``'s wake-up inside redis-py, where a plain client loses the
cancel: the call returns its reply and the task goes on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvswitch.cache_index.connect import pubsub_client
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.redis_clients import keeping_cancel
from kvswitch.cache_index.redis_index import RedisIndex
from tests.cache_index.conftest import unique_prefix

# NOTE: a call's writes end within its first few turns (a local socket takes them at once);
# the wait for the reply then spans as many turns as the machine's speed makes it, so the sweep
# stops here, or where the call ends, whichever comes first.
MAX_TURNS = 40
NS = "model-a"


async def cancels_lost(call: Callable[[], Awaitable[Any]]) -> list[int]:
    """The loop turns after which a cancel of ``call()`` let the task end without it."""
    await call()  # connected, scripts loaded: the later calls take their usual turns
    lost = []
    for num_turns in range(MAX_TURNS):
        task = asyncio.create_task(call())
        for _ in range(num_turns):
            await asyncio.sleep(0)
        if not task.cancel():
            break  # done before the cancel: every later turn is past the call too
        try:
            await task
        except asyncio.CancelledError:
            continue
        lost.append(num_turns)
    return lost


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "cluster"])
def test_a_cancel_ends_a_command_a_script_and_a_pipeline(
    request: pytest.FixtureRequest, cluster: bool
) -> None:
    url = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")

    async def body() -> None:
        index = await RedisIndex.connect(url, prefix=unique_prefix(), cluster=cluster)
        try:
            await index.register(WorkerInfo("w0", "127.0.0.1:1", NS, 4), 30)
            assert await cancels_lost(lambda: index.heartbeat("w0", 30)) == []  # PEXPIRE
            assert await cancels_lost(lambda: index.match(NS, [bytes(16)])) == []  # a script
            assert await cancels_lost(index.live_workers) == []  # a pipeline
        finally:
            await index.close()

    asyncio.run(body())


def test_a_cancel_ends_a_publish_and_a_subscribe(redis_url: str) -> None:
    async def body() -> None:
        client = pubsub_client(redis_url)
        pubsub = client.pubsub()
        try:
            assert await cancels_lost(lambda: client.publish("kvswitch-test", b"x")) == []

            async def subscribe() -> None:
                await keeping_cancel(pubsub.subscribe("kvswitch-test"))

            assert await cancels_lost(subscribe) == []
        finally:
            await pubsub.aclose()
            await client.aclose()

    asyncio.run(body())
