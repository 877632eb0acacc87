"""redis-py clients that do not lose a cancel.

redis-py's asyncio connections wait for each write with ``asyncio.wait_for``. Before Python 3.12
``wait_for`` returns the write's result when a cancel lands in the loop turn between the write's
end and its own wake-up (CPython gh-86296): the cancel is gone, the command goes on and the task
runs as if nobody had cancelled it. A heartbeat loop cancelled at that moment beats forever, and
whoever awaits its end waits forever too. The clients here raise such a cancel as soon as the call
returns: every command (scripts included) through ``execute_command``; a pipeline's ``execute`` is
wrapped by its caller with ``keeping_cancel``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.asyncio import Redis, RedisCluster

T = TypeVar("T")


async def keeping_cancel(call: Awaitable[T]) -> T:
    """``await call``, then raise the cancel it swallowed, if it did.

    A cancel that reached the task while it waited and did not come out as CancelledError was
    swallowed: the task's count of cancel requests grew, and nothing took it back."""
    task = asyncio.current_task()
    assert task is not None, "a redis call runs in a task"
    num_cancels = task.cancelling()
    result = await call
    if task.cancelling() > num_cancels:
        # NOTE: the reply was read, so the connection is clean; the command did run, as it
        # may have when a cancel comes out of any await that sent it.
        raise asyncio.CancelledError("cancelled during a Redis call that lost the cancel")
    return result


class CancelSafeRedis(Redis):
    """``redis.asyncio.Redis`` whose commands raise a cancel that arrived while they ran."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        return await keeping_cancel(super().execute_command(*args, **options))


class CancelSafeRedisCluster(RedisCluster):
    """``redis.asyncio.RedisCluster`` whose commands raise a cancel that arrived while they ran."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await keeping_cancel(super().execute_command(*args, **kwargs))
