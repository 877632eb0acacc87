"""The engine core: one ``LLMEngine`` driven in a loop, fed and drained over ZeroMQ pipes.

It runs in a process of its own (``core_process_main``), so the model's steps and the serving
process's gRPC streaming never share a GIL; or, for debugging and profiling in one process, on a
thread (``EngineCore.run`` over ``inproc://`` pipes). ``engine_client.EngineClient`` is the other
end; ``core_protocol`` is what they say.

The loop::

    commands = everything that arrived (wait for one when there is nothing to step)
    answer the NIXL reads it posted that are over
    run them: add, abort, snapshot, block transfers in and out (a NIXL read: posted)
    step once, if any request is unfinished
    send one STEP: the step's outputs, the requests it failed, the cache events, the load

Requests arrive admitted: checked and hashed by the serving process, their prompt one byte
string. The core's input thread decodes each message and builds the request (a buffer copy)
while the loop computes, so taking one in costs the loop a queue pop and a dict insert.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from kvswitch.logs import LogSettings, configure_logging
from kvswitch.worker import core_protocol as wire
from kvswitch.worker.request import Request, StepFailed, StepOutputs
from kvswitch.worker.startup import process_age_s

if TYPE_CHECKING:
    from kvswitch.worker.engine import LLMEngine
    from kvswitch.worker.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# How long the loop sleeps when it has requests but the scheduler ran none of them, so that such
# a state (which only a command can change) cannot spin a core.
_IDLE_WAIT_S = 0.05
# How often a core with nothing to do checks that the serving process is still there.
_ORPHAN_CHECK_S = 1.0
# A command the input thread queues when it fails: the core cannot go on without its input.
_INPUT_FAILED = -1
_WAKE = -2  # the host tier finished a copy: look again (a step takes landed loads)
# What a call returns that is answered later (a NIXL read posted).
_LATER = object()
# How long the loop waits for commands, at most, while a NIXL read it posted runs.
_NIXL_POLL_S = 5e-4


class _ServingProcessGone(Exception):
    """Nobody reads what the core sends any more."""


class EngineCore:
    """Owns the engine. Two threads: the step loop (the thread that calls ``run``), which alone
    touches the engine's state and sends; and an input thread, which receives and decodes
    commands and builds arriving requests (``LLMEngine.make_request``) while the loop computes,
    so that taking a request in costs the loop a queue pop and a dict insert."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self._inbox = inbox  # the input thread's alone
        self._outbox = outbox
        self._arrived: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._input_stop = threading.Event()
        self._input = threading.Thread(target=self._read, name="engine-core-input", daemon=True)
        engine.max_model_len  # noqa: B018  (computed once here, read by the input thread)
        self._num_failed_steps = 0
        self._num_integrity_checks = 0
        self._outputs = StepOutputs()  # of the one step since the last STEP message
        self._failed: list[list[Any]] = []
        # From the end of a step that left work behind to the start of the next one: what
        # receiving and admitting requests, and sending outputs, cost the running requests.
        self._last_step_end: float | None = None
        self._step_gap_s = 0.0
        self._commands_s = 0.0  # of which running the commands that arrived
        self._host_sent = (0, 0, 0)  # the host tier figures the latest STEP carried
        if engine.offload is not None:
            # NOTE: a load that lands wakes the loop at once, not at its next idle poll.
            engine.offload.on_progress = lambda: self._arrived.put([_WAKE])

    @staticmethod
    def facts(engine: LLMEngine) -> wire.CoreFacts:
        return wire.CoreFacts(
            namespace=engine.namespace,
            block_size=engine.config.block_size,
            num_blocks=engine.kv_cache.pool.num_blocks,
            vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.max_model_len,
            kv_layout=engine.kv_layout,
            kv_cache_file=engine.kv_cache_file or "",
            device=engine.config.device,
            loras=tuple(engine.loras.names) if engine.loras is not None else (),
            num_host_blocks=engine.offload.num_blocks if engine.offload is not None else 0,
        )

    def run(self, parent_pid: int | None = None) -> None:
        """Serve until STOP, then fail what is left and send STOPPED. ``parent_pid``: stop at
        once, dropping everything, when that process is gone (nobody is left to tell)."""
        self._input.start()
        try:
            self._loop(parent_pid)
        except _ServingProcessGone:
            logger.error("the serving process is gone; the engine core stops")
            return
        finally:
            self._input_stop.set()
            self._input.join()
        self._shutdown()

    def _loop(self, parent_pid: int | None) -> None:
        engine = self.engine
        idle = False  # the latest step scheduled nothing
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                raise _ServingProcessGone
            if engine.has_unfinished():
                timeout = _IDLE_WAIT_S if idle else 0.0
            else:
                timeout = _ORPHAN_CHECK_S if parent_pid is not None else None
            lease_end_s = engine.kv_cache.next_lease_end_s
            if lease_end_s is not None:
                # NOTE: woken when the first lease runs out, so that a peer that never came for
                # the blocks frees them on time even on an idle worker.
                lease_wait_s = max(lease_end_s - time.monotonic(), 0.0)
                timeout = lease_wait_s if timeout is None else min(lease_wait_s, timeout)
            if engine.num_nixl_writes:
                timeout = min(timeout, _NIXL_POLL_S) if timeout is not None else _NIXL_POLL_S
            # NOTE: the host tier's copies end on a thread of their own: the STEP that says so
            # goes out even when nothing else is left to do.
            host_moved = engine.offload is not None and engine.host_report() != self._host_sent
            if host_moved:
                timeout = 0.0
            commands = self._take_commands(timeout)
            num_released = len(engine.release_expired_leases()) if lease_end_s is not None else 0
            num_answered = self._answer_nixl_writes() if engine.num_nixl_writes else 0
            if not (
                commands or engine.has_unfinished() or num_released or num_answered or host_moved
            ):
                continue
            commands_start = time.perf_counter()
            if not self._run_commands(commands):
                return
            self._commands_s = time.perf_counter() - commands_start
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
            if engine.config.check_integrity and not engine.has_unfinished():
                # NOTE: raises on a broken invariant, which ends the core: a bug, not a request's
                # fault, and nothing it computes after can be trusted.
                engine.kv_cache.check_integrity()
                self._num_integrity_checks += 1
            self._send_step()

    # -- commands ---------------------------------------------------------------------------------

    def _read(self) -> None:
        """The input thread: receive, decode, and build requests, until STOP."""
        try:
            while not self._input_stop.is_set():
                if not self._inbox.poll(100):
                    continue
                message, payload = wire.receive(self._inbox)
                if payload is not None:
                    message.append(payload)  # the blocks' bytes of a WRITE_BLOCKS
                if message[0] == wire.ADD:
                    message = [wire.ADD, self._make_request(*message[1:])]
                elif message[0] == wire.ADD_AWAITING_KV:
                    message = [*message[:2], self._make_request(*message[2:])]
                self._arrived.put(message)
                if message[0] == wire.STOP:
                    return
        except Exception:
            logger.exception("the engine core's input thread failed")
            self._arrived.put([_INPUT_FAILED])

    def _make_request(
        self,
        request_id: str,
        prompt: bytes,
        block_hashes: list[bytes],
        params: list[Any],
        cache_salt: str | None,
        num_resumed_tokens: int,
        hold_s: float,
        lora: str | None,
        pooling: str | None = None,
        priority: int = 0,
        *unknown: Any,
    ) -> Request | tuple[str, str]:
        """The request, or ``(request_id, why it cannot run)``."""
        try:
            return self.engine.make_request(
                request_id,
                wire.prompt_from_bytes(prompt),
                wire.params_from_wire(params),
                lora=lora,
                cache_salt=cache_salt,
                num_resumed_tokens=num_resumed_tokens,
                block_hashes=block_hashes,
                hold_s=hold_s,
                pooling=pooling,
                priority=priority,
            )
        except ValueError as e:
            return request_id, str(e)

    def _take_commands(self, timeout: float | None) -> list[list[Any]]:
        """What has arrived; waits up to ``timeout`` (None: for ever) for a first command."""
        commands = []
        try:
            if timeout == 0.0:
                commands.append(self._arrived.get_nowait())
            else:
                commands.append(self._arrived.get(timeout=timeout))
            while True:
                commands.append(self._arrived.get_nowait())
        except queue.Empty:
            return commands

    def _run_commands(self, commands: list[list[Any]]) -> bool:
        """Run the commands, in order; False on STOP."""
        for message in commands:
            kind = message[0]
            if kind == wire.ADD:
                self._add(message[1])
            elif kind == wire.ABORT:
                if self.engine.abort(message[1]):
                    logger.info("request %s: aborted", message[1])
            elif kind == wire.RELEASE:
                self.engine.release_lease(message[1])
            elif kind == wire.SNAPSHOT:
                # Every event before the snapshot travels first, in a STEP of its own.
                self._send_step()
                device_only = len(message) > 2 and message[2]
                if device_only:
                    hashes = self.engine.kv_cache.pool.cached_block_hashes()
                else:
                    hashes = self.engine.cached_block_hashes()
                self._send([wire.SNAPSHOT_TAKEN, message[1], hashes])
            elif kind == wire.READ_BLOCKS:
                self._reply(message[1], self.engine.read_cached_blocks, *message[2:])
            elif kind == wire.WRITE_BLOCKS:
                self._reply(message[1], self.engine.write_cached_blocks, *message[2:])
            elif kind == wire.WRITE_BLOCKS_FROM:
                self._reply(message[1], self.engine.write_cached_blocks_from, *message[2:])
            elif kind == wire.HOLD_BLOCKS:
                self._reply(message[1], self.engine.hold_cached_blocks, *message[2:])
            elif kind == wire.WRITE_BLOCKS_MAPPED:
                self._reply(message[1], self.engine.write_cached_blocks_mapped, *message[2:])
            elif kind == wire.NIXL_INFO:
                self._reply(message[1], self.engine.nixl_peer_info)
            elif kind == wire.WRITE_BLOCKS_NIXL:
                self._reply(message[1], self._write_blocks_nixl, *message[1:])
            elif kind == wire.ADD_AWAITING_KV:
                self._reply(message[1], self._add_awaiting_kv, message[2])
            elif kind == wire.KV_LANDED:
                self._reply(message[1], self.engine.kv_landed, *message[2:])
            elif kind == wire.LOAD_LORA:
                self._reply(message[1], self.engine.load_lora, *message[2:])
            elif kind == wire.UNLOAD_LORA:
                self._reply(message[1], self.engine.unload_lora, *message[2:])
            elif kind == wire.STOP:
                return False
            elif kind == _INPUT_FAILED:
                raise RuntimeError("the engine core's input thread failed")
            elif kind == _WAKE:
                pass
            else:
                logger.error("unknown command %r: ignored", kind)
        return True

    def _reply(self, call_id: int, call: Callable[..., Any], *args: Any) -> None:
        """Run a call between steps and send its value, or why it failed, back. A call that
        returns ``(value, bytes)`` (a read of blocks) sends the bytes as a frame of their own."""
        try:
            value = call(*args)
        except ValueError as e:
            self._send([wire.REPLY, call_id, False, str(e)])
        except Exception as e:
            logger.exception("call %d failed", call_id)
            self._send([wire.REPLY, call_id, False, f"{type(e).__name__}: {e}"])
        else:
            if value is _LATER:
                return
            value, payload = value if isinstance(value, tuple) else (value, None)
            self._send([wire.REPLY, call_id, True, value], payload)

    def _write_blocks_nixl(self, call_id: int, *args: Any) -> Any:
        """The call posts its read, when it can, and is answered once the read is over
        (``_answer_nixl_writes``): steps go on meanwhile."""
        written = self.engine.write_cached_blocks_nixl(call_id, *args)
        return _LATER if written is None else written

    def _answer_nixl_writes(self) -> int:
        """Answer the NIXL reads that are over (each tagged with the call that posted it); how
        many were."""
        over = self.engine.poll_nixl_writes()
        for call_id, result in over:
            if isinstance(result, ValueError):
                self._send([wire.REPLY, call_id, False, str(result)])
            else:
                self._send([wire.REPLY, call_id, True, result])
        return len(over)

    def _add(self, request: Request | tuple[str, str]) -> None:
        if isinstance(request, tuple):
            request_id, why = request
            self._failed.append([request_id, wire.Failure.REJECTED, why])
            return
        try:
            self.engine.add(request)
        except ValueError as e:
            self._failed.append([request.request_id, wire.Failure.REJECTED, str(e)])

    def _add_awaiting_kv(self, request: Request | tuple[str, str]) -> list[Any]:
        if isinstance(request, tuple):
            raise ValueError(request[1])
        slots = self.engine.add_awaiting_kv(request)
        return [slots.num_cached_blocks, slots.block_ids, slots.refused]

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
        self._outputs = outputs

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
        self._host_sent = engine.host_report()
        load = [
            len(scheduler.running),
            scheduler.num_waiting,
            scheduler.num_queued_prefill_tokens(),
            engine.kv_cache.num_free_blocks,
            engine.kv_cache.pool.num_blocks,
            engine.config.block_size,
            *engine.lora_report(),
            *self._host_sent,
        ]
        counters = [
            engine.stats.num_steps,
            engine.stats.num_preemptions,
            self._num_failed_steps,
            self._num_integrity_checks,
            engine.loras.num_slot_loads if engine.loras is not None else 0,
            engine.loras.num_disk_loads if engine.loras is not None else 0,
        ]
        events = wire.events_to_wire(engine.take_events())
        gap = [self._step_gap_s, self._commands_s]
        outputs = wire.outputs_to_wire(self._outputs)
        self._send([wire.STEP, outputs, self._failed, events, load, counters, gap])
        self._outputs, self._failed = StepOutputs(), []
        self._step_gap_s = self._commands_s = 0.0

    def _send(self, message: list[Any], payload: bytes | None = None) -> None:
        try:
            # NOTE: never blocks: the pipe has no queue limit, so only a reader that is gone
            # makes it fail (a blocking send would then wait forever).
            wire.send(self._outbox, message, payload, zmq.NOBLOCK)
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
    spawn_s: float | None = None,
) -> None:
    """Connect the pipes, build the engine (START_FAILED saying why it cannot be), send READY and
    run until STOP. Both placements, process and thread, start here. ``spawn_s``: how long the
    core's own process took to get here (logged)."""
    inbox = wire.open_pipe_end(context, zmq.PULL, inbox_address, bind=False)
    outbox = wire.open_pipe_end(context, zmq.PUSH, outbox_address, bind=False)
    engine = None
    try:
        try:
            engine = _build_engine(config, spawn_s)
        except (ValueError, OSError) as e:
            outbox.send(wire.pack([wire.START_FAILED, str(e)]))
            return
        # NOTE: what was built so far (the model, torch's and the engine's objects) lives as
        # long as the core; frozen, a garbage collection, which admitting a long prompt's
        # thousands of hashes can set off, no longer walks it between two steps (3.5 ms -> 0.04
        # ms at worst for a 128K-token prompt's admission on cpu-2c).
        gc.freeze()
        outbox.send(wire.pack([wire.READY, wire.facts_to_wire(EngineCore.facts(engine))]))
        EngineCore(engine, inbox, outbox).run(parent_pid)
    finally:
        if engine is not None:
            engine.close()
        gc.unfreeze()  # so that what was frozen is collected, not reported leaked, at exit
        # NOTE: LINGER 0 would drop what is still queued; give the last messages time to leave.
        outbox.setsockopt(zmq.LINGER, 5000)
        inbox.close()
        outbox.close()


