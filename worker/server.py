"""The worker's gRPC server: ``kvswitch.v1.Worker`` plus the standard health service.

The servicer only translates between protobuf and the engine's types; the engine runs in an
engine core process of its own (``EngineClient``), so a model step never blocks the event loop
that serves RPCs, nor takes its GIL.

``serve(config)`` runs a worker until SIGINT/SIGTERM; ``start_worker(config)`` starts one and
hands back a ``WorkerServer`` to stop later (tests, embedding).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import socket
import uuid
from collections.abc import Callable
from typing import cast

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvswitch.cache_index.connect import DEFAULT_PREFIX, connect_index
from kvswitch.cache_index.hashing import BlockNaming, tokens_from_bytes
from kvswitch.cache_index.index import ROLES, WorkerInfo
from kvswitch.checkpoint import check_model_dir
from kvswitch.guard import ServerGuard
from kvswitch.metrics import MetricsServer, ReadCounter, start_metrics_server
from kvswitch.security import FLEET_WAYS_OUT, FleetSecurity, check_exposure, is_loopback
from kvswitch.serving import (
    KEEPALIVE_SERVER_OPTIONS,
    RETRY_AFTER_KEY,
    announce_ready,
    host_port,
    run_event_loop,
    wait_for_stop_signal,
)
from kvswitch.tokenizer import (
    IncrementalDecoder,
    Tokenizer,
    TokenizerFileError,
    load_tokenizer,
)
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.block_transfer import TRANSPORTS, BlockTransfers, PullResult, ShmRefused
from kvswitch.worker.engine_client import (
    EngineClient,
    EngineDied,
    EngineError,
    EngineStartError,
    EngineStopped,
    LoadReport,
    check_engine_modules,
)
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.metrics import WorkerMetrics
from kvswitch.worker.peers import FleetPeers, PeerRefused
from kvswitch.worker.publisher import EventPublisher
from kvswitch.worker.request import FinishReason, RequestOutput, SamplingParams
from kvswitch.worker.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

__all__ = [
    "WorkerConfig",
    "WorkerFailed",
    "WorkerServer",
    "WorkerStartError",
    "check_engine_modules",
    "run",
    "serve",
    "start_worker",
]

SERVICE_NAME = "kvswitch.v1.Worker"  # its health-check name
DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens 0 means this
# A request holds its prompt as token ids, 4 bytes each: this takes a context of 16M tokens
# (the router refuses larger prompts first, and the engine any its context cannot hold).
MAX_REQUEST_BYTES = 64 << 20
# A worker at its queue limit asks callers to wait this long before trying it again (trailing
# metadata of its RESOURCE_EXHAUSTED).
RETRY_AFTER_MS = 100
# 64K hashes of 16 bytes make a 1 MiB message, well under gRPC's default 4 MiB limit.
MAX_HASHES_PER_CHUNK = 65536

_FINISH_REASON_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Where a worker listens and how its engine is built (see ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 50061  # 0 = a free port chosen by the OS
    worker_id: str = ""  # empty = "<host>:<port>" (the machine's name for a wildcard host)
    model: str = ""  # a Hugging Face checkpoint directory; empty = the built-in tiny model
    served_model_name: str = ""  # the block-hash namespace; empty = derived from the model
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20
    gpu_memory_fraction: float = 0.0  # on CUDA, in (0, 1): size the KV cache from free memory
    enable_prefix_caching: bool = True
    kv_cache_shm: bool = False  # CPU: the KV cache in shared memory, for same-host peers to copy
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cuda_graphs: bool = False  # CUDA: decode steps replayed from captured graphs
    # Requests that may wait for a place in the batch; past them, Generate answers
    # RESOURCE_EXHAUSTED (the router tries another worker) instead of queueing without bound.
    # NOTE: a request admitted behind a full batch waits about max_waiting_requests /
    # max_num_seqs request times: as many as run, it is at most twice as slow as at capacity.
    max_waiting_requests: int = 64
    cpu_threads: int = 0  # CPU: torch's threads for a step; 0 = one per core
    check_integrity: bool = False  # check the KV cache's invariants whenever the engine is idle
    max_hashes_per_chunk: int = 4096  # Snapshot's default chunk size
    index: str = ""  # block-hash index URL to publish cache events to; empty = none
    index_prefix: str = DEFAULT_PREFIX  # a Redis index's keys start with it (fleets share a Redis)
    # What the router sends here: whole requests ("both"), prompts to prefill for a decode
    # worker ("prefill"), or requests whose prompt another worker prefilled ("decode").
    role: str = "both"
    grace_s: float = 5.0  # on shutdown, how long running requests may finish
    metrics_port: int = -1  # Prometheus /metrics on host:metrics_port; -1 = none, 0 = a free port
    # Run the engine core on a thread of the serving process instead of a process of its own:
    # one process to debug or profile, at the cost of sharing its GIL with token streaming.
    engine_in_process: bool = False
    # Listen beyond loopback without the fleet token or mutual TLS (kvswitch/security.py).
    insecure: bool = False
    # Serve PullBlocks, which pulls blocks from whatever peer its caller names: for benchmarks
    # and tests on one machine (off, it answers PERMISSION_DENIED).
    allow_pull_blocks: bool = False
    # Every gRPC hop (kvswitch/security.py): TLS when tls_cert is set, mutual with
    # tls_client_auth; fleet_token: what routers and workers present to each other.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    fleet_token: str = ""
    # How blocks are named (cache_index/hashing.py): xxh3, blake2b-keyed (keyed by a key derived
    # from fleet_token), or "" = blake2b-keyed when there is a fleet token, else xxh3.
    block_hash: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        check_exposure(
            "the worker",
            self.host,
            self.port,
            FLEET_WAYS_OUT,
            guarded=self.security().authenticates_callers,
            insecure=self.insecure,
        )
        if self.allow_pull_blocks and not (is_loopback(self.host) or self.insecure):
            raise ValueError(
                "allow_pull_blocks lets a caller name any peer to pull from: it is for "
                f"benchmarks on one machine (--host 127.0.0.1), not on {self.host!r}, unless "
                "you pass --insecure"
            )
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be -1 (off) or in [0, 65535], got {self.metrics_port}"
            )
        if not 0 < self.max_hashes_per_chunk <= MAX_HASHES_PER_CHUNK:
            raise ValueError(
                f"max_hashes_per_chunk must be in [1, {MAX_HASHES_PER_CHUNK}], "
                f"got {self.max_hashes_per_chunk}"
            )
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        # The engine's own configs check the rest, with their messages.
        self.engine_config()
        self.security()
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)

    def security(self) -> FleetSecurity:
        return FleetSecurity.of(self)

    def block_naming(self) -> BlockNaming:
        """How this worker names blocks; the routers must name them alike."""
        return BlockNaming.from_fleet_token(self.fleet_token, self.block_hash)

    def engine_config(self) -> EngineConfig:
        """The engine's config: every ``EngineConfig`` field but ``block_naming`` (made from
        ``fleet_token`` and ``block_hash``) has a field of the same name here."""
        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(EngineConfig)
            if f.name != "block_naming"
        }
        return EngineConfig(
            **{**values, "model": self.model or None, "block_naming": self.block_naming()}
        )


# -- protobuf <-> domain ---------------------------------------------------------------------------


def sampling_params_from_proto(sampling: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's params; 0 means the default for max_tokens and top_p. ValueError, naming
    the field, if invalid."""
    try:
        return SamplingParams(
            max_tokens=sampling.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=sampling.temperature,
            top_p=sampling.top_p or 1.0,
            seed=sampling.seed if sampling.HasField("seed") else None,
            stop_token_ids=tuple(sampling.stop_token_ids),
        )
    except ValueError as e:  # its messages start with the field's name
        raise ValueError(f"sampling.{e}") from None


