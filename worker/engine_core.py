"""The engine core: one ``LLMEngine`` driven in a loop, fed and drained over ZeroMQ pipes.

It runs in a process of its own (``core_process_main``), so the model's steps and the serving
process's gRPC streaming never share a GIL; or, for debugging and profiling in one process, on a
thread (``EngineCore.run`` over ``inproc://`` pipes). ``engine_client.EngineClient`` is the other
end; ``core_protocol`` is what they say.

The loop::

    commands = everything that arrived (wait for one when there is nothing to step)
    run them: add, abort, snapshot
    step once, if any request is unfinished
    send one STEP: the step's outputs, the requests it failed, the cache events, the load

Requests arrive admitted: checked and hashed by the serving process, their prompt one byte
string, so taking one in costs the core a buffer copy and a dict insert, not a pass over the
tokens in Python.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import zmq

from kvswitch.logs import configure_logging
from kvswitch.worker import core_protocol as wire
from kvswitch.worker.request import StepFailed

if TYPE_CHECKING:
    from kvswitch.worker.engine import LLMEngine
    from kvswitch.worker.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# How long the loop sleeps when it has requests but the scheduler ran none of them, so that such
# a state (which only a command can change) cannot spin a core.
_IDLE_WAIT_MS = 50
# How often a core with nothing to do checks that the serving process is still there.
_ORPHAN_CHECK_MS = 1000


class _ServingProcessGone(Exception):
    """Nobody reads what the core sends any more."""


class EngineCore:
    """Owns the engine; everything here runs on the one thread that calls ``run``."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._num_failed_steps = 0
        self._outputs: list[list[Any]] = []
        self._failed: list[list[Any]] = []
        # From the end of a step that left work behind to the start of the next one: what
        # receiving and admitting requests, and sending outputs, cost the running requests.
        self._last_step_end: float | None = None
        self._step_gap_s = 0.0

    @staticmethod
    def facts(engine: LLMEngine) -> wire.CoreFacts:
        return wire.CoreFacts(
            namespace=engine.namespace,
            block_size=engine.config.block_size,
            num_blocks=engine.kv_cache.pool.num_blocks,
            vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.max_model_len,
        )

    def run(self, parent_pid: int | None = None) -> None:
        """Serve until STOP, then fail what is left and send STOPPED. ``parent_pid``: stop at
        once, dropping everything, when that process is gone (nobody is left to tell)."""
        try:
            self._loop(parent_pid)
        except _ServingProcessGone:
            logger.error("the serving process is gone; the engine core stops")
            return
        self._shutdown()

    def _loop(self, parent_pid: int | None) -> None:
        engine = self.engine
        idle = False  # the latest step scheduled nothing
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                raise _ServingProcessGone
            if engine.has_unfinished():
                timeout = _IDLE_WAIT_MS if idle else 0
            else:
                timeout = _ORPHAN_CHECK_MS if parent_pid is not None else None
            if not self._poller.poll(timeout) and not engine.has_unfinished():
                continue
            if not self._run_commands():
                return
            idle = False
            if engine.has_unfinished():
                num_steps = engine.stats.num_steps
                start = time.perf_counter()
                if self._last_step_end is not None:
                    self._step_gap_s = start - self._last_step_end
                self._step()
                idle = engine.stats.num_steps == num_steps
                # Only a step that leaves work behind starts a gap: the wait for new work is not.
                self._last_step_end = time.perf_counter() if engine.has_unfinished() else None
            self._send_step()

    # -- commands ---------------------------------------------------------------------------------

    def _run_commands(self) -> bool:
        """Run every command that has arrived, in order; False on STOP."""
        while True:
            try:
                message = wire.unpack(self._inbox.recv(zmq.NOBLOCK, copy=True))
            except zmq.Again:
                return True
            kind = message[0]
            if kind == wire.ADD:
                self._add(*message[1:])
            elif kind == wire.ABORT:
                if self.engine.abort(message[1]):
                    logger.info("request %s: aborted", message[1])
            elif kind == wire.SNAPSHOT:
                # Every event before the snapshot travels first, in a STEP of its own.
                self._send_step()
                hashes = self.engine.kv_cache.pool.cached_block_hashes()
                self._send([wire.SNAPSHOT_TAKEN, message[1], hashes])
            elif kind == wire.STOP:
                return False
            else:
                logger.error("unknown command %r: ignored", kind)

    def _add(
        self,
        request_id: str,
        prompt: bytes,
        block_hashes: list[bytes],
        params: list[Any],
        cache_salt: str | None,
        num_resumed_tokens: int,
    ) -> None:
        try:
            self.engine.add_request(
                request_id,
                wire.prompt_from_bytes(prompt),
                wire.params_from_wire(params),
                cache_salt=cache_salt,
                num_resumed_tokens=num_resumed_tokens,
                block_hashes=block_hashes,
            )
        except ValueError as e:
            self._failed.append([request_id, wire.Failure.REJECTED, str(e)])

    # -- steps ------------------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailed as e:
            logger.error(
                "engine step failed; failing its %d requests", len(e.request_ids), exc_info=e
            )
            self._num_failed_steps += 1
            message = f"the engine failed running it: {e}"
            self._failed += [[r, wire.Failure.STEP_FAILED, message] for r in e.request_ids]
            return
        except Exception:
            # Not the engine's contract: nothing about its requests can be trusted any more.
            logger.exception(
                "engine step failed; failing all %d requests", len(self.engine.requests)
            )
            self._num_failed_steps += 1
            self._fail_all(wire.Failure.STEP_FAILED, "the engine failed while running this request")
            return
        self._outputs += [wire.output_to_wire(o) for o in outputs]

    def _fail_all(self, why: wire.Failure, message: str) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("request %s: abort failed", request_id)
            self._failed.append([request_id, why, message])

    def _send_step(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        load = [
            len(scheduler.running),
            len(scheduler.waiting),
            scheduler.num_queued_prefill_tokens(),
            engine.kv_cache.num_free_blocks,
            engine.kv_cache.pool.num_blocks,
            engine.config.block_size,
        ]
        counters = [engine.stats.num_steps, engine.stats.num_preemptions, self._num_failed_steps]
        events = wire.events_to_wire(engine.take_events())
        message = [wire.STEP, self._outputs, self._failed, events, load, counters, self._step_gap_s]
        self._send(message)
        self._outputs, self._failed, self._step_gap_s = [], [], 0.0

    def _send(self, message: list[Any]) -> None:
        try:
            # NOTE: never blocks: the pipe has no queue limit, so only a reader that is gone
            # makes it fail (a blocking send would then wait forever).
            self._outbox.send(wire.pack(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise _ServingProcessGone from None

    def _shutdown(self) -> None:
        self._fail_all(wire.Failure.STOPPED, "the engine is shutting down")
        self._send_step()
        self._send([wire.STOPPED])


def build_and_run(
    config: EngineConfig,
    context: zmq.Context,
    inbox_address: str,
    outbox_address: str,
    parent_pid: int | None = None,
) -> None:
    """Connect the pipes, build the engine (START_FAILED saying why it cannot be), send READY and
    run until STOP. Both placements, process and thread, start here."""
    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    for socket in (inbox, outbox):
        wire.configure(socket)
    inbox.connect(inbox_address)
    outbox.connect(outbox_address)
    try:
        try:
            engine = _build_engine(config)
        except (ValueError, OSError) as e:
            outbox.send(wire.pack([wire.START_FAILED, str(e)]))
            return
        outbox.send(wire.pack([wire.READY, wire.facts_to_wire(EngineCore.facts(engine))]))
        EngineCore(engine, inbox, outbox).run(parent_pid)
    finally:
        # NOTE: LINGER 0 would drop what is still queued; give the last messages time to leave.
        outbox.setsockopt(zmq.LINGER, 5000)
        inbox.close()
        outbox.close()


def _build_engine(config: EngineConfig) -> LLMEngine:
    from kvswitch.worker.engine import LLMEngine

    engine = LLMEngine(config)
    device = engine.runner.device
    if device.type == "cuda":
        import torch

        # NOTE: a new thread's current CUDA device is cuda:0, and Triton launches its kernels on
        # the current device, whatever device the tensors are on.
        torch.cuda.set_device(device)
    return engine


def core_process_main(
    config: EngineConfig,
    inbox_address: str,
    outbox_address: str,
    parent_pid: int,
    log_level: int,
    log_json: bool,
) -> None:
    """The engine core process's entry point (started with multiprocessing's spawn)."""
    # Ctrl-C reaches the whole process group; the serving process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, json=log_json)
    context = zmq.Context()
    try:
        build_and_run(config, context, inbox_address, outbox_address, parent_pid)
    finally:
        context.term()