def _build_engine(config: EngineConfig, spawn_s: float | None = None) -> LLMEngine:
    """``spawn_s``: how long the core's process took to reach its entry point, for the log."""
    started_s = time.perf_counter()
    from kvswitch.worker.engine import LLMEngine

    imported_s = time.perf_counter()
    if config.cpu_threads:
        import torch

        torch.set_num_threads(config.cpu_threads)
    engine = LLMEngine(config)
    built_s = time.perf_counter()
    logger.info(
        "engine built: %s%.2f s to import the engine's modules, %.2f s to load the model and "
        "allocate its KV cache",
        "" if spawn_s is None else f"{spawn_s:.2f} s to start the process, ",
        imported_s - started_s, built_s - imported_s,
        extra={
            **({} if spawn_s is None else {"startup_core_spawn_s": round(spawn_s, 3)}),
            "startup_core_imports_s": round(imported_s - started_s, 3),
            "startup_engine_build_s": round(built_s - imported_s, 3),
        },
    )  # fmt: skip
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
    log: LogSettings,
) -> None:
    """The engine core process's entry point (started with multiprocessing's spawn)."""
    spawn_s = process_age_s()  # the interpreter, and what unpickling this call imported
    # Ctrl-C reaches the whole process group; the serving process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log.level, json=log.json, process_fields=log.process_fields)
    context = zmq.Context()
    try:
        build_and_run(config, context, inbox_address, outbox_address, parent_pid, spawn_s)
    finally:
        context.term()