def prompt_from_proto(request: worker_pb2.WorkerGenerateRequest) -> np.ndarray:
    """The prompt's token ids, from whichever of ``prompt_token_ids_u32le`` (what the router
    sends: a view of its bytes, no copy) and ``prompt_token_ids`` carries them; ValueError if
    both do, or neither."""
    packed = request.prompt_token_ids_u32le
    if packed and request.prompt_token_ids:
        raise ValueError(
            "the request sets both prompt_token_ids and prompt_token_ids_u32le; set one"
        )
    if packed:
        return tokens_from_bytes(packed)
    if not request.prompt_token_ids:
        raise ValueError(
            "the prompt is empty: the request sets neither prompt_token_ids nor "
            "prompt_token_ids_u32le"
        )
    # NOTE: the repeated field converts to an array in one copy, not one Python int a token.
    return np.array(request.prompt_token_ids, np.uint32)


def load_to_proto(load: LoadReport, worker_id: str) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        worker_id=worker_id,
        num_running_requests=load.num_running_requests,
        num_waiting_requests=load.num_waiting_requests,
        num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        block_size=load.block_size,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """``kvswitch.v1.Worker`` over an ``EngineClient``.

    A request the engine rejects ends with INVALID_ARGUMENT and the engine's message; a cancelled
    RPC (client gone, deadline passed) aborts its request, which frees the request's blocks. Every
    Generate call, however it ends, is counted once in ``metrics``.
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        worker_id: str,
        tokenizer: Tokenizer | None,
        metrics: WorkerMetrics,
        max_hashes_per_chunk: int = 4096,
        transfers: BlockTransfers | None = None,
        max_requests: int = 0,
        peers: FleetPeers | None = None,
        allow_pull_blocks: bool = False,
    ) -> None:
        self._max_requests = max_requests  # running and waiting; 0 = no limit
        # The only workers a kv_source may name; None: none may be named (no fleet).
        self._peers = peers
        self._allow_pull_blocks = allow_pull_blocks
        self._engine = engine
        self._transfers = transfers if transfers is not None else BlockTransfers(engine)
        self._worker_id = worker_id
        self._tokenizer = tokenizer  # None: chunks carry no text
        self._metrics = metrics
        self._max_hashes_per_chunk = max_hashes_per_chunk

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # NOTE: written with context.write, not as an async generator, so that cancelling the RPC
        # raises CancelledError inside this coroutine and the `finally` below always runs.
        request_id = request.request_id or f"worker-{uuid.uuid4().hex}"
        log_extra = {"request_id": request_id}
        num_transferred_blocks = 0
        block_hashes = None  # hashed here only for a pull; else the engine client hashes
        if self._max_requests and self._engine.num_requests >= self._max_requests:
            self._metrics.requests.finished("rejected")
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(RETRY_AFTER_MS)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request {request_id}: this worker runs and queues {self._engine.num_requests} "
                f"requests, its most; retry in {RETRY_AFTER_MS} ms or elsewhere",
            )
        try:
            prompt_token_ids = prompt_from_proto(request)
            params = sampling_params_from_proto(request.sampling)
            if request.HasField("kv_source"):
                # NOTE: a request that can never run is refused before anything moves for it.
                _check_kv_source(request.kv_source)
                prompt = self._engine.checked_prompt(
                    prompt_token_ids,
                    lora=request.lora or None,
                    num_resumed_tokens=request.num_resumed_tokens,
                    hold_s=request.hold_blocks_ms / 1000,
                )
                block_hashes = self._engine.hasher(request.cache_salt or None).hash_blocks(prompt)
                num_transferred_blocks = await self._take_prefill(
                    request_id, block_hashes, request.kv_source, context
                )
            queue = await self._engine.submit(
                request_id,
                prompt_token_ids,
                params,
                lora=request.lora or None,
                cache_salt=request.cache_salt or None,
                num_resumed_tokens=request.num_resumed_tokens,
                hold_s=request.hold_blocks_ms / 1000,
                block_hashes=block_hashes,
            )
        except EngineStopped as e:
            self._metrics.requests.finished("rejected")
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
        except ValueError as e:
            logger.info("rejected: %s", e, extra=log_extra)
            self._metrics.requests.finished("rejected")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id}: {e}")
        logger.debug("%d prompt tokens", len(prompt_token_ids), extra=log_extra)

        decoder = None  # no tokenizer: chunks carry no text
        if self._tokenizer is not None:
            # NOTE: a stream resumed here (after a prefill worker, or a worker that failed) may
            # owe its client the text of its last tokens: this worker's text starts with it.
            num_pending = min(request.num_pending_text_tokens, request.num_resumed_tokens)
            decoder = IncrementalDecoder(self._tokenizer, prompt_token_ids, num_pending)
        stats = common_pb2.RequestStats(
            worker_id=self._worker_id,
            num_prompt_tokens=len(prompt_token_ids),
            num_transferred_blocks=num_transferred_blocks,
        )
        done = False  # the engine is finished with the request
        finish_reason = "abort"  # until the engine says otherwise: the RPC was cancelled
        ttft_s: float | None = None
        try:
            while not done:
                outputs, error = await _next_outputs(queue)
                if error is not None:
                    done = True
                    finish_reason = "error"
                    await context.abort(*_error_status(request_id, error))
                last = outputs[-1]
                done = last.finished
                token_ids = [t for output in outputs for t in output.new_token_ids]
                text = ""
                if decoder is not None:
                    # NOTE: a prefill for another worker (its blocks held for that one) that
                    # ends at its length goes on there: a character its tokens started is that
                    # worker's to finish, not a U+FFFD here.
                    goes_on = (
                        request.hold_blocks_ms > 0 and last.finish_reason == FinishReason.LENGTH
                    )
                    text = decoder.push(token_ids) + (
                        decoder.flush() if done and not goes_on else ""
                    )
                stats.num_output_tokens += len(token_ids)
                chunk = common_pb2.TokenChunk(
                    token_ids=token_ids,
                    text=text,
                    num_pending_text_tokens=decoder.num_pending_tokens if decoder else 0,
                )
                for output in outputs:
                    if output.ttft_s is not None:  # the first token's output has the figures
                        stats.ttft_s = ttft_s = output.ttft_s
                        stats.num_cached_tokens = max(output.num_cached_tokens, 0)
                        chunk.num_cached_tokens = stats.num_cached_tokens
                await context.write(worker_pb2.WorkerGenerateResponse(chunk=chunk))
            assert last.finish_reason is not None
            finish_reason = last.finish_reason.value
            reason = _FINISH_REASON_TO_PROTO[last.finish_reason]
            final = worker_pb2.WorkerGenerateFinal(finish_reason=reason, stats=stats)
            await context.write(worker_pb2.WorkerGenerateResponse(final=final))
            logger.info(
                "%s after %d tokens (%d of %d prompt tokens cached, ttft %.3f s)",
                finish_reason,
                stats.num_output_tokens,
                stats.num_cached_tokens,
                stats.num_prompt_tokens,
                stats.ttft_s,
                extra=log_extra,
            )
        finally:
            if not done:
                logger.info(
                    "cancelled (client gone, deadline passed or worker stopping)", extra=log_extra
                )
                self._engine.abort(request_id)
            self._metrics.requests.finished(
                finish_reason,
                ttft_s=ttft_s,
                num_prompt_tokens=stats.num_prompt_tokens,
                num_cached_tokens=stats.num_cached_tokens,
                num_output_tokens=stats.num_output_tokens,
            )

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return load_to_proto(self._engine.load, self._worker_id)

    async def Snapshot(
        self, request: worker_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            event_seq, block_hashes = await asyncio.wrap_future(self._engine.snapshot())
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
        size = min(request.max_hashes_per_chunk or self._max_hashes_per_chunk, MAX_HASHES_PER_CHUNK)
        # Always at least one chunk: an empty cache still reports its event_seq.
        for start in range(0, max(len(block_hashes), 1), size):
            chunk = worker_pb2.SnapshotChunk(
                worker_id=self._worker_id,
                model=self._engine.namespace,
                block_size=self._engine.block_size,
                event_seq=event_seq,
                block_hashes=block_hashes[start : start + size],
            )
            await context.write(chunk)

    async def FetchBlocks(
        self, request: worker_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            await self._transfers.send(request, context)
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def PullBlocks(
        self, request: worker_pb2.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullBlocksResponse:
        if not self._allow_pull_blocks:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "PullBlocks is off on this worker: it pulls from any peer its caller names, so a "
                "worker serves it only with --allow-pull-blocks (benchmarks and tests); "
                "disaggregated prefill takes blocks through Generate's kv_source",
            )
        hashes = list(request.block_hashes)
        if not request.peer_address or not hashes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "PullBlocks needs a peer_address and block_hashes"
            )
        if request.transport not in TRANSPORTS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"transport must be mapped, shm, grpc or empty, got {request.transport!r}",
            )
        try:
            pulled = await self._transfers.pull(
                request.peer_address,
                hashes,
                transport=request.transport,
                request_id=request.request_id,
                timeout_s=context.time_remaining(),
            )
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"peer {request.peer_address}: {e.code().name}: {e.details()}",
            )
        except (ValueError, ShmRefused) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.peer_address}: {e}")
        _log_pull(pulled, request.peer_address, len(hashes), request.request_id)
        return worker_pb2.PullBlocksResponse(
            num_cached_blocks=pulled.num_cached_blocks,
            num_transferred_blocks=pulled.num_blocks,
            num_transferred_bytes=pulled.num_bytes,
            transport=pulled.transport,
        )

    async def ReleaseBlocks(
        self, request: worker_pb2.ReleaseBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseBlocksResponse:
        if request.transfer_id:
            self._engine.release(request.transfer_id)
        return worker_pb2.ReleaseBlocksResponse()

    async def _check_peer(self, address: str) -> None:
        """``PeerRefused`` unless ``address`` is a live worker of this worker's fleet."""
        if self._peers is None:
            raise PeerRefused(f"this worker takes KV blocks from no peer; refused {address}")
        await self._peers.check(address)

    async def _take_prefill(
        self,
        request_id: str,
        hashes: list[bytes],
        source: worker_pb2.KVSource,
        context: grpc.aio.ServicerContext,
    ) -> int:
        """Disaggregated prefill, the decode side: pull the prompt's blocks (``hashes``, its
        chain) from the prefill worker before the request runs; how many moved. A failed pull is
        computed here instead, or ends the request with ABORTED when the source says ``fail``. A
        source that is not a live worker of this fleet counts as a failed pull: nothing is asked
        of it (a prefill worker that left meanwhile is recomputed for, a stranger never heard)."""
        timeout_s = context.time_remaining()
        if source.timeout_ms:
            timeout_s = min(timeout_s or math.inf, source.timeout_ms / 1000)
        try:
            await self._check_peer(source.peer_address)
            pulled = await self._transfers.pull(
                source.peer_address,
                hashes,
                transport=source.transport,
                request_id=request_id,
                transfer_id=source.transfer_id,
                timeout_s=timeout_s,
            )
        except (grpc.aio.AioRpcError, ValueError, ShmRefused, PeerRefused) as e:
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else e
            message = f"the KV transfer from {source.peer_address} failed: {why}"
            if source.on_failure == "fail":
                await context.abort(grpc.StatusCode.ABORTED, f"request {request_id}: {message}")
            logger.warning("%s; computing it here", message, extra={"request_id": request_id})
            return 0
        _log_pull(pulled, source.peer_address, len(hashes), request_id)
        return pulled.num_blocks


