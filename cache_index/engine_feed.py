"""One vLLM engine's published KV events, followed into a block index under kvswitch's names.

A vLLM engine (one data-parallel rank of one) publishes numbered batches on a ZeroMQ PUB socket
and keeps the last 10,000 for replay behind a ROUTER socket (``vllm_events.py`` reads them). The
feed subscribes, names each batch's blocks (``EngineBlockNames``) and applies them to the index
as the engine's own entries, the engine registered there as a worker of the fleet::

    start       -> register; replay from 0 (what the engine holds now, if its buffer has it all)
    first seq > 0 after an empty replay
                -> replay from 0 again (batches sent before the subscription took went nowhere)
    seq == next -> apply
    seq >  next -> a batch was lost: replay from next
    seq <  next, a later ts -> the engine restarted: its entries cleared, then apply
    the subscription made again (the engine went away and came back)
                -> replay from 0: a batch under a number seen, with another ts, says it
                   restarted (its entries cleared, built again from the replay)
    seq <  next, otherwise  -> a batch seen already (replayed, then live): skipped
    replay cannot give next (its buffer rolled over, or there is none)
                -> the engine's entries cleared, then built again from what arrives, the feed
                   *degraded* until the engine restarts or clears its cache: blocks it stored
                   before then are not known

A degraded feed routes on less than the engine holds (never on what it does not): its misses
are the price, and ``FeedStatus`` and the metrics say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvswitch.cache_index.index import TIER_ROLE, ApplyStatus, BlockIndex, WorkerInfo
from kvswitch.cache_index.vllm_events import (
    EngineAllBlocksCleared,
    EngineBlockNames,
    EngineEventBatch,
    EngineEventError,
    decode_batch,
)

logger = logging.getLogger(__name__)

END_SEQ = -1  # a replay's last message
GPU_TIER_SUFFIX = "#gpu"  # an engine's GPU-tier entry: its name and this
REPLAY_TIMEOUT_S = 5.0
SEEN_WINDOW = 10_000  # batches whose ts is remembered: vLLM's replay buffer
DEFAULT_TTL_S = 30.0


@dataclass(frozen=True)
class EngineEndpoints:
    """Where an engine is and publishes: ``name`` is its worker id in the index, ``address``
    where requests go (its OpenAI API's base URL)."""

    name: str
    address: str
    events: str  # the PUB endpoint, e.g. tcp://host:5557
    replay: str = ""  # the ROUTER endpoint, e.g. tcp://host:5558; "" where it has none
    topic: str = ""


@dataclass
class FeedStatus:
    next_seq: int | None = None  # the engine's next batch; None before the first
    degraded: str = ""  # why the index holds less than the engine does; "" when it holds it all
    num_batches: int = 0
    num_replays: int = 0
    num_restarts: int = 0
    num_cleared: int = 0  # times the engine's entries were dropped to be built again
    num_bad_batches: int = 0
    last_ts: float = 0.0
    failed: str = ""  # why the feed stopped (a block size mismatch): it applies nothing more


class EngineEventFeed:
    """Follows one engine's events into ``index`` (``run`` until cancelled)."""

    def __init__(
        self,
        engine: EngineEndpoints,
        index: BlockIndex,
        names: EngineBlockNames,
        *,
        context: zmq.asyncio.Context | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.index = index
        self.names = names
        self.status = FeedStatus()
        self._context = context or zmq.asyncio.Context.instance()
        self._ttl_s = ttl_s
        self._replay_timeout_s = replay_timeout_s
        self._index_seq = 0  # what the index numbers this feed's batches by
        # The ts of each batch applied lately, by number: a replayed batch under a number seen
        # but with another ts comes from a restarted engine.
        self._seen_ts: dict[int, float] = {}
        self._subscribed = asyncio.Event()
        self._tier_registered = False  # the GPU tier's own entry is in the index

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.engine.name,
            address=self.engine.address,
            namespace=self.names.namespace,
            block_size=self.names.block_size,
            block_hash=self.names.naming.mode,
            block_hash_key_id=self.names.naming.key_id,
            degraded=self.status.degraded,
        )

    @property
    def gpu_tier_info(self) -> WorkerInfo:
        """The entry of the blocks the engine's GPU holds, beside its own (which any tier's
        blocks are in), once it has told of another tier: ``role`` TIER_ROLE, routed to never."""
        return gpu_tier_info(self.info)

    def reset(self) -> None:
        """Forget what was followed, to ``run`` again from the start (after a failure: the
        index unreachable for a while), as a new feed would."""
        self.names.clear()
        self.status.next_seq = None
        self._seen_ts.clear()

    async def wait_subscribed(self) -> None:
        """Until the subscription is made and the engine's buffer replayed (what a test
        publishes after; the engine may not have heard of the subscription yet)."""
        await self._subscribed.wait()

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, self.engine.topic.encode())
        # NOTE: told of every connection made: one made again may lead to a restarted engine.
        # Watched before connecting: a first connection made before the monitor was there
        # would go untold, and the next one (the engine back) be taken for the first.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.engine.events)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        heartbeat = asyncio.create_task(self._heartbeats())
        num_connects = 0
        try:
            await self._resync()
            await self._catch_up(0)
            self._subscribed.set()
            while not self.status.failed:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    num_connects += 1
                    if num_connects > 1:
                        await self._catch_up(0, after_reconnect=True)
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.status.num_bad_batches += 1
                    continue
                _, seq_bytes, payload = frames
                await self._receive(int.from_bytes(seq_bytes, "big", signed=True), payload)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            sub.disable_monitor()
            monitor.close()
            sub.close()

    async def _receive(self, seq: int, payload: bytes) -> None:
        status = self.status
        try:
            batch = decode_batch(payload)
        except EngineEventError as e:
            status.num_bad_batches += 1
            logger.warning("engine %s: batch %d unread: %s", self.engine.name, seq, e)
            return
        expected = status.next_seq
        if expected is None:
            if seq > 0:
                # NOTE: batches sent after the first replay, before the subscription reached
                # the engine, went nowhere: its buffer may still hold them all.
                await self._catch_up(0)
            if status.next_seq is None:
                if seq > 0:
                    status.degraded = f"it joined at batch {seq}: blocks stored before are unknown"
                    await self._resync()  # registered degraded, for every reader of the index
                await self._apply(seq, batch)
            elif seq >= status.next_seq:
                if seq > status.next_seq:
                    await self._clear(f"batches {status.next_seq}..{seq - 1} were lost")
                await self._apply(seq, batch)
        elif seq == expected:
            await self._apply(seq, batch)
        elif seq > expected:
            num_cleared = status.num_cleared
            await self._catch_up(expected)
            if seq >= status.next_seq:  # NOTE: the replay did not bring this one
                if seq > status.next_seq and status.num_cleared == num_cleared:
                    await self._clear(f"batches {status.next_seq}..{seq - 1} were lost")
                await self._apply(seq, batch)
        elif batch.ts > status.last_ts:
            await self._restarted(seq)
            if seq > 0:  # NOTE: its first batches went out before this feed reconnected
                await self._catch_up(0)
            if seq >= status.next_seq:
                if seq > status.next_seq and not status.degraded:
                    await self._clear(
                        f"it restarted; batches {status.next_seq}..{seq - 1} were lost"
                    )
                await self._apply(seq, batch)
        # else: a batch applied already (replayed, then received live)

    async def _catch_up(self, start: int, *, after_reconnect: bool = False) -> None:
        """Every batch the engine's replay buffer holds from ``start`` on, applied; the entries
        cleared, the feed degraded, where it cannot give the next batch (or there is no
        buffer). ``after_reconnect``: the subscription was cut and made again, and the engine
        may have restarted meanwhile, its numbers caught up with this feed's (live batches of
        the new process may even have been taken for the old one's): a replayed batch whose ts
        differs from the one applied under its number says it did, and everything is built
        again from the replay."""
        status = self.status
        if not self.engine.replay:
            if start > 0:
                await self._clear(f"batch {start} was lost and the engine has no replay endpoint")
            return
        status.num_replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(self.engine.replay)
        first = True
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self._replay_timeout_s * 1000):
                    logger.warning("engine %s: its replay did not answer", self.engine.name)
                    if start > 0 and first:
                        await self._clear(f"batch {start} was lost and the replay did not answer")
                    return
                frames = await dealer.recv_multipart()
                # NOTE: [b"", topic, seq, payload], or [b"", seq, payload] from older servers.
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return
                try:
                    batch = decode_batch(frames[-1])
                except EngineEventError as e:
                    status.num_bad_batches += 1
                    logger.warning(
                        "engine %s: replayed batch %d unread: %s", self.engine.name, seq, e
                    )
                    continue
                seen_ts = self._seen_ts.get(seq)
                if after_reconnect and seen_ts is not None and seen_ts != batch.ts:
                    # NOTE: another batch under a number seen: another process numbered it.
                    await self._restarted(seq)
                    await self._catch_up(0)
                    return
                wanted = start if status.next_seq is None else status.next_seq
                if first and seq > wanted:
                    await self._clear(
                        f"batches {wanted}..{seq - 1} are older than the engine's replay buffer"
                    )
                first = False
                if status.next_seq is None or seq >= status.next_seq:
                    await self._apply(seq, batch)
        finally:
            dealer.close()

    async def _restarted(self, seq: int) -> None:
        """The engine's batch ``seq`` came from a new process: what it held before is gone."""
        self.status.num_restarts += 1
        logger.info(
            "engine %s restarted (its batch %d is newer than those seen)", self.engine.name, seq
        )
        await self._clear("")
        self.status.next_seq = 0
        self._seen_ts.clear()

    async def _apply(self, seq: int, batch: EngineEventBatch) -> None:
        status = self.status
        try:
            events, gpu_events = self.names.apply_tiers(batch.events)
        except ValueError as e:  # NOTE: a block size mismatch: every name would be wrong
            status.failed = f"engine {self.engine.name}: {e}"
            logger.error("%s; it leaves the index, its events no longer applied", status.failed)
            # NOTE: out of the index, not merely emptied: registered, it would be routed to
            # (by every router sharing the index) on names that can never be its own.
            self.names.clear()
            await self.index.deregister(self.engine.name)
            if self._tier_registered:
                await self.index.deregister(gpu_tier_id(self.engine.name))
            return
        status.next_seq = seq + 1
        status.last_ts = max(status.last_ts, batch.ts)
        self._seen_ts[seq] = batch.ts
        self._seen_ts.pop(seq - SEEN_WINDOW, None)
        status.num_batches += 1
        if status.degraded and any(isinstance(e, EngineAllBlocksCleared) for e in batch.events):
            # NOTE: the engine holds nothing it did not tell since: registered whole again,
            # its entries those named now (this batch's included).
            status.degraded = ""
            await self._resync()
            return
        if events:
            self._index_seq += 1
            result = await self.index.apply(self.engine.name, self._index_seq, events)
            if result in (ApplyStatus.NEEDS_RESYNC, ApplyStatus.UNKNOWN_WORKER):
                await self._resync()
                return
        if not self.names.tiered:
            return  # NOTE: the GPU holds all there is: the engine's own entry says it
        if not self._tier_registered:
            await self._resync_gpu_tier()
        elif gpu_events:
            self._index_seq += 1
            tier = gpu_tier_id(self.engine.name)
            result = await self.index.apply(tier, self._index_seq, gpu_events)
            if result in (ApplyStatus.NEEDS_RESYNC, ApplyStatus.UNKNOWN_WORKER):
                await self._resync_gpu_tier()

    async def _clear(self, why: str) -> None:
        """Drop the engine's entries, to build them again from what arrives; degraded for
        ``why`` (nothing lost when ``why`` is empty: a fresh engine)."""
        self.status.num_cleared += 1
        self.status.degraded = why
        if why:
            logger.warning("engine %s: index entries cleared, degraded: %s", self.engine.name, why)
        self.names.clear()
        await self._resync()

    async def _resync(self) -> None:
        """Register the engine, and set its entries to the blocks named now (its GPU's too,
        where it has told of another tier)."""
        await self.index.register(self.info, self._ttl_s)
        self._index_seq += 1
        await self.index.resync(self.engine.name, self._index_seq, self.names.block_names())
        if self._tier_registered:
            await self._resync_gpu_tier()

    async def _resync_gpu_tier(self) -> None:
        tier = gpu_tier_id(self.engine.name)
        await self.index.register(self.gpu_tier_info, self._ttl_s)
        self._tier_registered = True
        self._index_seq += 1
        await self.index.resync(tier, self._index_seq, self.names.gpu_block_names())

    async def _heartbeats(self) -> None:
        while not self.status.failed:  # NOTE: a refused engine stays out of the index
            await asyncio.sleep(self._ttl_s / 3)
            try:
                if self.status.failed:
                    return
                alive = await self.index.heartbeat(self.engine.name, self._ttl_s)
                if self._tier_registered:
                    tier = gpu_tier_id(self.engine.name)
                    alive = await self.index.heartbeat(tier, self._ttl_s) and alive
                if not alive:
                    await self._resync()
            except Exception:
                logger.exception("engine %s: heartbeat failed", self.engine.name)


def gpu_tier_id(engine: str) -> str:
    """The index entry of the blocks an engine's (or a worker's) GPU holds."""
    return engine + GPU_TIER_SUFFIX


def gpu_tier_info(info: WorkerInfo) -> WorkerInfo:
    """The entry of the blocks the device of ``info``'s engine or worker holds, beside its own
    (which any tier's blocks are in): ``role`` TIER_ROLE, routed to never."""
    return dataclasses.replace(info, worker_id=gpu_tier_id(info.worker_id), role=TIER_ROLE)


def status_line(feed: EngineEventFeed, now_s: float | None = None) -> str:
    """One line for logs and ``index stats``: the engine, its state, what was counted."""
    status = feed.status
    state = (
        f"failed: {status.failed}"
        if status.failed
        else (f"degraded: {status.degraded}" if status.degraded else "ok")
    )
    age = (
        ""
        if not status.last_ts
        else f", last batch {(now_s or time.time()) - status.last_ts:.1f} s ago"
    )
    return (
        f"{feed.engine.name}: {state}; {status.num_batches} batches, {len(feed.names)} blocks, "
        f"{feed.names.stats.num_orphans} orphans, {status.num_restarts} restarts, "
        f"{status.num_replays} replays{age}"
    )
