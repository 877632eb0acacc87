"""The workers a router can send to: who is live, how loaded, and a gRPC channel to each.

Who is live comes from the block index (workers register there themselves); how loaded comes
from two sources, because each alone misleads:

- each worker's own ``GetLoad`` report, polled every ``load_poll_s``: it sees the requests of
  every router, but is up to one poll old;
- this router's count of what it sent and has not seen finish: exact and immediate, so a burst
  does not pile onto the worker that looked idle at the last poll, but blind to other routers.

A worker's outstanding work, in tokens, is therefore::

    max(reported queued prefill tokens, this router's not-yet-prefilled tokens there)
      - the part of that prefill the request being routed shares (blocks guessed, not yet indexed)
      + this router's remaining output tokens there

Each worker is polled by a task of its own, so a worker slow to answer (or never answering)
delays only its own next report. A poll unanswered within ``rpc_timeout_s`` leaves the worker out
of routing until one answers; the streams running there go on. The worker is *lost*, and those
streams fail over, only on evidence that it is gone: ``lost_after_failed_polls`` polls failed in
a row, or its connection dead (the channel in TRANSIENT_FAILURE or SHUTDOWN: a refused connect).
A worker whose RPC failed is left out for ``down_s`` (it may be dying; the index drops it when
its registration lapses).

A worker that names blocks another way than this router (``BlockNaming``: another hash mode, or
another key) is refused when it registers, with an error naming both: its cached blocks could
never match this router's names, and its own cache would not be keyed as the fleet's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from kvswitch.cache_index.engine_feed import GPU_TIER_SUFFIX
from kvswitch.cache_index.hashing import XXH3_NAMING, BlockNaming
from kvswitch.cache_index.index import TIER_ROLE, BlockIndex, WorkerInfo
from kvswitch.logs import Throttled
from kvswitch.router.engine_http import EngineHTTP
from kvswitch.router.engines import EngineDown, is_engine, poll_engine
from kvswitch.router.policy import LoraResidence, WorkerState
from kvswitch.router.worker_streams import WorkerStreams
from kvswitch.security import PLAINTEXT, FleetSecurity
from kvswitch.serving import KEEPALIVE_CHANNEL_OPTIONS, cancel_and_wait, end_if_cancelled
from kvswitch.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# Who takes what: a whole request (its prompt prefilled there, or taken from a prefill worker)
# goes to a "both" or "decode" worker; a prompt to prefill for another worker to a "prefill" one.
DECODE_ROLES = ("both", "decode")
PREFILL_ROLES = ("prefill",)


@dataclass(slots=True)
class PeerLoad:
    """What the other router replicas have in flight on one worker, as they last told
    (``router/replicas.py``); zero for a router alone."""

    num_requests: int = 0
    num_prefill_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, num_requests: int, num_prefill_tokens: int, num_output_tokens: int) -> None:
        self.num_requests += num_requests
        self.num_prefill_tokens += num_prefill_tokens
        self.num_output_tokens += num_output_tokens


class LoadListener(Protocol):
    """Told how a router's own requests in flight on a worker change: requests, prompt tokens
    not yet prefilled and output tokens still to come, each added (taken away when negative).
    ``urgent``: a request began, was prefilled or ended (other routers should hear now); not: a
    request's output tokens came (they may hear later)."""

    def __call__(
        self,
        worker_id: str,
        num_requests: int,
        num_prefill_tokens: int,
        num_output_tokens: int,
        urgent: bool,
    ) -> None: ...