def _check_kv_source(source: worker_pb2.KVSource) -> None:
    if not source.peer_address:
        raise ValueError("kv_source names no peer_address")
    if source.transport not in TRANSPORTS:
        raise ValueError(
            f"kv_source.transport must be mapped, shm, grpc or empty, not {source.transport!r}"
        )
    if source.on_failure not in ("", "recompute", "fail"):
        raise ValueError(
            f"kv_source.on_failure must be recompute, fail or empty, not {source.on_failure!r}"
        )


def _log_pull(pulled: PullResult, peer_address: str, num_hashes: int, request_id: str) -> None:
    logger.info(
        "pulled %d blocks (%d bytes, %s) from %s; %d of %d cached here",
        pulled.num_blocks,
        pulled.num_bytes,
        pulled.transport or "none",
        peer_address,
        pulled.num_cached_blocks,
        num_hashes,
        extra={"request_id": request_id},
    )


async def _next_outputs(
    queue: asyncio.Queue[RequestOutput | EngineError],
) -> tuple[list[RequestOutput], EngineError | None]:
    """Wait for one output, then take every one already queued: a client that reads slower than
    the engine decodes gets several tokens per chunk instead of falling behind. An error, if one
    came, is the queue's last item."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    if isinstance(items[-1], EngineError):
        return [], items[-1]
    return cast("list[RequestOutput]", items), None


def _error_status(request_id: str, error: EngineError) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, f"request {request_id}: {_unavailable(error)}"
    return grpc.StatusCode.INTERNAL, f"request {request_id}: {error}"


def _unavailable(error: EngineStopped) -> str:
    if isinstance(error, EngineDied):
        return f"this worker's {error}; it is stopping"
    return "this worker is shutting down"


# -- the server ----------------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerServer:
    """A started worker; ``stop`` it when done."""

    worker_id: str
    address: str  # "host:port" as bound
    engine: EngineClient
    server: grpc.aio.Server
    health_servicer: health.aio.HealthServicer
    metrics: WorkerMetrics
    publisher: EventPublisher | None = None
    metrics_server: MetricsServer | None = None
    transfers: BlockTransfers | None = None  # blocks to and from peer workers
    # Set, with the reason, once the engine core has died: the worker can serve nothing more.
    engine_died: asyncio.Future[str] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def metrics_address(self) -> str | None:
        """Where ``/metrics`` is served, "host:port" as bound; None when it is not."""
        return self.metrics_server.address if self.metrics_server else None

    async def stop(self, grace_s: float) -> None:
        """Leave the index, report NOT_SERVING, give running RPCs ``grace_s`` to finish, cancel
        the rest, stop the engine core, then the metrics endpoint."""
        if self.publisher is not None:
            await self.publisher.stop()
            await self.publisher.index.close()
        await self.health_servicer.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.transfers is not None:
            await self.transfers.close()
        await asyncio.to_thread(self.engine.stop)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)

    async def _engine_has_died(self, message: str) -> None:
        """Tell health checkers at once, so that routers stop sending work here."""
        if not self.engine_died.done():
            self.engine_died.set_result(message)
        await self.health_servicer.enter_graceful_shutdown()


class WorkerStartError(Exception):
    """The worker could not start: one of its ports is taken, or its model does not load."""


class WorkerFailed(Exception):
    """The worker stopped serving on its own account: its engine core died."""


async def start_worker(config: WorkerConfig) -> WorkerServer:
    """Bind the port, start the engine core and serve; ``WorkerStartError`` says why not."""
    # NOTE: without so_reuseport 0, gRPC lets a second server bind the same port and share its
    # traffic. Binding before the model loads makes a taken port fail at once.
    server = grpc.aio.server(
        interceptors=[ServerGuard({SERVICE_NAME: config.fleet_token})],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            *KEEPALIVE_SERVER_OPTIONS,
        ],
    )
    try:
        port = config.security().add_port(server, host_port(config.host, config.port))
    except RuntimeError as e:
        raise WorkerStartError(
            f"cannot listen on {host_port(config.host, config.port)}: the port is taken or the "
            "address is not one of this machine's"
        ) from e
    worker_id = config.worker_id or host_port(_public_host(config.host), port)
    try:
        tokenizer = _load_tokenizer(config.model)
        engine = await asyncio.to_thread(
            EngineClient.start, config.engine_config(), in_process=config.engine_in_process
        )
    except (ValueError, OSError, TokenizerFileError, EngineStartError) as e:
        raise WorkerStartError(f"cannot load the model: {e}") from e
    try:
        return await _serve_engine(config, server, port, worker_id, engine, tokenizer)
    except BaseException:
        await server.stop(0)
        await asyncio.to_thread(engine.stop)
        raise


async def _serve_engine(
    config: WorkerConfig,
    server: grpc.aio.Server,
    port: int,
    worker_id: str,
    engine: EngineClient,
    tokenizer: Tokenizer | None,
) -> WorkerServer:
    publisher: EventPublisher | None = None  # once the index is open; its counts read at scrapes
    metrics = WorkerMetrics(
        lambda: engine.load,
        worker_id=worker_id,
        model=engine.namespace,
        role=config.role,
        counters=_read_counters(engine, lambda: publisher),
    )
    metrics_server = None
    if config.metrics_port >= 0:
        try:
            metrics_server = start_metrics_server(
                metrics.registry, config.host, config.metrics_port
            )
        except OSError as e:
            raise WorkerStartError(
                f"cannot serve metrics on {host_port(config.host, config.metrics_port)}: {e}"
            ) from e
    transfers = BlockTransfers(engine, config.security())
    servicer = WorkerServicer(
        engine,
        worker_id=worker_id,
        tokenizer=tokenizer,
        metrics=metrics,
        max_hashes_per_chunk=config.max_hashes_per_chunk,
        transfers=transfers,
        max_requests=config.max_num_seqs + config.max_waiting_requests,
        peers=FleetPeers(lambda: publisher.index if publisher else None, engine.namespace),
        allow_pull_blocks=config.allow_pull_blocks,
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in (SERVICE_NAME, ""):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    if config.index:
        try:
            index = await connect_index(
                config.index, prefix=config.index_prefix, security=config.security()
            )
        except (ValueError, OSError) as e:
            if metrics_server is not None:
                metrics_server.stop()
            raise WorkerStartError(f"cannot open the block index: {e}") from e
        info = WorkerInfo(
            worker_id,
            host_port(_public_host(config.host), port),
            engine.namespace,
            config.block_size,
            config.role,
            engine.facts.num_blocks,
            engine.facts.max_model_len,
            engine.block_naming.mode,
            engine.block_naming.key_id,
        )
        publisher = EventPublisher(index, engine, info)
        publisher.start()
    worker = WorkerServer(
        worker_id,
        host_port(config.host, port),
        engine,
        server,
        health_servicer,
        metrics,
        publisher=publisher,
        metrics_server=metrics_server,
        transfers=transfers,
    )
    loop = asyncio.get_running_loop()
    engine.on_death(
        lambda message: asyncio.run_coroutine_threadsafe(worker._engine_has_died(message), loop)
    )
    logger.info(
        "worker %s listening on %s: model %s, %d KV blocks of %d tokens, block names %s, "
        "engine core %s",
        worker_id,
        worker.address,
        engine.namespace,
        engine.facts.num_blocks,
        config.block_size,
        engine.block_naming.describe(),
        f"pid {engine.pid}" if engine.pid is not None else "in process",
    )
    if metrics_server is not None:
        logger.info("metrics on http://%s/metrics", metrics_server.address)
    return worker


async def serve(config: WorkerConfig) -> None:
    """Run a worker until SIGINT or SIGTERM, then shut it down gracefully. Raises
    ``WorkerFailed`` (after shutting down) if its engine core dies first."""
    worker = await start_worker(config)
    announce_ready(f"worker {worker.worker_id}", worker.address)
    stop_signal = asyncio.create_task(wait_for_stop_signal())
    await asyncio.wait([stop_signal, worker.engine_died], return_when=asyncio.FIRST_COMPLETED)
    stop_signal.cancel()
    if worker.engine_died.done():
        logger.error("stopping: %s", worker.engine_died.result())
        await worker.stop(0)
        raise WorkerFailed(worker.engine_died.result())
    logger.info("shutting down: %.1f s for running requests to finish", config.grace_s)
    await worker.stop(config.grace_s)
    logger.info("worker %s stopped", worker.worker_id)


def run(config: WorkerConfig) -> None:
    """``serve`` on uvloop where it is installed."""
    run_event_loop(serve(config))


def _read_counters(
    engine: EngineClient, publisher: Callable[[], EventPublisher | None]
) -> list[ReadCounter]:
    """What the worker counts and logs no more than now and then: exported at scrape time."""

    def published(field: str) -> Callable[[], float]:
        return lambda: getattr(publisher(), field, 0)

    return [
        (
            "kvswitch_worker_failed_steps",
            "Engine steps that raised: their requests failed, the others went on",
            lambda: engine.counters.num_failed_steps,
        ),
        (
            "kvswitch_worker_preemptions",
            "Requests preempted to free KV cache blocks, to be recomputed",
            lambda: engine.counters.num_preemptions,
        ),
        (
            "kvswitch_worker_dropped_event_batches",
            "Batches of cache events dropped because the publisher fell behind (a resync follows)",
            lambda: engine.num_dropped_event_batches,
        ),
        (
            "kvswitch_worker_index_errors",
            "Calls to the block index that failed, each tried again after a backoff",
            published("num_errors"),
        ),
        (
            "kvswitch_worker_index_resyncs",
            "Times this worker sent the index its whole set of cached blocks (after a gap)",
            published("num_resyncs"),
        ),
        (
            "kvswitch_worker_index_registers",
            "Times this worker registered with the index (at start, and after it forgot it)",
            published("num_registers"),
        ),
    ]


def _load_tokenizer(model: str) -> Tokenizer | None:
    """The model's tokenizer, or None for a model that has none. A checkpoint directory that
    does not exist is an error: it is a typo, not a model."""
    check_model_dir(model)
    try:
        return load_tokenizer(model or None)
    except ValueError as e:
        # The worker runs on token ids; without a tokenizer its chunks just carry no text.
        logger.warning("%s; streaming token ids without text", e)
        return None


def _public_host(host: str) -> str:
    return socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host
