"""The decode side of disaggregated prefill: a prompt's KV blocks taken from the worker that
computed them before the request runs here (``Generate``'s ``kv_source``), only from live
workers of this worker's fleet; and ``PullBlocks``, which pulls what its caller names
(benchmarks and tests, off unless ``allow_pull_blocks``).

A request's pull, with the engine core::

    submit_awaiting_kv ---> core holds blocks for the whole prompt: cached prefix + new ids
    pull (write_blocks*) -> each chunk into the blocks held for it, by hash
    kv_landed ------------> filled leading run cached; the request runs, computing the rest
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

import grpc

from kvswitch.v1 import worker_pb2
from kvswitch.worker.block_transfer import (
    TRANSPORTS,
    BlockTransfers,
    NixlRefused,
    PullResult,
    ShmRefused,
)
from kvswitch.worker.engine_client import EngineClient
from kvswitch.worker.peers import FleetPeers, PeerRefused
from kvswitch.worker.request import PullSlots

logger = logging.getLogger(__name__)


class KVPuller:
    """Pulls KV blocks into this worker's cache (``BlockTransfers``) from fleet peers."""

    def __init__(
        self,
        engine: EngineClient,
        transfers: BlockTransfers,
        peers: FleetPeers | None,
        *,
        allow_pull_blocks: bool = False,
        on_failure: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._engine = engine
        self._transfers = transfers
        # Called with "failed", "short" or "refused" for a pull that left blocks to compute.
        self._on_failure = on_failure
        # The only workers a kv_source may name; None: none may be named (no fleet).
        self._peers = peers
        self._allow_pull_blocks = allow_pull_blocks

    async def pull_blocks(
        self, request: worker_pb2.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullBlocksResponse:
        """``Worker.PullBlocks``: the blocks its caller names, from the peer it names; refused
        unless the worker was started with ``allow_pull_blocks``."""
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
                f"transport must be auto, nixl, mapped, shm, grpc or empty, got "
                f"{request.transport!r}",
            )
        try:
            pulled = await self._transfers.pull(
                request.peer_address,
                hashes,
                transport=request.transport,
                request_id=request.request_id,
                timeout_s=context.time_remaining(),
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"peer {request.peer_address}: {e.code().name}: {e.details()}",
            )
        except (ValueError, ShmRefused, NixlRefused) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.peer_address}: {e}")
        _log_pull(pulled, request.peer_address, len(hashes), request.request_id)
        return worker_pb2.PullBlocksResponse(
            num_cached_blocks=pulled.num_cached_blocks,
            num_transferred_blocks=pulled.num_blocks,
            num_transferred_bytes=pulled.num_bytes,
            transport=pulled.transport,
        )

    async def _check_peer(self, address: str) -> None:
        """``PeerRefused`` unless ``address`` is a live worker of this worker's fleet."""
        if self._peers is None:
            raise PeerRefused(f"this worker takes KV blocks from no peer; refused {address}")
        await self._peers.check(address)

    async def take_prefill(
        self,
        request_id: str,
        hashes: list[bytes],
        slots: PullSlots,
        source: worker_pb2.KVSource,
        context: grpc.aio.ServicerContext,
    ) -> int:
        """Disaggregated prefill, the decode side: fill the blocks the engine core holds for the
        request (``slots``, from ``EngineClient.submit_awaiting_kv``) with its prompt's KV
        (``hashes``, its chain) from the prefill worker, then tell the core they landed, so that
        it runs the request; how many blocks moved. What did not land (a failed or short pull,
        slots refused for lack of room) is computed here and counted in ``on_failure``; a pull
        that failed or was refused ends the request with ``PullFailed`` instead when the source
        says ``fail`` (the core never ran it: the caller aborts it). A source that is not a live
        worker of this fleet counts as a failed pull: nothing is asked of it (a prefill worker
        that left meanwhile is recomputed for, a stranger never heard)."""
        if slots.refused:
            await self._release_refused(source)
            self._failed("refused", f"no blocks here for the KV transfer: {slots.refused}", source)
            await self._landed(request_id)
            logger.warning(
                "no blocks here for the KV transfer from %s (%s); computing the prompt here",
                source.peer_address,
                slots.refused,
                extra={"request_id": request_id},
            )
            return 0
        timeout_s = context.time_remaining()
        if source.timeout_ms:
            timeout_s = min(timeout_s or math.inf, source.timeout_ms / 1000)
        # NOTE: only the blocks held for the request move: any other would be cached evictable.
        held = hashes[: slots.num_cached_blocks + len(slots.block_ids)]
        try:
            await self._check_peer(source.peer_address)
            pulled = await self._transfers.pull(
                source.peer_address,
                held,
                transport=source.transport,
                request_id=request_id,
                transfer_id=source.transfer_id,
                timeout_s=timeout_s,
            )
        except (grpc.aio.AioRpcError, ValueError, ShmRefused, NixlRefused, PeerRefused) as e:
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else e
            message = f"the KV transfer from {source.peer_address} failed: {why}"
            self._failed("failed", message, source)
            num_landed = await self._landed(request_id)
            logger.warning(
                "%s; %d of %d blocks landed, computing the rest here",
                message,
                num_landed,
                len(slots.block_ids),
                extra={"request_id": request_id},
            )
            return 0
        num_landed = await self._landed(request_id)
        _log_pull(pulled, source.peer_address, len(held), request_id)
        if num_landed < len(slots.block_ids):
            self._on_failure("short")
            logger.warning(
                "the KV transfer from %s brought %d of the %d blocks asked for; computing the "
                "rest here",
                source.peer_address,
                num_landed,
                len(slots.block_ids),
                extra={"request_id": request_id},
            )
        return pulled.num_blocks

    async def _landed(self, request_id: str) -> int:
        return await asyncio.wrap_future(self._engine.kv_landed(request_id))

    def _failed(self, reason: str, message: str, source: worker_pb2.KVSource) -> None:
        """Count a pull that left the prompt to compute; ``PullFailed`` if the source says
        fail."""
        self._on_failure(reason)
        if source.on_failure == "fail":
            raise PullFailed(message)

    async def _release_refused(self, source: worker_pb2.KVSource) -> None:
        """Tell a fleet peer that its lease for a pull refused here is not wanted."""
        if not source.transfer_id:
            return
        try:
            await self._check_peer(source.peer_address)
        except PeerRefused:
            return
        await self._transfers.release(source.peer_address, source.transfer_id)


class PullFailed(Exception):
    """A pull whose source says ``fail`` left blocks of the prompt to compute."""


def check_kv_source(source: worker_pb2.KVSource) -> None:
    if not source.peer_address:
        raise ValueError("kv_source names no peer_address")
    if source.transport not in TRANSPORTS:
        raise ValueError(
            "kv_source.transport must be auto, nixl, mapped, shm, grpc or empty, not "
            f"{source.transport!r}"
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
