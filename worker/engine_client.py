"""The serving process's handle on its engine core (``engine_core``), which runs in a process of
its own: requests go in admitted, outputs come back per request on asyncio queues.

Who touches what::

    event loop thread(s)                   receiver thread              engine core process
    --------------------                   ---------------              -------------------
    submit(): check, hash, send ADD  ------------------------------------> step loop
    submit_awaiting_kv(), kv_landed() -------------------------------------> blocks held, filled
    abort(), snapshot(),
    read_blocks(), write_blocks(): send -------------------------------->   between steps
    per-request asyncio.Queue  <--call_soon_threadsafe-- STEP  <---------- outputs, events, load
    load, counters (read)      <------------------------ STEP
    take_cache_events() (lock) <------------------------ STEP's events, numbered in order

Admission happens here, before the core sees the request: the prompt is checked with two array
reductions and hashed into its block chain, then sent as one byte string. The core's steps never
wait on a long prompt's Python work.

The core dying (killed, out of memory, a crash in native code) is seen at once through its
process sentinel: every open stream fails with ``EngineDied``, every later submit is refused, and
the ``on_death`` callbacks run so that the worker can stop serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import zmq

from kvswitch.cache_index.events import CacheEvent
from kvswitch.cache_index.hashing import XXH3_NAMING, BlockHasher, BlockNaming
from kvswitch.logs import Throttled, log_settings
from kvswitch.worker import core_protocol as wire
from kvswitch.worker.core_protocol import CoreCounters, CoreFacts, LoadReport, StepGap
from kvswitch.worker.engine_config import check_lora_name
from kvswitch.worker.engine_core import build_and_run, core_process_main
from kvswitch.worker.kv_layout import KVLayout
from kvswitch.worker.request import (
    INTERACTIVE,
    POOLINGS,
    PRIORITIES,
    PullSlots,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    check_hold,
    check_prompt,
)

if TYPE_CHECKING:
    from kvswitch.worker.engine_config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = [
    "EngineClient",
    "EngineDied",
    "EngineError",
    "EngineStartError",
    "EngineStepError",
    "EngineStopped",
    "EventBatch",
    "LoadReport",
]


# What the engine core imports and the serving process does not.
ENGINE_MODULES = ("torch", "triton", "safetensors")

# How long a core that refused to start (START_FAILED) gets to exit on its own before it is killed:
# it only closes its pipes.
CORE_EXIT_S = 10.0


def check_engine_modules() -> None:
    """``ModuleNotFoundError`` naming the first module the engine core needs that this Python
    lacks. Found, not imported: loading torch takes seconds, and only the core needs it."""
    for name in ENGINE_MODULES:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


class EngineError(RuntimeError):
    """The engine failed the request; it has been removed from the engine."""


class EngineStopped(EngineError):
    """The engine is stopping or stopped and takes no more work."""


class EngineDied(EngineStopped):
    """The engine core process ended without being asked to."""


class EngineStepError(EngineError):
    """A model step running this request raised. The request was removed and the cache kept
    clean; the engine goes on serving the others."""


class EngineStartError(Exception):
    """The engine could not be built (its message says why), or its process died building it."""


class EventBatch(NamedTuple):
    """The cache events of one STEP from the core, numbered from 1."""

    seq: int
    events: list[CacheEvent]


class _Stream(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | EngineError]


_FAILURES = {
    wire.Failure.REJECTED: EngineError,
    wire.Failure.STEP_FAILED: EngineStepError,
    wire.Failure.STOPPED: EngineStopped,
}


class EngineClient:
    """Starts an engine core and feeds it.

    Contract (the same whichever side of a process boundary the core is on):

    * ``submit`` (a coroutine, from any event loop) checks and hashes a request, raising
      ValueError (a message for the user) if it can never run, and returns the ``asyncio.Queue``
      its outputs will arrive on, in order, the last with ``finished`` set, or a single
      ``EngineError`` instead if the engine fails or stops first. After either, nothing more is
      put on the queue.
    * ``abort`` stops a request and frees its blocks; it never raises, and aborting a finished
      or unknown request does nothing.
    * ``load`` and ``counters`` are as of the core's latest step; reading them never waits.
    * Cache events arrive with every step into a bounded buffer of event batches with
      consecutive ``seq`` numbers; ``event_seq`` is the latest one. When the buffer is full the
      oldest batch is dropped: the consumer sees a gap in ``seq`` and must resync from
      ``snapshot()`` (``num_dropped_event_batches`` counts the drops).
    * ``snapshot()`` returns ``(event_seq, cached hashes)`` taken together between two steps, so
      replaying batches ``1..event_seq`` from empty gives exactly those hashes.
    """

    def __init__(
        self,
        facts: CoreFacts,
        context: zmq.Context,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        core: multiprocessing.process.BaseProcess | threading.Thread,
        socket_dir: str,
        max_event_batches: int,
        block_naming: BlockNaming = XXH3_NAMING,
    ) -> None:
        self.facts = facts
        self.loras = facts.loras  # the adapters served now (those loaded at run time too)
        self.block_naming = block_naming  # the core's, from its config: how prompts are hashed
        self._context = context
        self._inbox = inbox  # commands to the core
        self._outbox = outbox  # what the core sends back; the receiver thread's alone
        self._core = core
        self._socket_dir = socket_dir
        self._lock = threading.Lock()  # guards everything below, and sends on the inbox
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, Future[Any]] = {}  # waiting for the core's answer, by call id
        self._call_ids = itertools.count()
        self._stopping = False
        self._ended: EngineStopped | None = None  # set once the core has stopped or died
        self._on_death: list[Callable[[str], None]] = []
        self._on_events: list[Callable[[], None]] = []
        self._on_event_batch: list[Callable[[list[CacheEvent]], None]] = []

        self._events_lock = threading.Lock()
        self._event_batches: deque[EventBatch] = deque()
        self._max_event_batches = max_event_batches
        self._event_seq = 0
        self.num_dropped_event_batches = 0
        self._drop_warning = Throttled(logger)  # called on the receiver thread only

        self.load = LoadReport(
            0, 0, 0, facts.num_blocks, facts.num_blocks, facts.block_size, loras=facts.loras
        )
        self.counters = CoreCounters()
        self._max_step_gap = StepGap()
        self._receiver = threading.Thread(target=self._receive, name="engine-receiver", daemon=True)
        self._receiver.start()

    # -- lifecycle --------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        in_process: bool = False,
        max_event_batches: int = 10_000,
    ) -> EngineClient:
        """Start an engine core for ``config`` and wait until its model is loaded.

        ``in_process``: run the core on a thread of this process instead of a process of its own
        (one process to debug or profile; the GIL is then shared). Raises ``EngineStartError``.
        """
        if max_event_batches <= 0:
            raise ValueError(f"max_event_batches must be positive, got {max_event_batches}")
        check_engine_modules()
        context = zmq.Context()
        socket_dir = tempfile.mkdtemp(prefix="kvswitch-engine-")  # mode 0700: ours alone
        scheme = "inproc://" if in_process else "ipc://"
        inbox_address, outbox_address = f"{scheme}{socket_dir}/in", f"{scheme}{socket_dir}/out"
        inbox = wire.open_pipe_end(context, zmq.PUSH, inbox_address, bind=True)
        outbox = wire.open_pipe_end(context, zmq.PULL, outbox_address, bind=True)
        core: multiprocessing.process.BaseProcess | threading.Thread
        if in_process:
            core = threading.Thread(
                target=build_and_run,
                args=(config, context, inbox_address, outbox_address),
                name="engine-core",
                daemon=True,
            )
        else:
            # NOTE: spawn, not fork: this process already runs gRPC's threads, which a fork
            # would copy in whatever state they were in.
            core = multiprocessing.get_context("spawn").Process(
                target=core_process_main,
                args=(
                    config,
                    inbox_address,
                    outbox_address,
                    multiprocessing.current_process().pid,
                    log_settings(),
                ),
                name="kvswitch-engine-core",
                daemon=True,
            )
        started = False
        try:
            core.start()
            started = True
            facts = _wait_until_ready(outbox, core)
        except BaseException as e:
            if started:  # else there is nothing to stop, and joining it would raise instead
                # NOTE: a core that refused to start is on its way out: let it go quietly. One
                # interrupted while loading would load on (it ignores SIGINT): kill it now.
                refused = isinstance(e, EngineStartError)
                _stop_core(core, timeout_s=CORE_EXIT_S if refused else 0, warn=refused)
            inbox.close()
            outbox.close()
            context.term()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        return cls(
            facts,
            context,
            inbox,
            outbox,
            core,
            socket_dir,
            max_event_batches,
            config.block_naming,
        )

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Let the core finish its current step, fail whatever is still pending with
        ``EngineStopped`` and end the core. Blocks until it has ended (killing a process that
        has not within ``timeout_s``)."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                if self._ended is None:
                    with contextlib.suppress(EngineStopped):
                        self._send(wire.pack([wire.STOP]))
        self._receiver.join(timeout_s)
        _stop_core(self._core, timeout_s)
        if self._receiver.is_alive():
            # The core was killed before it said STOPPED; the sentinel ends the receiver now.
            self._receiver.join(timeout_s)
        self._inbox.close()
        with contextlib.suppress(zmq.ZMQError):
            self._outbox.close()
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def on_event_batch(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        """Call ``callback(events)`` with each batch of cache events as it arrives (on the
        receiver thread: it must not block)."""
        self._on_event_batch.append(callback)

    def on_events(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the receiver thread) whenever an event batch is buffered."""
        self._on_events.append(callback)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(message)`` (on the receiver thread) if the core dies unasked."""
        self._on_death.append(callback)

    @property
    def num_requests(self) -> int:
        """Requests submitted and not finished: running in the core or waiting there."""
        return len(self._streams)

    @property
    def num_calls(self) -> int:
        """Calls sent to the core and not answered yet."""
        return len(self._calls)

    @property
    def pid(self) -> int | None:
        """The engine core's process id; None when it runs on a thread."""
        return getattr(self._core, "pid", None)

    # -- facts that never change ------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The block-hash namespace: hashes from other namespaces are not comparable."""
        return self.facts.namespace

    @property
    def block_size(self) -> int:
        return self.facts.block_size

    def take_max_step_gap(self) -> StepGap:
        """The longest the core went between two steps while requests were running, and the
        longest it spent on commands there, since the last call: time spent receiving and
        admitting requests and sending outputs (or waiting for a CPU) instead of computing
        (``kvswitch bench admission`` reads it)."""
        gap, self._max_step_gap = self._max_step_gap, StepGap()
        return gap

    # -- requests ---------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray | list[int],
        params: SamplingParams,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
        hold_s: float = 0.0,
        block_hashes: list[bytes] | None = None,
        pooling: str | None = None,
        priority: int = INTERACTIVE,
    ) -> asyncio.Queue[RequestOutput | EngineError]:
        """Queue a request in the engine and return the queue its outputs will arrive on.
        ``hold_s``: once it finished, hold its cached blocks this long for a peer to fetch, under
        a lease named by ``request_id`` (``release``). ``block_hashes``: the prompt's chain
        (``self.hasher(cache_salt, lora)``), when the caller hashed it already. ``pooling``: the
        prompt's embedding comes with its first token (``LLMEngine.make_request``).
        ``priority``: ``INTERACTIVE`` or ``BATCH`` (it waits behind the interactive ones).

        Raises ValueError (a message for the user) if the request can never run, and
        ``EngineStopped`` if the engine is stopping or gone; nothing is queued then.
        """
        prompt = self.checked_prompt(
            prompt_token_ids, lora=lora, num_resumed_tokens=num_resumed_tokens, hold_s=hold_s
        )
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be 0 (interactive) or 1 (batch), not {priority!r}")
        if block_hashes is None:
            block_hashes = self.hasher(cache_salt, lora).hash_blocks(prompt)
        fields = [prompt.tobytes(), block_hashes, wire.params_to_wire(params)]
        fields += [cache_salt, num_resumed_tokens, hold_s, lora, pooling, priority]
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._check_running()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._send(wire.pack([wire.ADD, request_id, *fields]))
            self._streams[request_id] = stream
        return stream.queue

    async def submit_awaiting_kv(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray | list[int],
        params: SamplingParams,
        *,
        block_hashes: list[bytes],
        lora: str | None = None,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
        hold_s: float = 0.0,
    ) -> tuple[asyncio.Queue[RequestOutput | EngineError], PullSlots]:
        """``submit`` for a request whose prompt's KV a transfer brings from a peer: the core
        holds blocks for its whole prompt and does not run it until ``kv_landed``. Returns its
        queue and the blocks held (``PullSlots``: their ids, for a transport that writes by id;
        the ``write_blocks`` calls fill them by hash); with refused slots it computes its prompt
        once ``kv_landed``. Raises as ``submit`` (ValueError also when the core refuses it).
        """
        prompt = self.checked_prompt(
            prompt_token_ids, lora=lora, num_resumed_tokens=num_resumed_tokens, hold_s=hold_s
        )
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt logprobs are computed where the prompt is: a request that asks for them "
                "cannot take its prompt's KV from a peer"
            )
        fields = [prompt.tobytes(), block_hashes, wire.params_to_wire(params)]
        fields += [cache_salt, num_resumed_tokens, hold_s, lora, None]
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        future: Future[list[Any]] = Future()
        with self._lock:
            self._check_running()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            call_id = next(self._call_ids)
            self._send(wire.pack([wire.ADD_AWAITING_KV, call_id, request_id, *fields]))
            self._calls[call_id] = future
            self._streams[request_id] = stream
        try:
            num_cached_blocks, block_ids, refused = await asyncio.wrap_future(future)
        except BaseException:
            self.abort(request_id)  # refused, stopped or cancelled: the stream goes too
            raise
        return stream.queue, PullSlots(num_cached_blocks, block_ids, refused)

    def kv_landed(self, request_id: str, num_written_blocks: int = 0) -> Future[int]:
        """The transfer for a ``submit_awaiting_kv`` request is over, done or not; how many of
        its awaited blocks landed (``LLMEngine.kv_landed``). ``num_written_blocks``: leading
        awaited blocks a transport wrote by block id."""
        return self._call([wire.KV_LANDED], request_id, num_written_blocks)

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in the folder ``path`` as ``name`` (``LLMEngine.load_lora``);
        ValueError says why not."""
        served = await asyncio.wrap_future(self._call([wire.LOAD_LORA], name, path))
        self.loras = tuple(served)

    async def unload_lora(self, name: str) -> None:
        """Stop serving the adapter ``name`` (``LLMEngine.unload_lora``); ValueError says why
        not."""
        served = await asyncio.wrap_future(self._call([wire.UNLOAD_LORA], name))
        self.loras = tuple(served)

    def checked_prompt(
        self,
        prompt_token_ids: np.ndarray | list[int],
        *,
        lora: str | None = None,
        num_resumed_tokens: int = 0,
        hold_s: float = 0.0,
    ) -> np.ndarray:
        """The prompt as little-endian uint32, once a request with it can run; ValueError (a
        message for the user) if it never can."""
        facts = self.facts
        prompt = np.asarray(prompt_token_ids)
        check_prompt(prompt, facts.vocab_size, facts.max_model_len, num_resumed_tokens)
        check_lora_name(lora, self.loras)
        check_hold(hold_s)
        # Checked, so in range: converted once, for the hashes and the wire alike.
        return prompt.astype("<u4", copy=False)

    def abort(self, request_id: str) -> None:
        """Stop the request and free its blocks, soon, in the core."""
        with self._lock:
            if self._streams.pop(request_id, None) is None or self._ended is not None:
                return
            with contextlib.suppress(EngineStopped):
                self._send(wire.pack([wire.ABORT, request_id]))

    def release(self, lease_id: str) -> None:
        """Let the blocks a finished request held for a peer (``submit``'s ``hold_s``) go."""
        with self._lock:
            if self._ended is None:
                with contextlib.suppress(EngineStopped):
                    self._send(wire.pack([wire.RELEASE, lease_id]))

    def hasher(self, cache_salt: str | None = None, lora: str | None = None) -> BlockHasher:
        """What names this engine's blocks for a request with this salt and adapter."""
        return BlockHasher(
            self.facts.namespace,
            self.facts.block_size,
            lora=lora,
            cache_salt=cache_salt,
            naming=self.block_naming,
        )

    def snapshot(self, device_only: bool = False) -> Future[tuple[int, list[bytes]]]:
        """``(event_seq, every cached block hash)``, consistent with each other: of both tiers,
        or with ``device_only`` of the device's cache alone."""
        return self._call([wire.SNAPSHOT], device_only)

    def read_blocks(
        self,
        block_hashes: list[bytes],
        *,
        with_data: bool = True,
        into: tuple[str, int] | None = None,
        lease_id: str | None = None,
    ) -> Future[tuple[int, memoryview]]:
        """How many leading blocks of ``block_hashes`` the core holds cached, and their KV as
        bytes (``LLMEngine.read_cached_blocks``), read between two steps; no bytes without
        ``with_data``, or when written ``into`` shared memory (path, offset) instead.
        ``lease_id``: the lease they are held under, extended (the reader still wants them)."""
        return self._call([wire.READ_BLOCKS], block_hashes, with_data, into, lease_id)

    def write_blocks(self, block_hashes: list[bytes], data: bytes | memoryview) -> Future[int]:
        """Put blocks read from a worker of the same layout into the core's prefix cache
        (``LLMEngine.write_cached_blocks``); how many were new. ValueError: refused."""
        return self._call([wire.WRITE_BLOCKS], block_hashes, payload=data)

    def write_blocks_from(self, block_hashes: list[bytes], source: tuple[str, int]) -> Future[int]:
        """``write_blocks`` with the bytes in this host's shared memory: (path, offset)."""
        return self._call([wire.WRITE_BLOCKS_FROM], block_hashes, source)

    def hold_blocks(
        self, block_hashes: list[bytes], lease_id: str, hold_s: float
    ) -> Future[list[int]]:
        """The ids of the leading cached blocks of the chain, held under ``lease_id`` for a
        same-host peer to copy out of this engine's cache file (``LLMEngine.hold_cached_blocks``);
        ``release`` lets them go."""
        return self._call([wire.HOLD_BLOCKS], block_hashes, lease_id, hold_s)

    def write_blocks_mapped(
        self,
        block_hashes: list[bytes],
        peer_file: str,
        peer_num_blocks: int,
        peer_block_ids: list[int],
    ) -> Future[int]:
        """``write_blocks`` with the blocks copied straight out of a same-host peer's cache file
        (``LLMEngine.write_cached_blocks_mapped``); how many were new."""
        return self._call(
            [wire.WRITE_BLOCKS_MAPPED], block_hashes, peer_file, peer_num_blocks, peer_block_ids
        )

    def nixl_info(self) -> Future[bytes]:
        """What a peer's NIXL agent needs to read this engine's blocks
        (``LLMEngine.nixl_peer_info``); fails where NIXL is not installed."""
        return self._call([wire.NIXL_INFO])

    def write_blocks_nixl(
        self,
        block_hashes: list[bytes],
        peer_info: bytes,
        peer_block_ids: list[int],
        timeout_s: float | None = None,
    ) -> Future[int]:
        """``write_blocks`` with the blocks read over NIXL out of a peer's KV cache
        (``LLMEngine.write_cached_blocks_nixl``); how many were new."""
        return self._call(
            [wire.WRITE_BLOCKS_NIXL], block_hashes, peer_info, peer_block_ids, timeout_s
        )

    def _call(
        self, kind: list[Any], *args: Any, payload: bytes | memoryview | None = None
    ) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._check_running()
            call_id = next(self._call_ids)
            self._send(wire.pack([*kind, call_id, *args]), payload)
            self._calls[call_id] = future
        return future

    def _send(self, message: bytes, payload: bytes | memoryview | None = None) -> None:
        """Send a command (holding ``_lock``); ``EngineStopped`` if the core cannot take it."""
        try:
            # NOTE: never blocks: the pipe has no queue limit, so only a core that is gone (and
            # not yet seen to be) makes it fail.
            if payload is None:
                self._inbox.send(message, zmq.NOBLOCK, copy=False)
            else:
                self._inbox.send_multipart([message, payload], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineStopped("the engine core is not reachable") from None

    def _check_running(self) -> None:
        if self._ended is not None:
            raise self._ended
        if self._stopping:
            raise EngineStopped("the engine is shutting down")

    # -- cache events -----------------------------------------------------------------------------

    @property
    def event_seq(self) -> int:
        """Sequence number of the latest event batch (0 before the first)."""
        with self._events_lock:
            return self._event_seq

    def take_cache_events(self) -> list[EventBatch]:
        """Every buffered event batch, oldest first, and empty the buffer. Thread-safe."""
        with self._events_lock:
            batches = list(self._event_batches)
            self._event_batches.clear()
        return batches

    def _record_events(self, events: list[CacheEvent]) -> None:
        with self._events_lock:
            self._event_seq += 1
            if len(self._event_batches) == self._max_event_batches:
                self._event_batches.popleft()
                self._drop_warning.warning(
                    "cache-event buffer full (%d batches): dropping the oldest; the index "
                    "must resync from a snapshot",
                    self._max_event_batches,
                )
                self.num_dropped_event_batches += 1
            self._event_batches.append(EventBatch(self._event_seq, events))
        for listener in self._on_event_batch:
            try:
                listener(events)
            except Exception:
                logger.exception("a cache-event listener failed")
        for callback in self._on_events:
            try:
                callback()
            except Exception:
                logger.exception("a cache-event callback failed")

    # -- the receiver thread ----------------------------------------------------------------------

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._outbox, zmq.POLLIN)
        sentinel = getattr(self._core, "sentinel", None)
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(None if sentinel is not None else 1000))
            if self._outbox in ready:
                while True:
                    try:
                        message, payload = wire.receive(self._outbox, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if message[0] == wire.STOPPED:
                        self._end(EngineStopped("the engine is shutting down"))
                        return
                    self._handle(message, payload)
            elif sentinel in ready or not self._core.is_alive():
                self._died()
                return

    def _handle(self, message: list[Any], payload: memoryview | None = None) -> None:
        kind = message[0]
        if kind == wire.STEP:
            _, outputs, failed, events, load, counters, (gap_s, commands_s) = message
            self.load = LoadReport.from_wire(load)
            self.counters = CoreCounters(*counters)
            most = self._max_step_gap
            if gap_s > most.gap_s or commands_s > most.commands_s:
                self._max_step_gap = StepGap(
                    max(gap_s, most.gap_s), max(commands_s, most.commands_s)
                )
            if events:
                self._record_events(wire.events_from_wire(events))
            for request_id, why, text in failed:
                self._fail(request_id, _FAILURES[wire.Failure(why)](text))
            if outputs:
                self._deliver(wire.outputs_from_wire(outputs))
        elif kind == wire.SNAPSHOT_TAKEN:
            with self._lock:
                future = self._calls.pop(message[1], None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_result((self.event_seq, message[2]))
        elif kind == wire.REPLY:
            _, call_id, ok, value = message
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                if not ok:
                    future.set_exception(ValueError(value))
                else:
                    future.set_result(value if payload is None else (value, payload))
        else:
            logger.error("unexpected message %r from the engine core: ignored", kind)

    def _deliver(self, outputs: StepOutputs) -> None:
        # One wake-up per event loop per step, not one per request.
        loop_to_items: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                loop_to_items.setdefault(stream.loop, []).append((stream, output))
        for loop, items in loop_to_items.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                # That event loop is closed: nobody will read these requests' outputs.
                for _, output in items:
                    if not output.finished:
                        self.abort(output.request_id)

    def _fail(self, request_id: str, error: EngineError) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            # A closed event loop has nobody left to tell.
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _end(self, error: EngineStopped, on_ended: list[Callable[[str], None]] = ()) -> None:
        """The core is gone: refuse new work, run ``on_ended``, then fail every stream and
        call still waiting on it."""
        with self._lock:
            self._ended = error
            request_ids = list(self._streams)
            calls, self._calls = self._calls, {}
        for callback in on_ended:
            # First, so that the worker reports NOT_SERVING before its streams fail over.
            try:
                callback(str(error))
            except Exception:
                logger.exception("an engine-death callback failed")
        for request_id in request_ids:
            self._fail(request_id, error)
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _died(self) -> None:
        if self._stopping:
            self._end(EngineStopped("the engine is shutting down"))
            return
        message = f"the engine core died ({_describe_exit(self._core)})"
        logger.error("%s; failing its %d requests", message, len(self._streams))
        self._end(EngineDied(message), self._on_death)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.queue.put_nowait(output)


def _wait_until_ready(
    outbox: zmq.Socket, core: multiprocessing.process.BaseProcess | threading.Thread
) -> CoreFacts:
    """The core's facts once its engine is built; ``EngineStartError`` if it cannot be."""
    while not outbox.poll(200):
        if not core.is_alive():
            raise EngineStartError(
                f"the engine core died while loading the model ({_describe_exit(core)})"
            )
    kind, payload = wire.unpack(outbox.recv())
    if kind == wire.START_FAILED:
        raise EngineStartError(payload)
    assert kind == wire.READY, kind
    return CoreFacts(
        **{
            **payload,
            "kv_layout": KVLayout(**payload["kv_layout"]),
            "loras": tuple(payload.get("loras", ())),
        }
    )


def _stop_core(
    core: multiprocessing.process.BaseProcess | threading.Thread,
    timeout_s: float | None,
    *,
    warn: bool = True,
) -> None:
    core.join(timeout_s)
    if isinstance(core, multiprocessing.process.BaseProcess) and core.is_alive():
        if warn:
            logger.warning("the engine core did not stop within %s s: killing it", timeout_s)
        core.kill()
        core.join()


def _describe_exit(core: multiprocessing.process.BaseProcess | threading.Thread) -> str:
    if isinstance(core, threading.Thread):
        return "its thread ended"
    # NOTE: the sentinel can fire a moment before the process can be reaped.
    core.join(5)
    code = core.exitcode
    if code is None:
        return "its pipes closed while it still runs"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
