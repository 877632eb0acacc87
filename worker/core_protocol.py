"""What the serving process and its engine core say to each other.

Two one-way ZeroMQ pipes (PUSH to PULL) over Unix sockets in a private directory, one msgpack
array a message, its first element the kind. Messages on one pipe arrive in the order they were
sent, which the cache-event numbering relies on.

Serving process to core::

    [ADD, request_id, prompt (little-endian uint32 bytes), block_hashes, params, cache_salt,
     num_resumed_tokens, hold_s, lora, pooling, priority]
                                       priority: 0 interactive, 1 batch (absent: 0)
    [ABORT, request_id]
    [RELEASE, lease_id]                a finished request's blocks, held for a peer, can go
    [SNAPSHOT, call_id, device_only]   device_only: the device tier's hashes alone
    [READ_BLOCKS, call_id, block_hashes, with_data, into, lease_id]
                                       into: None or [shm path, offset]; lease_id: None or the
                                       lease to extend
    [WRITE_BLOCKS, call_id, block_hashes]  + the blocks' bytes as a second frame
    [WRITE_BLOCKS_FROM, call_id, block_hashes, [shm path, offset]]
    [HOLD_BLOCKS, call_id, block_hashes, lease_id, hold_s]
    [WRITE_BLOCKS_MAPPED, call_id, block_hashes, peer cache file, its num_blocks, peer block ids]
    [NIXL_INFO, call_id]               this engine's NIXL peer info (its agent made on first use)
    [WRITE_BLOCKS_NIXL, call_id, block_hashes, peer's NIXL peer info, peer block ids, timeout_s]
    [ADD_AWAITING_KV, call_id, request_id, prompt, block_hashes, params, cache_salt,
     num_resumed_tokens, hold_s, lora, pooling]
                                       ADD for a request whose prompt's KV a transfer brings:
                                       its blocks are held, it waits for KV_LANDED
    [KV_LANDED, call_id, request_id, num_written_blocks]
                                       its transfer is over; num_written_blocks: leading awaited
                                       blocks a transport wrote by id (the WRITEs count anyway)
    [LOAD_LORA, call_id, name, path]   serve a LoRA adapter from now on
    [UNLOAD_LORA, call_id, name]       stop serving one (refused while requests name it)
    [STOP]

Core to serving process::

    [READY, facts]                     once, when the engine is built
    [START_FAILED, message]            instead, when it cannot be
    [STEP, outputs, failed, events, load, counters, [step_gap_s, commands_s]]
                                       after every round of commands and step
    [SNAPSHOT_TAKEN, call_id, hashes]  after a STEP that carries every event before it
    [REPLY, call_id, ok, value]        to READ_BLOCKS (num_blocks, + their bytes as a second
                                       frame, unless written to shm), HOLD_BLOCKS (block ids)
                                       the WRITEs (num written), NIXL_INFO (bytes),
                                       ADD_AWAITING_KV
                                       ([num_cached_blocks, block ids, refused]),
                                       KV_LANDED (num landed) and the LORA calls (the adapters
                                       served);
                                       when not ok, value is the error's message
    [STOPPED]                          last

A STEP's outputs are columns (``StepOutputs``): [request_ids, token_ids, first, finished,
logprobs, prompt_logprobs, embeddings], ``first`` holding [request_id, num_prompt_tokens,
num_cached_tokens, ttft_s] and ``finished`` [request_id, finish reason] for the few requests they
concern; ``logprobs`` [request_id, logprobs] for the requests that asked for them,
``prompt_logprobs`` [request_id, logprobs] and ``embeddings`` [request_id, floats] for those
whose prompt the step finished. Logprobs travel as columns (``Logprobs``): [logprobs (float32
bytes), num_top, top token ids (int32 bytes), top logprobs (float32 bytes)]. ``params`` are
[max_tokens, temperature, top_p, seed, stop_token_ids, logprobs, prompt_logprobs]; a reader
takes the fields it knows and the defaults of those not sent.

Only ids, token ids, hashes and numbers travel; a prompt travels as one byte string, and so do
the KV blocks a worker sends or takes (``kv_transfer``'s layout).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from kvswitch.worker.kv_layout import KVLayout
from kvswitch.worker.request import FinishReason, FirstToken, Logprobs, SamplingParams, StepOutputs

# Serving process -> core.
(
    ADD,
    ABORT,
    SNAPSHOT,
    STOP,
    READ_BLOCKS,
    WRITE_BLOCKS,
    WRITE_BLOCKS_FROM,
    RELEASE,
    HOLD_BLOCKS,
    WRITE_BLOCKS_MAPPED,
) = range(10)
ADD_AWAITING_KV, KV_LANDED, NIXL_INFO, WRITE_BLOCKS_NIXL, LOAD_LORA, UNLOAD_LORA = range(16, 22)
# Core -> serving process.
READY, START_FAILED, STEP, SNAPSHOT_TAKEN, STOPPED, REPLY = range(10, 16)


class Failure(enum.IntEnum):
    """Why the core failed a request it had accepted."""

    REJECTED = 0  # add_request refused it (the serving process checks first, so rarely)
    STEP_FAILED = 1  # a step running it raised
    STOPPED = 2  # the core is stopping


@dataclass(frozen=True, slots=True)
class CoreFacts:
    """What never changes about a built engine, sent once in READY."""

    namespace: str
    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int
    kv_layout: KVLayout  # how its blocks travel as bytes
    kv_cache_file: str = ""  # its KV cache in this host's shared memory; empty: not there
    device: str = "cpu"  # where the model runs: "cpu", "cuda", "cuda:1", ...
    loras: tuple[str, ...] = ()  # the LoRA adapters it serves, by name
    num_host_blocks: int = 0  # its host tier's size in blocks (--offload-gb); 0: none


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The engine's load as of the end of its latest step (or command)."""

    num_running_requests: int
    num_waiting_requests: int
    num_queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    # The LoRA adapters: served, in a device slot, in host memory; and the slots holding none.
    loras: tuple[str, ...] = ()
    loaded_loras: tuple[str, ...] = ()
    cpu_loras: tuple[str, ...] = ()
    num_free_lora_slots: int = 0
    # The host-memory tier (--offload-gb): its cached blocks, its size, and its copies in flight
    # (blocks being copied out, loads not landed).
    num_host_blocks: int = 0
    num_host_total_blocks: int = 0
    num_host_copies: int = 0

    @classmethod
    def from_wire(cls, load: list[Any]) -> LoadReport:
        """[6 counts, loras, loaded, cpu, num_free_slots, host figures...]: a reader takes the
        fields it knows."""
        loras, loaded, cpu, num_free_slots = load[6:10]
        host = load[10:13]
        return cls(*load[:6], tuple(loras), tuple(loaded), tuple(cpu), num_free_slots, *host)


