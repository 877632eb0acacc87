"""Runs one ``LLMEngine`` on a dedicated thread, so that model steps never block an event loop.

Who touches what::

    event loop thread(s)                      engine thread
    --------------------                      -------------
    submit() / abort() / snapshot() --call--> commands, run between two steps
    per-request asyncio.Queue  <--call_soon_threadsafe-- outputs of each step
    load (read)                <--------------- LoadReport, republished after each step
    take_cache_events() (lock) <--------------- cache-event batches, numbered in order

The engine, and everything that belongs to it, is only ever touched on the engine thread. The
thread sleeps on a condition while there is neither a command nor an unfinished request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from kvswitch.cache_index.events import CacheEvent
from kvswitch.logs import Throttled
from kvswitch.worker.request import StepFailed

if TYPE_CHECKING:
    # NOTE: type-only, so that importing this module (and the CLI) does not load torch.
    from kvswitch.worker.engine import LLMEngine, RequestOutput
    from kvswitch.worker.sampler import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long the engine thread sleeps when it has requests but the scheduler ran none of them, so
# that such a state (which only a command can change) cannot spin a core.
_IDLE_WAIT_S = 0.05


class EngineLoopError(RuntimeError):
    """The engine failed the request; it has been removed from the engine."""


class EngineStopped(EngineLoopError):
    """The loop is stopping or stopped and takes no more work."""


class EngineStepError(EngineLoopError):
    """A model step running this request raised. The request was removed and the cache kept
    clean; the engine goes on serving the others."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The engine's load as of the end of its latest step (or command)."""

    num_running_requests: int
    num_waiting_requests: int
    num_queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int


class EventBatch(NamedTuple):
    """The cache events one drain of ``engine.take_events()`` returned, numbered from 1."""

    seq: int
    events: list[CacheEvent]


class _Stream(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | EngineLoopError]


