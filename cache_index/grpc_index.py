"""The block index over gRPC: one router serves its embedded index to workers in other processes.

    worker: EventPublisher -> GrpcIndex ==kvswitch.v1.CacheIndex==> IndexServicer -> MemoryIndex

``IndexServicer`` serves any ``BlockIndex`` and only translates between protobuf and the domain
types; ``add_index_service`` puts it on a ``grpc.aio`` server. ``GrpcIndex`` is the other end: a
``BlockIndex`` whose every method is one RPC, with the semantics of the index it reaches (the
shared contract suite runs against it). Errors cross the wire as status codes::

    server                                      client (GrpcIndex)
    ValueError (bad input, e.g. a short hash)   INVALID_ARGUMENT   -> ValueError
    KeyError (resync of an unknown worker)      NOT_FOUND          -> KeyError
    server down or unreachable                  UNAVAILABLE        -> ConnectionError
    no answer within timeout_s                  DEADLINE_EXCEEDED  -> TimeoutError

so the worker's publisher backs off and reconnects as it does for Redis. A router that restarts
comes back empty: ``apply`` answers UNKNOWN_WORKER and each worker registers and resyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from kvswitch.cache_index.hashing import HASH_BYTES, XXH3
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, IndexStats, WorkerInfo
from kvswitch.security import PLAINTEXT, FleetSecurity
from kvswitch.v1 import index_pb2, index_pb2_grpc

SERVICE_NAME = "kvswitch.v1.CacheIndex"  # its health-check name
# 64K hashes take about 1.2 MiB on the wire (18 bytes each), well under gRPC's 4 MiB limit.
HASHES_PER_CHUNK = 65536
DEFAULT_TIMEOUT_S = 5.0

# NOTE: gRPC waits up to 120 s between attempts to reach a server that went away; a restarted
# router should get its workers back within about a second.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

_STATUS_TO_PROTO = {
    ApplyStatus.APPLIED: index_pb2.APPLY_STATUS_APPLIED,
    ApplyStatus.DUPLICATE: index_pb2.APPLY_STATUS_DUPLICATE,
    ApplyStatus.NEEDS_RESYNC: index_pb2.APPLY_STATUS_NEEDS_RESYNC,
    ApplyStatus.UNKNOWN_WORKER: index_pb2.APPLY_STATUS_UNKNOWN_WORKER,
}
_PROTO_TO_STATUS = {proto: status for status, proto in _STATUS_TO_PROTO.items()}


class IndexServicer(index_pb2_grpc.CacheIndexServicer):
    """``kvswitch.v1.CacheIndex`` over one ``BlockIndex``: it checks and translates, the index
    decides. Input the index refuses ends the call with INVALID_ARGUMENT (or NOT_FOUND)."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index

    async def Register(
        self, request: index_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.RegisterResponse:
        async with _refusals_as_status(context):
            await self.index.register(worker_info_from_proto(request.worker), request.ttl_s)
        return index_pb2.RegisterResponse()

    async def Heartbeat(
        self, request: index_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.HeartbeatResponse:
        async with _refusals_as_status(context):
            alive = await self.index.heartbeat(request.worker_id, request.ttl_s)
        return index_pb2.HeartbeatResponse(alive=alive)

    async def Deregister(
        self, request: index_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.DeregisterResponse:
        await self.index.deregister(request.worker_id)
        return index_pb2.DeregisterResponse()

    async def LiveWorkers(
        self, request: index_pb2.LiveWorkersRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.LiveWorkersResponse:
        namespace = request.namespace if request.HasField("namespace") else None
        workers = await self.index.live_workers(namespace)
        return index_pb2.LiveWorkersResponse(workers=[worker_info_to_proto(w) for w in workers])

    async def Apply(
        self, request: index_pb2.ApplyRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.ApplyResponse:
        async with _refusals_as_status(context):
            events = [event_from_proto(event) for event in request.events]
            status = await self.index.apply(request.worker_id, request.seq, events)
        return index_pb2.ApplyResponse(status=_STATUS_TO_PROTO[status])

    async def Resync(
        self,
        request_iterator: AsyncIterator[index_pb2.ResyncChunk],
        context: grpc.aio.ServicerContext,
    ) -> index_pb2.ResyncResponse:
        async with _refusals_as_status(context):
            worker_id, seq, block_hashes = await _read_snapshot(request_iterator)
            await self.index.resync(worker_id, seq, block_hashes)
        return index_pb2.ResyncResponse()

    async def Match(
        self, request: index_pb2.MatchRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.MatchResponse:
        async with _refusals_as_status(context):
            check_block_hashes(request.block_hashes, "Match.block_hashes")
            matches = await self.index.match(request.namespace, list(request.block_hashes))
        return index_pb2.MatchResponse(worker_to_num_matched_blocks=matches)

    async def WorkerBlockHashes(
        self, request: index_pb2.WorkerBlockHashesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[index_pb2.BlockHashChunk]:
        block_hashes = list(await self.index.worker_block_hashes(request.worker_id))
        for part in _slices(block_hashes, HASHES_PER_CHUNK):
            if part:
                yield index_pb2.BlockHashChunk(block_hashes=part)

    async def Stats(
        self, request: index_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.StatsResponse:
        stats = await self.index.stats()
        return index_pb2.StatsResponse(
            num_workers=stats.num_workers,
            num_entries=stats.num_entries,
            memory_bytes=stats.memory_bytes,
        )

    async def ReclaimExpired(
        self, request: index_pb2.ReclaimExpiredRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.ReclaimExpiredResponse:
        return index_pb2.ReclaimExpiredResponse(num_workers=await self.index.reclaim_expired())


def add_index_service(server: grpc.aio.Server, index: BlockIndex) -> IndexServicer:
    """Serve ``index`` as ``kvswitch.v1.CacheIndex`` on ``server`` (before it starts). Health
    status is the caller's: set it under ``SERVICE_NAME``."""
    servicer = IndexServicer(index)
    index_pb2_grpc.add_CacheIndexServicer_to_server(servicer, server)
    return servicer


class GrpcIndex(BlockIndex):
    """A ``BlockIndex`` served by another process at ``target`` (host:port). The constructor
    does no I/O (the channel connects on the first call); ``await GrpcIndex.connect`` also waits
    for the server.

    Every call is one RPC with a deadline of ``timeout_s``. A snapshot (``resync``) and a worker's
    entries (``worker_block_hashes``) travel in chunks of ``HASHES_PER_CHUNK`` hashes, and get
    ``timeout_s`` per chunk."""

    unavailable_errors = (grpc.RpcError, OSError)

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        security: FleetSecurity = PLAINTEXT,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.target = target  # host:port
        self.timeout_s = timeout_s
        self._channel = security.channel(target, _CHANNEL_OPTIONS)
        self._stub = index_pb2_grpc.CacheIndexStub(self._channel)

    @classmethod
    async def connect(
        cls,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        security: FleetSecurity = PLAINTEXT,
    ) -> GrpcIndex:
        """Open a channel to ``host:port`` and wait until it is up: a server that does not answer
        within ``timeout_s`` fails here, with ``ConnectionError``."""
        index = cls(target, timeout_s=timeout_s, security=security)
        try:
            async with asyncio.timeout(timeout_s):  # (wait_for may lose a cancel)
                await index._channel.channel_ready()
        except TimeoutError as e:
            await index.close()
            raise ConnectionError(f"no block index answered at {target} in {timeout_s} s") from e
        return index

    async def close(self) -> None:
        await self._channel.close()

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        request = index_pb2.RegisterRequest(worker=worker_info_to_proto(info), ttl_s=ttl_s)
        await self._call(self._stub.Register, request)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        request = index_pb2.HeartbeatRequest(worker_id=worker_id, ttl_s=ttl_s)
        return (await self._call(self._stub.Heartbeat, request)).alive

    async def deregister(self, worker_id: str) -> None:
        await self._call(self._stub.Deregister, index_pb2.DeregisterRequest(worker_id=worker_id))

    async def live_workers(self, namespace: str | None = None) -> list[WorkerInfo]:
        request = index_pb2.LiveWorkersRequest(namespace=namespace)
        reply = await self._call(self._stub.LiveWorkers, request)
        return [worker_info_from_proto(worker) for worker in reply.workers]

    async def apply(self, worker_id: str, seq: int, events: Sequence[CacheEvent]) -> ApplyStatus:
        request = index_pb2.ApplyRequest(
            worker_id=worker_id, seq=seq, events=[event_to_proto(event) for event in events]
        )
        return _PROTO_TO_STATUS[(await self._call(self._stub.Apply, request)).status]

    async def resync(self, worker_id: str, seq: int, block_hashes: Iterable[bytes]) -> None:
        hashes = list(block_hashes)
        parts = _slices(hashes, HASHES_PER_CHUNK)
        chunks = (
            index_pb2.ResyncChunk(worker_id=worker_id, seq=seq, block_hashes=p) for p in parts
        )
        num_chunks = max(1, math.ceil(len(hashes) / HASHES_PER_CHUNK))
        with self._domain_errors():
            await self._stub.Resync(chunks, timeout=self.timeout_s * num_chunks)

    async def match(self, namespace: str, block_hashes: Sequence[bytes]) -> dict[str, int]:
        request = index_pb2.MatchRequest(namespace=namespace, block_hashes=block_hashes)
        return dict((await self._call(self._stub.Match, request)).worker_to_num_matched_blocks)

    async def worker_block_hashes(self, worker_id: str) -> set[bytes]:
        request = index_pb2.WorkerBlockHashesRequest(worker_id=worker_id)
        block_hashes: set[bytes] = set()
        call = self._stub.WorkerBlockHashes(request)
        with self._domain_errors():
            try:
                while True:
                    # NOTE: how many chunks will come is not known up front: a deadline per chunk.
                    async with asyncio.timeout(self.timeout_s):  # (wait_for may lose a cancel)
                        chunk = await call.read()
                    if chunk is grpc.aio.EOF:
                        break
                    block_hashes.update(chunk.block_hashes)
            finally:
                call.cancel()  # a no-op once the stream ended
        return block_hashes

    async def stats(self) -> IndexStats:
        reply = await self._call(self._stub.Stats, index_pb2.StatsRequest())
        return IndexStats(reply.num_workers, reply.num_entries, reply.memory_bytes)

    async def reclaim_expired(self) -> int:
        reply = await self._call(self._stub.ReclaimExpired, index_pb2.ReclaimExpiredRequest())
        return reply.num_workers

    async def _call(self, rpc: grpc.aio.UnaryUnaryMultiCallable, request: Any) -> Any:
        with self._domain_errors():
            return await rpc(request, timeout=self.timeout_s)

    @contextlib.contextmanager
    def _domain_errors(self) -> Iterator[None]:
        """Raise what the other backends raise instead of gRPC's errors (see the module map)."""
        try:
            yield
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(details) from e
            if code == grpc.StatusCode.NOT_FOUND:
                raise KeyError(details) from e
            if code == grpc.StatusCode.UNAVAILABLE:
                raise ConnectionError(
                    f"block index at {self.target} is unavailable: {details}"
                ) from e
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"block index at {self.target} did not answer in time") from e
            raise


def worker_info_to_proto(info: WorkerInfo) -> index_pb2.WorkerInfo:
    return index_pb2.WorkerInfo(
        worker_id=info.worker_id,
        address=info.address,
        namespace=info.namespace,
        block_size=info.block_size,
        role=info.role,
        num_blocks=info.num_blocks,
        max_model_len=info.max_model_len,
        block_hash=info.block_hash,
        block_hash_key_id=info.block_hash_key_id,
        degraded=info.degraded,
    )


def worker_info_from_proto(info: index_pb2.WorkerInfo) -> WorkerInfo:
    """Raises ValueError for an empty id, an unknown role, a zero block size or an unknown
    block hash."""
    return WorkerInfo(
        info.worker_id,
        info.address,
        info.namespace,
        info.block_size,
        info.role,
        info.num_blocks,
        info.max_model_len,
        # NOTE: empty from a worker older than the field: it named blocks with xxh3.
        info.block_hash or XXH3,
        info.block_hash_key_id,
        info.degraded,
    )


def event_to_proto(event: CacheEvent) -> index_pb2.CacheEvent:
    if isinstance(event, BlockStored):
        stored = index_pb2.BlockStored(block_hashes=event.block_hashes)
        return index_pb2.CacheEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return index_pb2.CacheEvent(removed=index_pb2.BlockRemoved(block_hashes=event.block_hashes))
    return index_pb2.CacheEvent(cleared=index_pb2.AllBlocksCleared())


def event_from_proto(event: index_pb2.CacheEvent) -> CacheEvent:
    """Raises ValueError for an event of no kind, or a block hash that is not 16 bytes."""
    kind = event.WhichOneof("kind")
    if kind == "stored":
        stored = event.stored
        check_block_hashes(stored.block_hashes, "BlockStored.block_hashes")
        return BlockStored(tuple(stored.block_hashes))
    if kind == "removed":
        check_block_hashes(event.removed.block_hashes, "BlockRemoved.block_hashes")
        return BlockRemoved(tuple(event.removed.block_hashes))
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError("a CacheEvent must set one of stored, removed or cleared")


def check_block_hashes(block_hashes: Iterable[bytes], field: str) -> None:
    wrong_lengths = set(map(len, block_hashes)) - {HASH_BYTES}
    if wrong_lengths:
        raise ValueError(
            f"{field}: block hashes are {HASH_BYTES} bytes each, got one of {min(wrong_lengths)}"
        )


async def _read_snapshot(
    chunks: AsyncIterator[index_pb2.ResyncChunk],
) -> tuple[str, int, list[bytes]]:
    """``(worker_id, seq, block_hashes)`` of a whole Resync stream."""
    header: tuple[str, int] | None = None
    block_hashes: list[bytes] = []
    async for chunk in chunks:
        if header is None:
            header = (chunk.worker_id, chunk.seq)
        elif (chunk.worker_id, chunk.seq) != header:
            raise ValueError("every ResyncChunk of a stream must repeat its worker_id and seq")
        check_block_hashes(chunk.block_hashes, "ResyncChunk.block_hashes")
        block_hashes.extend(chunk.block_hashes)
    if header is None:
        raise ValueError("a Resync stream must send at least one ResyncChunk")
    worker_id, seq = header
    return worker_id, seq, block_hashes


def _slices(items: list[bytes], size: int) -> Iterator[list[bytes]]:
    """``items`` in slices of at most ``size``; one empty slice for no items."""
    yield items[:size]
    for start in range(size, len(items), size):
        yield items[start : start + size]


@contextlib.asynccontextmanager
async def _refusals_as_status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """End the call with the status code the client turns back into the same exception."""
    try:
        yield
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except KeyError as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
