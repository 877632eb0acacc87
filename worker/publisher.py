"""Publishes a worker's cache events to the global block-hash index, off the hot path.

The engine client only appends numbered event batches, as the engine core sends them, to its
buffer; this publisher, a task on the server's event loop, takes them in order and applies them
to the index. What it does next depends on what the index answered, not on whether a call
failed::

    start -> register -> resync(snapshot) -> apply batch k, k+1, ...
    a call fails (timeout, refused, BUSY)   -> the same step again after a backoff (a batch is
                                               idempotent by its sequence number)
    NEEDS_RESYNC (a batch was lost)         -> resync
    UNKNOWN_WORKER, a lapsed heartbeat      -> register, then resync (the index restarted or
                                               forgot this worker)

A failed round never re-registers: that deleted the worker's entries and sent them all again,
and on a fleet one slow index turned into every worker resyncing at once. Heartbeats run on a
task of their own, so a slow index write never lets a healthy worker's registration lapse.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

from kvswitch.cache_index.index import ApplyStatus, BlockIndex, WorkerInfo
from kvswitch.serving import cancel_and_wait, end_if_cancelled

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
    """Exponential backoff with jitter between tries of a failed step."""

    initial_s: float = 0.05
    # NOTE: the index is rebuilt at most this long after it comes back; with 5 s, a Redis down
    # for 10 s was rebuilt up to 5.7 s after (docs/RELIABILITY.md). A try is one call, cheap for
    # the server even from many workers.
    max_s: float = 1.0
    attempt: int = 0

    def next_delay_s(self) -> float:
        delay = min(self.max_s, self.initial_s * 2**self.attempt)
        self.attempt += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.attempt = 0


class Sync(enum.Enum):
    """How far the index is known to agree with the worker."""

    UNREGISTERED = "unregistered"  # the index does not know this incarnation: register next
    STALE = "stale"  # registered, but a batch was lost: resync next
    SYNCED = "synced"  # the index holds the worker's set as of the last batch applied


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
        self.num_registers = 0
        self.num_resyncs = 0
        self.num_errors = 0  # failed calls to the index, each tried again after a backoff
        self.sync = Sync.UNREGISTERED
        self._pending: collections.deque = collections.deque()  # batches taken, not yet applied
        self._tasks: list[asyncio.Task] = []
        self._wake: asyncio.Event | None = None  # a batch is in, or the heartbeat needs a register
        self._has_on_events = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake = asyncio.Event()
        on_events = getattr(self.source, "on_events", None)
        self._has_on_events = on_events is not None
        if on_events is not None:
            # NOTE: a second router reading the index sees a worker's blocks a moment after
            # the step that cached them, not up to a polling interval later.
            def on_batch() -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to wake
                    loop.call_soon_threadsafe(wake.set)

            on_events(on_batch)
        self._tasks = [
            loop.create_task(self.run(), name="event-publisher"),
            loop.create_task(self.heartbeat_forever(), name="index-heartbeat"),
        ]

    async def stop(self) -> None:
        """Stop publishing and remove this worker from the index (best effort)."""
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        try:
            await self.index.deregister(self.info.worker_id)
        except self.index.unavailable_errors as e:  # the index may be the thing that is down
            logger.warning("could not deregister %s from the index: %s", self.info.worker_id, e)

    async def run(self) -> None:
        while True:
            try:
                await self.publish_pending()
                self.backoff.reset()
                await self._wait_for_events()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                end_if_cancelled()  # unless the error was this loop's own stop, swallowed
                self.num_errors += 1
                delay_s = self.backoff.next_delay_s()
                if isinstance(e, self.index.unavailable_errors):
                    # NOTE: the index being down, slow or busy is expected: the same step is
                    # tried again, and nothing the index holds is thrown away for it.
                    logger.warning("index unavailable (%s); trying again in %.2fs", e, delay_s)
                else:
                    # A bug, logged with its traceback; the index's state is in doubt, so the
                    # worker starts over from a registration rather than stop publishing.
                    self.sync = Sync.UNREGISTERED
                    message = "publishing cache events failed; registering again in %.2fs"
                    logger.exception(message, delay_s)
                await asyncio.sleep(delay_s)

    async def publish_pending(self) -> None:
        """Bring the index up to date: register or resync if it needs that, then apply every
        buffered batch in order. A call that fails raises, and leaves the step it was on (the
        batch at the head of the queue, the resync, the registration) for the next try."""
        self._pending.extend(self.source.take_cache_events())
        while True:
            if self.sync is Sync.UNREGISTERED:
                self.num_registers += 1
                await self.index.register(self.info, self.config.ttl_s)
                self.sync = Sync.STALE
            if self.sync is Sync.STALE:
                await self._resync()
            while self._pending and self.sync is Sync.SYNCED:
                batch = self._pending[0]
                status = await self.index.apply(self.info.worker_id, batch.seq, batch.events)
                if status is ApplyStatus.NEEDS_RESYNC:
                    logger.info("index says batch %d does not follow: resyncing", batch.seq)
                    self.sync = Sync.STALE
                elif status is ApplyStatus.UNKNOWN_WORKER:
                    logger.info("index does not know this worker (batch %d)", batch.seq)
                    self.sync = Sync.UNREGISTERED
                else:  # APPLIED, or DUPLICATE: an earlier try got through after all
                    self._pending.popleft()
            if self.sync is Sync.SYNCED:
                return

    async def _resync(self) -> None:
        seq, block_hashes = await asyncio.wrap_future(self.source.snapshot())
        try:
            await self.index.resync(self.info.worker_id, seq, block_hashes)
        except KeyError:  # the registration lapsed, or a restarted index forgot it
            self.sync = Sync.UNREGISTERED
            return
        self.num_resyncs += 1
        self.sync = Sync.SYNCED
        # The snapshot covers every batch up to its own sequence number.
        while self._pending and self._pending[0].seq <= seq:
            self._pending.popleft()

    async def heartbeat_forever(self) -> None:
        """Keep the registration alive, on its own timer: however long an index write or a
        resync takes, the worker stays in routing. A heartbeat the index refuses (the
        registration lapsed) makes the publisher register again."""
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.sync is Sync.UNREGISTERED:
                continue  # a registration is on its way, and starts the clock anew
            num_registers = self.num_registers
            try:
                alive = await self.index.heartbeat(self.info.worker_id, self.config.ttl_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                end_if_cancelled()
                # NOTE: the next heartbeat comes well within the TTL; an index gone for longer
                # answers UNKNOWN_WORKER or a refused heartbeat once it is back.
                self.num_errors += 1
                logger.warning("index heartbeat failed: %s", e)
                continue
            if not alive and self.num_registers == num_registers:
                logger.info("index says this worker's registration lapsed: registering again")
                self.sync = Sync.UNREGISTERED
                if self._wake is not None:
                    self._wake.set()

    async def _wait_for_events(self) -> None:
        """Until the source says a batch is in (or the heartbeat wants a register); without
        ``on_events``, one polling interval."""
        assert self._wake is not None, "start() first"
        with contextlib.suppress(TimeoutError):
            timeout_s = None if self._has_on_events else self.config.interval_s
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        self._wake.clear()


class TierSplit:
    """A worker with a host tier as two event sources, one per index entry: its own (every
    event: the hashes of both tiers) and its device tier's (``gpu_tier_id``, role TIER_ROLE:
    the device's events alone, under the same batch numbers), as an engine's tiers are indexed
    (``cache_index/engine_feed.py``). The router weighs a matched block by the tier that holds
    it (``TierWeights``). Both read one engine client's buffer, on one event loop."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.all = _TierSource(self, device_only=False)
        self.device = _TierSource(self, device_only=True)

    def pull(self) -> None:
        for batch in self.engine.take_cache_events():
            self.all.batches.append(batch)
            device = [e for e in batch.events if getattr(e, "medium", None) is None]
            self.device.batches.append(batch._replace(events=device))


class _TierSource:
    def __init__(self, split: TierSplit, *, device_only: bool) -> None:
        self._split = split
        self._device_only = device_only
        self.batches: collections.deque = collections.deque()

    def take_cache_events(self) -> list:
        self._split.pull()
        batches = list(self.batches)
        self.batches.clear()
        return batches

    def snapshot(self) -> Any:
        return self._split.engine.snapshot(device_only=self._device_only)

    def on_events(self, callback: Any) -> None:
        self._split.engine.on_events(callback)