class EngineLoop:
    """Owns an ``LLMEngine`` and drives it from one background thread.

    Contract:

    * Requests go in through ``submit`` (a coroutine, from any event loop). Each gets its own
      ``asyncio.Queue``, which receives the request's outputs in order, the last one with
      ``finished`` set, or a single ``EngineLoopError`` instead if the engine fails or stops first.
      After either, nothing more is put on the queue.
    * ``abort`` stops a request and frees its blocks (applied on the engine thread); it never
      raises, and aborting a finished or unknown request does nothing.
    * ``load`` is a ``LoadReport`` as of the latest step or command; reading it never waits.
    * Cache events are drained after every step and command into a bounded buffer of event
      batches with consecutive ``seq`` numbers; ``event_seq`` is the latest one. When the buffer
      is full the oldest batch is dropped: the consumer sees a gap in ``seq`` and must resync
      from ``snapshot()`` (``num_dropped_event_batches`` counts the drops).
    * ``snapshot()`` returns ``(event_seq, cached hashes)`` taken together between two steps, so
      replaying batches ``1..event_seq`` from empty gives exactly those hashes.
    * Once started, ``engine`` belongs to the engine thread: other threads read only what never
      changes (its config, namespace) and send everything else through ``call``.
    """

    def __init__(self, engine: LLMEngine, *, max_event_batches: int = 10_000) -> None:
        if max_event_batches <= 0:
            raise ValueError(f"max_event_batches must be positive, got {max_event_batches}")
        self.engine = engine
        self._wakeup = threading.Condition()
        self._commands: deque[tuple[Callable[[LLMEngine], Any], Future[Any]]] = deque()
        self._stopping = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

        self._events_lock = threading.Lock()
        self._event_batches: deque[EventBatch] = deque()
        self._max_event_batches = max_event_batches
        self._event_seq = 0
        self.num_dropped_event_batches = 0
        self._drop_warning = Throttled(logger)  # called on the engine thread only
        self.num_failed_steps = 0
        self.load = self._measure_load()

    # -- facts that never change ------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The block-hash namespace: hashes from other namespaces are not comparable."""
        return self.engine.namespace

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish the current step, fail whatever is still pending with ``EngineStopped`` and end
        the thread. Blocks until the thread ends (or ``timeout_s`` passes)."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- requests ---------------------------------------------------------------------------------

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between two steps; raises ``EngineStopped`` once
        the loop stops. ``fn`` must be quick: no step runs while it does."""
        future: Future[T] = Future()
        with self._wakeup:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._commands.append((fn, future))
            self._wakeup.notify()
        return future

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
    ) -> asyncio.Queue[RequestOutput | EngineLoopError]:
        """Queue a request in the engine and return the queue its outputs will arrive on.

        Raises the engine's ValueError (a message for the user) if the request can never run,
        and ``EngineStopped`` if the loop is stopping; nothing is queued then.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add(engine: LLMEngine) -> None:
            engine.add_request(
                request_id,
                prompt_token_ids,
                params,
                lora=lora,
                cache_salt=cache_salt,
                num_resumed_tokens=num_resumed_tokens,
            )
            self._streams[request_id] = stream

        try:
            await asyncio.wrap_future(self.call(add))
        except asyncio.CancelledError:
            # The add may already have run; commands run in order, so this abort follows it.
            self.abort(request_id)
            raise
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Stop the request and free its blocks, soon, on the engine thread."""

        def drop(engine: LLMEngine) -> None:
            self._streams.pop(request_id, None)
            if engine.abort(request_id):
                logger.info("request %s: aborted", request_id)

        # A stopping loop aborts every request itself.
        with contextlib.suppress(EngineStopped):
            self.call(drop)

    def snapshot(self) -> Future[tuple[int, list[bytes]]]:
        """``(event_seq, every cached block hash)``, consistent with each other."""

        def take(engine: LLMEngine) -> tuple[int, list[bytes]]:
            self._record_events()
            return self.event_seq, engine.kv_cache.pool.cached_block_hashes()

        return self.call(take)

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

    def _record_events(self) -> None:
        events = self.engine.take_events()
        if not events:
            return
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

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        device = engine.runner.device
        if device.type == "cuda":
            import torch

            # NOTE: a new thread's current CUDA device is cuda:0, and Triton launches its kernels
            # on the current device, whatever device the tensors are on.
            torch.cuda.set_device(device)
        idle = False  # the latest step scheduled nothing
        while (commands := self._wait_for_work(idle)) is not None:
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(engine))
                    except Exception as e:
                        future.set_exception(e)
            idle = False
            if engine.has_unfinished():
                num_steps = engine.stats.num_steps
                self._step()
                idle = engine.stats.num_steps == num_steps
            self._record_events()
            self.load = self._measure_load()
        self._shutdown()

    def _wait_for_work(self, idle: bool) -> deque[tuple[Callable, Future]] | None:
        """The commands to run before the next step (maybe none); None once stopping."""
        with self._wakeup:
            if idle:
                # NOTE: requests the scheduler could not run stay unrunnable until a command
                # changes something; wait for one, but only briefly, rather than spin.
                if not (self._commands or self._stopping):
                    self._wakeup.wait(_IDLE_WAIT_S)
            else:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._wakeup.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, deque()
            return commands

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailed as e:
            logger.error(
                "engine step failed; failing its %d requests", len(e.request_ids), exc_info=e
            )
            self.num_failed_steps += 1
            self._fail(e.request_ids, EngineStepError(f"the engine failed running it: {e}"))
            return
        except Exception:
            # Not the engine's contract: nothing about its requests can be trusted any more.
            logger.exception("engine step failed; failing all %d requests", len(self._streams))
            self.num_failed_steps += 1
            self._fail_all(EngineStepError("the engine failed while running this request"))
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up per event loop per step, not one per request.
        loop_to_items: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
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
                        self._streams.pop(output.request_id, None)
                        self.engine.abort(output.request_id)

    def _fail(self, request_ids: list[str], error: EngineLoopError) -> None:
        """Tell these (already removed) requests' streams that they failed."""
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                # A closed event loop has nobody left to tell.
                with contextlib.suppress(RuntimeError):
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _fail_all(self, error: EngineLoopError) -> None:
        request_ids = list(self._streams)
        for request_id in request_ids:
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("request %s: abort failed", request_id)
        self._fail(request_ids, error)

    def _shutdown(self) -> None:
        with self._wakeup:
            commands, self._commands = self._commands, deque()
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine is shutting down"))
        self._fail_all(EngineStopped("the engine is shutting down"))
        self._record_events()
        self.load = self._measure_load()

    def _measure_load(self) -> LoadReport:
        engine = self.engine
        scheduler = engine.scheduler
        return LoadReport(
            num_running_requests=len(scheduler.running),
            num_waiting_requests=len(scheduler.waiting),
            num_queued_prefill_tokens=scheduler.num_queued_prefill_tokens(),
            num_free_blocks=engine.kv_cache.num_free_blocks,
            num_total_blocks=engine.kv_cache.pool.num_blocks,
            block_size=engine.config.block_size,
        )


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.queue.put_nowait(output)
