"""The decode side of disaggregated prefill: a prompt's KV blocks taken from the worker that
computed them before the request runs here (``Generate``'s ``kv_source``), only from live
workers of this worker's fleet; and ``PullBlocks``, which pulls what its caller names
(benchmarks and tests, off unless ``allow_pull_blocks``)."""

from __future__ import annotations

import logging
import math

import grpc

from kvswitch.v1 import worker_pb2
from kvswitch.worker.block_transfer import TRANSPORTS, BlockTransfers, PullResult, ShmRefused
from kvswitch.worker.peers import FleetPeers, PeerRefused

logger = logging.getLogger(__name__)


class KVPuller:
    """Pulls KV blocks into this worker's cache (``BlockTransfers``) from fleet peers."""

    def __init__(
        self,
        transfers: BlockTransfers,
        peers: FleetPeers | None,
        *,
        allow_pull_blocks: bool = False,
    ) -> None:
        self._transfers = transfers
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

    async def _check_peer(self, address: str) -> None:
        """``PeerRefused`` unless ``address`` is a live worker of this worker's fleet."""
        if self._peers is None:
            raise PeerRefused(f"this worker takes KV blocks from no peer; refused {address}")
        await self._peers.check(address)

    async def take_prefill(
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


def check_kv_source(source: worker_pb2.KVSource) -> None:
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
