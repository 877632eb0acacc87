"""Publishes a worker's cache events to the global block-hash index, off the hot path.

The engine client only appends numbered event batches, as the engine core sends them, to its
buffer; this publisher, a task on the server's event loop, takes them in order and applies them
to the index.
Whenever the index cannot be trusted to hold the worker's exact set (first start, a lost batch,
a lapsed registration, a Redis restart), it registers again and resyncs from a snapshot::

    connect -> register -> resync(snapshot) -> loop: apply batches / heartbeat
                  ^                                   |
                  +---- UNKNOWN_WORKER, NEEDS_RESYNC, connection errors (after a backoff)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass
from typing import Protocol

from kvswitch.cache_index.index import ApplyStatus, BlockIndex, WorkerInfo
from kvswitch.serving import end_if_cancelled

logger = logging.getLogger(__name__)


class EventSource(Protocol):
    """What the publisher reads from a worker (``EngineClient`` is one)."""

    def take_cache_events(self) -> list: ...  # EventBatch(seq, events), oldest first

    def snapshot(self): ...  # a concurrent Future of (event_seq, cached block hashes)

    # Optional: ``on_events(callback)`` calls ``callback()`` (on any thread) whenever a batch is
    # buffered; a source that has it is published at once instead of every ``interval_s``.


@dataclass(frozen=True)
class PublisherConfig:
    interval_s: float = 0.02  # how often to look for new event batches (without on_events)
    heartbeat_s: float = 1.0
    ttl_s: float = 5.0  # a registration lapses this long after the last heartbeat

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= self.heartbeat_s < self.ttl_s:
            raise ValueError(
                "publisher timings must satisfy 0 < interval_s <= heartbeat_s < ttl_s, got "
                f"{self.interval_s}, {self.heartbeat_s}, {self.ttl_s}"
            )


@dataclass
class Backoff:
    """Exponential backoff with jitter between reconnection attempts."""

    initial_s: float = 0.05
    # NOTE: the index is rebuilt at most this long after it comes back; with 5 s, a Redis down
    # for 10 s was rebuilt up to 5.7 s after (docs/RELIABILITY.md). A try is one connection
    # attempt, cheap for the server even from many workers.
    max_s: float = 1.0
    attempt: int = 0

    def next_delay_s(self) -> float:
        delay = min(self.max_s, self.initial_s * 2**self.attempt)
        self.attempt += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.attempt = 0


class EventPublisher:
    def __init__(
        self,
        index: BlockIndex,
        source: EventSource,
        info: WorkerInfo,
        config: PublisherConfig | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.index = index
        self.source = source
        self.info = info
        self.config = config or PublisherConfig()
        self.backoff = backoff or Backoff()
        self.num_resyncs = 0
        self.num_errors = 0  # failed rounds, each followed by a resync
        self._synced = False  # the index holds exactly our set as of the last applied batch
        self._task: asyncio.Task | None = None
        self._arrived: asyncio.Event | None = None  # set when the source says a batch is in

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        on_events = getattr(self.source, "on_events", None)
        if on_events is not None:
            # NOTE: a second router reading the index sees a worker's blocks a moment after
            # the step that cached them, not up to a polling interval later.
            arrived = self._arrived = asyncio.Event()

            def wake() -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to wake
                    loop.call_soon_threadsafe(arrived.set)

            on_events(wake)
        self._task = loop.create_task(self.run(), name="event-publisher")

    async def stop(self) -> None:
        """Stop publishing and remove this worker from the index (best effort)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.index.deregister(self.info.worker_id)
        except self.index.unavailable_errors as e:  # the index may be the thing that is down
            logger.warning("could not deregister %s from the index: %s", self.info.worker_id, e)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_heartbeat = 0.0
        while True:
            try:
                if not self._synced:
                    await self._register_and_resync()
                    next_heartbeat = loop.time() + self.config.heartbeat_s
                await self.publish_pending()
                if loop.time() >= next_heartbeat and self._synced:
                    if not await self.index.heartbeat(self.info.worker_id, self.config.ttl_s):
                        self._synced = False
                    next_heartbeat = loop.time() + self.config.heartbeat_s
                self.backoff.reset()
                await self._wait_for_events(next_heartbeat - loop.time())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # NOTE: the index being down (refused, restarting, timing out) is expected; any
                # other error is a bug and logged with its traceback. Either way the publisher
                # goes on from a resync: one that stopped would leave the index stale unseen.
                end_if_cancelled()  # unless the error was this loop's own stop, swallowed
                self.num_errors += 1
                self._synced = False
                delay_s = self.backoff.next_delay_s()
                if isinstance(e, self.index.unavailable_errors):
                    logger.warning("index unavailable (%s); retrying in %.2fs", e, delay_s)
                else:
                    logger.exception("publishing cache events failed; resyncing in %.2fs", delay_s)
                await asyncio.sleep(delay_s)

    async def _wait_for_events(self, until_heartbeat_s: float) -> None:
        """Until the source says a batch is in (or the next heartbeat is due); without
        ``on_events``, one polling interval."""
        if self._arrived is None:
            await asyncio.sleep(self.config.interval_s)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(until_heartbeat_s, 0.0)):
                await self._arrived.wait()
        self._arrived.clear()

    async def publish_pending(self) -> None:
        """Apply every buffered batch, in order; on any doubt, fall back to a resync."""
        for batch in self.source.take_cache_events():
            if not self._synced:
                break  # a resync below covers this batch and the ones after it
            status = await self.index.apply(self.info.worker_id, batch.seq, batch.events)
            if status in (ApplyStatus.NEEDS_RESYNC, ApplyStatus.UNKNOWN_WORKER):
                logger.info("index says %s for batch %d: resyncing", status.value, batch.seq)
                self._synced = False
        if not self._synced:
            await self._register_and_resync()

    async def _register_and_resync(self) -> None:
        await self.index.register(self.info, self.config.ttl_s)
        seq, block_hashes = await asyncio.wrap_future(self.source.snapshot())
        await self.index.resync(self.info.worker_id, seq, block_hashes)
        self.num_resyncs += 1
        self._synced = True