@dataclass
class WorkerHandle:
    """One worker as this router knows it."""

    info: WorkerInfo
    # None for an OpenAI-API engine (router/engines.py): reached over HTTP by the front alone.
    channel: grpc.aio.Channel | None
    stub: worker_pb2_grpc.WorkerStub | None
    # Its Generate calls, many over one stream (router/worker_streams.py); None for an engine.
    streams: WorkerStreams | None = None
    load: worker_pb2.WorkerLoad | None = None  # the last report, if any came
    num_in_flight: int = 0  # requests this router sent here and has not seen finish
    num_prefill_tokens: int = 0  # uncached prompt tokens of those not yet past their first token
    num_output_tokens: int = 0  # output tokens those may still produce
    down_until_s: float = 0.0
    unreachable: bool = False  # its last load poll failed: left out until one answers
    num_failed_polls: int = 0  # load polls failed in a row
    num_polls_sent: int = 0  # load polls sent, numbered in order
    last_poll_applied: int = 0  # the number of the poll whose answer ``load`` is
    # It refused a request at its queue limit: no request goes there until one of its requests
    # ends or its next load poll.
    full: bool = False
    # Set when the worker is lost (polls failed in a row, or its connection dead): the streams
    # running there stop waiting for it and fail over. One slow answer does not set it.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    removed: bool = False  # no longer live; the channel closes when nothing is in flight
    # What the other router replicas have in flight here; one object per worker id, shared with
    # the directory, which the replicas' messages update.
    peer: PeerLoad = field(default_factory=PeerLoad)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_engine(self) -> bool:
        return self.channel is None

    def num_prefill_tokens_queued(self, num_shared_prefill_tokens: int = 0) -> int:
        """Prompt tokens queued here to prefill. ``num_shared_prefill_tokens``: prompt tokens
        still being prefilled here for another request that the request being routed shares;
        that prefill serves both, so it is not charged to the newcomer a second time."""
        reported = self.load.num_queued_prefill_tokens if self.load is not None else 0
        counted = self.num_prefill_tokens + self.peer.num_prefill_tokens
        return max(max(reported, counted) - num_shared_prefill_tokens, 0)

    def num_output_tokens_queued(self) -> int:
        """Output tokens the requests routed here (by this router and its replicas) may still
        produce."""
        return self.num_output_tokens + self.peer.num_output_tokens

    def num_outstanding_tokens(self, num_shared_prefill_tokens: int = 0) -> int:
        """Work queued here, in tokens: prompt to prefill and output to decode."""
        return (
            self.num_prefill_tokens_queued(num_shared_prefill_tokens)
            + self.num_output_tokens_queued()
        )

    def num_requests(self) -> int:
        """Requests running or waiting here: as reported, or as this router and its replicas
        count them."""
        load = self.load
        reported = load.num_running_requests + load.num_waiting_requests if load else 0
        return max(reported, self.num_in_flight + self.peer.num_requests)

    @property
    def loras(self) -> Sequence[str]:
        """The LoRA adapters it serves, as its last load report says (none before one)."""
        return self.load.loras if self.load is not None else ()

    def serves(self, lora: str) -> bool:
        return lora in self.loras

    def lora_residence(self, lora: str) -> LoraResidence:
        """Where the adapter ``lora`` is on this worker, as its last load report says."""
        load = self.load
        if load is not None and lora in load.loaded_loras:
            return LoraResidence.LOADED
        if load is not None and load.num_free_lora_slots:
            return LoraResidence.FREE_SLOT
        return LoraResidence.EVICT

    def state(
        self,
        num_matched_blocks: int,
        num_shared_prefill_tokens: int = 0,
        num_fetchable_blocks: int = 0,
        lora: str | None = None,
    ) -> WorkerState:
        load, info = self.load, self.info
        num_prefill_tokens = self.num_prefill_tokens_queued(num_shared_prefill_tokens)
        return WorkerState(
            worker_id=info.worker_id,
            num_matched_blocks=num_matched_blocks,
            num_outstanding_tokens=num_prefill_tokens + self.num_output_tokens_queued(),
            num_free_blocks=load.num_free_blocks if load is not None else 0,
            # NOTE: an engine's size comes with its load (its registration cannot say it).
            num_total_blocks=info.num_blocks or (load.num_total_blocks if load is not None else 0),
            num_requests=self.num_requests(),
            num_prefill_tokens=num_prefill_tokens,
            num_fetchable_blocks=num_fetchable_blocks,
            lora=self.lora_residence(lora) if lora is not None else LoraResidence.NONE,
        )