@dataclass(frozen=True, slots=True)
class StepGap:
    """How long the core went between two steps while requests were running, and how much of
    that it spent running the commands that had arrived (admitting requests, mostly)."""

    gap_s: float = 0.0
    commands_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CoreCounters:
    """Running totals the core keeps, as of its latest STEP."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_failed_steps: int = 0
    num_integrity_checks: int = 0  # with EngineConfig.check_integrity: checks passed
    num_lora_slot_loads: int = 0  # LoRA adapters put in a device slot
    num_lora_disk_loads: int = 0  # LoRA adapters read from their folder again (not at start)


def open_pipe_end(context: zmq.Context, kind: int, address: str, *, bind: bool) -> zmq.Socket:
    """One end of a pipe (``zmq.PUSH`` or ``zmq.PULL``): no queue limit (a full queue would block
    the sender, and each side drains as fast as it can), nothing kept for a peer once closed.
    The serving process binds; the core connects."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes | memoryview) -> list[Any]:
    return msgpack.unpackb(data, raw=False, use_list=True)


def send(socket: zmq.Socket, message: list[Any], payload: Any = None, flags: int = 0) -> None:
    """Send a message, and ``payload`` (bytes-like) after it as a frame of its own: large
    bytes travel without being copied into the message and out again."""
    if payload is None:
        socket.send(pack(message), flags, copy=False)
    else:
        socket.send_multipart([pack(message), payload], flags, copy=False)


def receive(socket: zmq.Socket, flags: int = 0) -> tuple[list[Any], memoryview | None]:
    """The next message, and its payload frame if it has one (a view of the received frame)."""
    frames = socket.recv_multipart(flags, copy=False)
    payload = frames[1].buffer if len(frames) > 1 else None
    return unpack(frames[0].buffer), payload


# -- pieces of messages ----------------------------------------------------------------------------