@dataclass
class InFlight:
    """What one routed request adds to its worker's load, until ``WorkerDirectory.finish``."""

    handle: WorkerHandle
    num_prefill_tokens: int
    num_output_tokens: int  # still to come
    prefilled: bool = False
    finished: bool = False


@dataclass(frozen=True)
class DirectoryConfig:
    refresh_s: float = 0.25  # how often to re-read the live workers from the index
    load_poll_s: float = 0.1  # how often to ask each worker for its load
    rpc_timeout_s: float = 1.0  # for GetLoad
    down_s: float = 1.0  # how long a worker whose RPC failed is left out
    # Load polls failed in a row after which a worker is lost and its streams fail over.
    lost_after_failed_polls: int = 3

    def __post_init__(self) -> None:
        for name in ("refresh_s", "load_poll_s", "rpc_timeout_s", "down_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lost_after_failed_polls < 1:
            raise ValueError(
                f"lost_after_failed_polls must be at least 1, got {self.lost_after_failed_polls}"
            )


class WorkerDirectory:
    """The live workers of one router, kept fresh in the background (``start``): one loop reads
    the live workers from the index, and one task per worker polls its load."""

    def __init__(
        self,
        index: BlockIndex,
        config: DirectoryConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        channel_options: list[tuple[str, object]] | None = None,
        security: FleetSecurity = PLAINTEXT,
        naming: BlockNaming = XXH3_NAMING,
        engine_api_key: str = "",
    ) -> None:
        self.index = index
        self._engine_api_key = engine_api_key  # what OpenAI-API engines take, if any
        self._security = security  # how the workers are reached
        self.naming = naming  # how this router names blocks; workers must name them alike
        # Live workers refused for naming blocks otherwise: worker id -> why, as logged.
        self.refused: dict[str, str] = {}
        self.config = config or DirectoryConfig()
        self._clock = clock
        self._channel_options = (
            channel_options if channel_options is not None else KEEPALIVE_CHANNEL_OPTIONS
        )
        self._handles: dict[str, WorkerHandle] = {}
        self._tasks: list[asyncio.Task] = []
        self._polling = False  # started: each worker that joins gets a load-poll task
        self._pollers: dict[str, asyncio.Task] = {}  # worker id -> its load-poll task
        self._closing: set[asyncio.Task] = set()  # channels of gone workers, being closed
        self._changed = asyncio.Event()  # set, and replaced, when a worker joins or leaves
        # Bumped when a worker joins or leaves, or its namespace or adapters change: what a copy
        # of the fleet's adapters is good for (the HTTP front reads them for each request).
        self.num_adapter_changes = 0
        self.num_loop_errors = 0  # unexpected errors in the background loops
        self._refresh_warning = Throttled(logger)
        self._http: EngineHTTP | None = None  # engines' polls, once one joins
        # Engine id -> its GPU-tier entry, for engines that told of another tier.
        self.gpu_tiers: dict[str, str] = {}
        # What router replicas have in flight, per worker id (a worker they know before this
        # router does gets its entry early), and who hears how this router's own change
        # (``LoadListener``).
        self.peer_loads: dict[str, PeerLoad] = {}
        self.on_load: LoadListener | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the live workers once, then keep them and their loads fresh in the background."""
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.config.refresh_s, self.refresh), name="refresh")
        ]
        self._polling = True
        for handle in self._handles.values():
            self._start_polling(handle)

    async def stop(self) -> None:
        self._polling = False
        await cancel_and_wait([*self._tasks, *self._pollers.values()])
        self._tasks = []
        self._pollers.clear()
        for handle in self._handles.values():
            await _close(handle)
        self._handles.clear()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- queries -------------------------------------------------------------------------------

    def routable(
        self,
        exclude: set[str] | frozenset[str] = frozenset(),
        roles: tuple[str, ...] = DECODE_ROLES,
        *,
        engines: bool = False,
    ) -> list[WorkerHandle]:
        """Live workers of one of ``roles`` (by default: those that take whole requests), not
        failing lately, not in ``exclude``; with ``engines``, the OpenAI-API engines among them
        (only the HTTP front can send them a request)."""
        now = self._clock()
        return [
            h
            for h in self._handles.values()
            if not h.removed
            and (engines or not h.is_engine)
            and h.info.role in roles
            and h.down_until_s <= now
            and not h.unreachable
            and h.worker_id not in exclude
        ]

    def handles(self) -> list[WorkerHandle]:
        return [h for h in self._handles.values() if not h.removed]

    def peer_load(self, worker_id: str) -> PeerLoad:
        """What the router replicas have in flight on ``worker_id``: the object its handle
        reads, made on first use."""
        load = self.peer_loads.get(worker_id)
        if load is None:
            load = self.peer_loads[worker_id] = PeerLoad()
        return load

    # -- accounting ----------------------------------------------------------------------------

    def begin(
        self, handle: WorkerHandle, num_prefill_tokens: int, num_output_tokens: int
    ) -> InFlight:
        handle.num_in_flight += 1
        handle.num_prefill_tokens += num_prefill_tokens
        handle.num_output_tokens += num_output_tokens
        if self.on_load is not None:
            self.on_load(handle.worker_id, 1, num_prefill_tokens, num_output_tokens, True)
        return InFlight(handle, num_prefill_tokens, num_output_tokens)

    def first_token(self, flight: InFlight) -> None:
        """The prompt is prefilled: its tokens no longer weigh on the worker."""
        if not flight.prefilled:
            flight.prefilled = True
            flight.handle.num_prefill_tokens -= flight.num_prefill_tokens
            if self.on_load is not None and flight.num_prefill_tokens:
                self.on_load(flight.handle.worker_id, 0, -flight.num_prefill_tokens, 0, True)

    def produced(self, flight: InFlight, num_tokens: int) -> None:
        num_tokens = min(num_tokens, flight.num_output_tokens)
        flight.num_output_tokens -= num_tokens
        flight.handle.num_output_tokens -= num_tokens
        if self.on_load is not None and num_tokens:
            self.on_load(flight.handle.worker_id, 0, 0, -num_tokens, False)

    def finish(self, flight: InFlight) -> None:
        """The request is over on this worker (finished, failed or cancelled)."""
        if flight.finished:
            return
        self.first_token(flight)
        self.produced(flight, flight.num_output_tokens)
        flight.finished = True
        handle = flight.handle
        handle.num_in_flight -= 1
        if self.on_load is not None:
            self.on_load(handle.worker_id, -1, 0, 0, True)
        # NOTE: a request that ends frees a place there (one the worker refused is marked full
        # again right after this).
        handle.full = False
        if handle.removed and handle.num_in_flight == 0:
            self._close_later(handle)

    def _close_later(self, handle: WorkerHandle) -> None:
        """Close a gone worker's channel in the background: closing one whose connection died
        without a word waits for that connection to time out, and nothing should wait on it."""
        if handle.channel is None:
            return
        task = asyncio.get_running_loop().create_task(_close(handle))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def mark_down(self, handle: WorkerHandle) -> None:
        handle.down_until_s = self._clock() + self.config.down_s

    # -- background work -----------------------------------------------------------------------

    async def refresh(self) -> None:
        """Bring the set of workers in line with the index's live workers."""
        try:
            infos = await self.index.live_workers()
        except self.index.unavailable_errors as e:  # it may be restarting: keep what we know
            self._refresh_warning.warning("cannot read the live workers from the index: %s", e)
            return
        # NOTE: an engine's GPU-tier entry is no worker: it weighs its engine's matches.
        self.gpu_tiers = {
            info.worker_id.removesuffix(GPU_TIER_SUFFIX): info.worker_id
            for info in infos
            if info.role == TIER_ROLE
        }
        live = {
            info.worker_id: info for info in infos if info.role != TIER_ROLE and self._admits(info)
        }
        self.refused = {
            worker_id: why for worker_id, why in self.refused.items() if worker_id not in live
        }
        changed = False
        for worker_id, handle in list(self._handles.items()):
            if worker_id not in live or live[worker_id].address != handle.info.address:
                changed = True
                logger.info("worker %s left", worker_id)
                handle.removed = True
                del self._handles[worker_id]
                self._stop_polling(worker_id)
                if handle.num_in_flight == 0:
                    self._close_later(handle)
        for worker_id, info in live.items():
            handle = self._handles.get(worker_id)
            if handle is None:
                changed = True
                logger.info("worker %s joined at %s (%s)", worker_id, info.address, info.role)
                if is_engine(info):
                    handle = WorkerHandle(info, None, None)
                else:
                    channel = self._security.channel(info.address, self._channel_options)
                    stub = worker_pb2_grpc.WorkerStub(channel)
                    handle = WorkerHandle(info, channel, stub, WorkerStreams(stub, worker_id))
                handle.peer = self.peer_load(worker_id)
                self._handles[worker_id] = handle
                if self._polling:
                    self._start_polling(handle)
            else:
                if info.namespace != handle.info.namespace:
                    self.num_adapter_changes += 1
                handle.info = info
        if changed:
            self._signal_change()

    def _admits(self, info: WorkerInfo) -> bool:
        """Whether ``info``'s worker names blocks as this router does; a worker that does not
        is refused, and the error logged once per registration."""
        if info.names_blocks_as(self.naming):
            return True
        why = (
            f"worker {info.worker_id} hashes blocks with {info.describe_block_hash()} but this "
            f"router uses {self.naming.describe()}: refused. Give every router and worker the "
            "same --fleet-token and --block-hash (docs/HASHING.md)"
        )
        if self.refused.get(info.worker_id) != why:
            logger.error("%s", why)
        self.refused[info.worker_id] = why
        return False

    def _signal_change(self) -> None:
        self.num_adapter_changes += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return when a worker joins or leaves, or after ``timeout_s`` (a worker marked down
        comes back by the clock alone, with no change to wake anyone)."""
        # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # arrives as the event is set, and a loop calling this would then never stop.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()

    def _start_polling(self, handle: WorkerHandle) -> None:
        """Poll ``handle``'s load every ``load_poll_s`` in a task of its own, until it leaves."""
        # NOTE: a task per worker, not one round for all: a round waits for its slowest answer,
        # and one black-holed worker would hold every worker's report up to rpc_timeout_s.
        poll = functools.partial(self._poll_engine if handle.is_engine else self._poll, handle)
        self._pollers[handle.worker_id] = asyncio.get_running_loop().create_task(
            self._every(self.config.load_poll_s, poll, f"the load poll of {handle.worker_id}"),
            name=f"load-{handle.worker_id}",
        )

    def _stop_polling(self, worker_id: str) -> None:
        task = self._pollers.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def poll_loads(self) -> None:
        """Poll every worker's load once, all at once (the background tasks poll each on its own
        timer)."""
        await asyncio.gather(
            *((self._poll_engine if h.is_engine else self._poll)(h) for h in self.handles())
        )

    async def _poll_engine(self, handle: WorkerHandle) -> None:
        if self._http is None:
            self._http = EngineHTTP(
                self._security, self._engine_api_key, connect_timeout_s=self.config.rpc_timeout_s
            )
        handle.num_polls_sent += 1
        poll = handle.num_polls_sent
        try:
            load = await poll_engine(self._http, handle.info, self.config.rpc_timeout_s)
        except EngineDown as e:
            logger.debug("polling engine %s failed: %s", handle.worker_id, e)
            if not handle.unreachable:
                await self.refresh()
            if not handle.removed:
                self._poll_failed(handle, str(e))
        else:
            self._polled(handle, load, poll)

    async def _poll(self, handle: WorkerHandle) -> None:
        assert handle.stub is not None
        handle.num_polls_sent += 1
        poll = handle.num_polls_sent
        try:
            load = await handle.stub.GetLoad(
                worker_pb2.GetLoadRequest(), timeout=self.config.rpc_timeout_s
            )
        except asyncio.CancelledError:
            end_if_cancelled()  # the directory's own stop: only that may end the loop
            if handle.removed:
                # NOTE: the worker left and its channel was closed under the call (closing a
                # channel cancels its calls).
                return
            raise
        except grpc.aio.AioRpcError as e:
            logger.debug("GetLoad from %s failed: %s", handle.worker_id, e.code().name)
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                if not handle.unreachable:
                    # NOTE: a worker that stops leaves the index first: one that left is gone,
                    # not failing (refresh stops this poller then).
                    await self.refresh()
                if not handle.removed:
                    self._poll_failed(handle, e.code().name)
        else:
            self._polled(handle, load, poll)

    def _polled(self, handle: WorkerHandle, load: worker_pb2.WorkerLoad, poll: int) -> None:
        if poll < handle.last_poll_applied:
            # NOTE: a poll sent before one already answered (a background poll overtaken by
            # poll_loads after an adapter's unload): what it says is older than what is known.
            return
        handle.last_poll_applied = poll
        if handle.load is None or handle.load.loras != load.loras:
            self.num_adapter_changes += 1
        handle.load = load
        if handle.unreachable:
            logger.info("worker %s answers its load polls again", handle.worker_id)
        handle.unreachable = False
        handle.num_failed_polls = 0
        handle.full = False
        if handle.lost.is_set():
            handle.lost = asyncio.Event()

    def _poll_failed(self, handle: WorkerHandle, why: str) -> None:
        """A load poll went unanswered (UNAVAILABLE or DEADLINE_EXCEEDED; an engine's, or its
        health said it does not serve). The worker takes no new request until a poll answers
        again; it is lost, and its streams fail over, once ``lost_after_failed_polls`` polls
        failed in a row or its channel says the connection is dead."""
        handle.num_failed_polls += 1
        if not handle.unreachable:
            logger.warning(
                "worker %s stopped answering its load polls (%s): left out",
                handle.worker_id,
                why,
            )
        handle.unreachable = True
        if handle.lost.is_set():
            return
        # NOTE: one slow answer is no evidence (a serving loop held up a second by a long
        # prefill): failing its streams over would compute each again elsewhere, and under
        # overload push the overload onto the next worker. A worker cut off without a word is
        # also found by the connection's keepalive pings, which end its calls within ~2 s.
        if handle.channel is None:  # an engine: no connection to ask
            if handle.num_failed_polls >= self.config.lost_after_failed_polls:
                handle.lost.set()
            return
        state = handle.channel.get_state()
        dead = state in (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
        )
        if dead or handle.num_failed_polls >= self.config.lost_after_failed_polls:
            logger.warning(
                "worker %s lost (%d load polls failed in a row, its connection %s): its "
                "streams fail over",
                handle.worker_id,
                handle.num_failed_polls,
                state.name,
            )
            handle.lost.set()

    async def _every(self, interval_s: float, fn: Callable, what: str = "") -> None:
        what = what or fn.__name__
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except asyncio.CancelledError:
                end_if_cancelled()
                # NOTE: a call cancelled from under the round (its channel closed) must not end
                # the loop either.
                self.num_loop_errors += 1
                logger.error("%s was cancelled; trying again in %g s", what, interval_s)
            except Exception:
                # NOTE: a bug in one round must not end the loop: the router would go on routing
                # on a frozen view of its workers without a word.
                self.num_loop_errors += 1
                logger.exception("%s failed; trying again in %g s", what, interval_s)
            end_if_cancelled()  # the round may have swallowed the loop's own cancellation


async def _close(handle: WorkerHandle) -> None:
    """End a worker's stream of calls, then close its channel."""
    if handle.streams is not None:
        await handle.streams.close()
    if handle.channel is not None:
        await handle.channel.close()