def prompt_from_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<u4")


def params_to_wire(params: SamplingParams) -> list[Any]:
    return [
        params.max_tokens,
        params.temperature,
        params.top_p,
        params.seed,
        list(params.stop_token_ids),
        params.logprobs,
        params.prompt_logprobs,
    ]


def params_from_wire(fields: list[Any]) -> SamplingParams:
    max_tokens, temperature, top_p, seed, stop_token_ids, *asks = fields
    logprobs, prompt_logprobs = (*asks, None, None)[:2]
    return SamplingParams(
        max_tokens, temperature, top_p, seed, tuple(stop_token_ids), logprobs, prompt_logprobs
    )


def _logprobs_to_wire(run: Logprobs) -> list[Any]:
    return [
        run.logprobs.astype("<f4").tobytes(),
        run.num_top,
        run.top_token_ids.astype("<i4").tobytes(),
        run.top_logprobs.astype("<f4").tobytes(),
    ]


def _logprobs_from_wire(fields: list[Any]) -> Logprobs:
    logprobs, num_top, top_token_ids, top_logprobs = fields
    values = np.frombuffer(logprobs, "<f4")
    shape = (len(values), num_top)
    return Logprobs(
        values,
        np.frombuffer(top_token_ids, "<i4").reshape(shape),
        np.frombuffer(top_logprobs, "<f4").reshape(shape),
    )


_EVENT_TAGS = {BlockStored: 0, BlockRemoved: 1, AllBlocksCleared: 2}


def events_to_wire(events: list[CacheEvent]) -> list[list[Any]]:
    """[tag, hashes] a event, stored ones with [tokens, parent, lora, salt] where they have
    tokens; an event of the host tier ends with its medium (after those four, empty if none)."""
    wired = []
    for e in events:
        fields = [_EVENT_TAGS[type(e)], list(getattr(e, "block_hashes", ()))]
        medium = getattr(e, "medium", None)
        if isinstance(e, BlockStored) and (e.token_ids or medium):
            fields += [list(e.token_ids), e.parent_block_hash, e.lora, e.cache_salt]
        elif isinstance(e, BlockRemoved) and medium:
            fields += [[], None, None, None]
        if medium:
            fields.append(medium)
        wired.append(fields)
    return wired


def events_from_wire(fields: list[list[Any]]) -> list[CacheEvent]:
    events: list[CacheEvent] = []
    for tag, hashes, *told in fields:
        medium = told[4] if len(told) > 4 else None
        if tag == 0:
            if told:
                tokens, parent, lora, salt = told[:4]
                events.append(BlockStored(tuple(hashes), tuple(tokens), parent, lora, salt, medium))
            else:
                events.append(BlockStored(tuple(hashes)))
        elif tag == 1:
            events.append(BlockRemoved(tuple(hashes), medium))
        else:
            events.append(AllBlocksCleared())
    return events


_FINISH_REASONS = list(FinishReason)


def outputs_to_wire(outputs: StepOutputs) -> list[Any]:
    """Columns as they are: the ids and tokens of a step of decodes pack as two lists."""
    return [
        outputs.request_ids,
        outputs.token_ids,
        [[r, f.num_prompt_tokens, f.num_cached_tokens, f.ttft_s] for r, f in outputs.first.items()],
        [[r, _FINISH_REASONS.index(reason)] for r, reason in outputs.finished.items()],
        [[r, _logprobs_to_wire(run)] for r, run in outputs.logprobs.items()],
        [[r, _logprobs_to_wire(run)] for r, run in outputs.prompt_logprobs.items()],
        [[r, vector] for r, vector in outputs.embeddings.items()],
    ]


def outputs_from_wire(fields: list[Any]) -> StepOutputs:
    request_ids, token_ids, first, finished, *extras = fields
    logprobs, prompt_logprobs, embeddings = (*extras, [], [], [])[:3]
    return StepOutputs(
        request_ids,
        token_ids,
        {r: FirstToken(*figures) for r, *figures in first},
        {r: _FINISH_REASONS[reason] for r, reason in finished},
        {r: _logprobs_from_wire(run) for r, run in logprobs},
        {r: _logprobs_from_wire(run) for r, run in prompt_logprobs},
        dict(embeddings),
    )


def facts_to_wire(facts: CoreFacts) -> dict[str, Any]:
    return asdict(facts)
