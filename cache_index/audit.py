"""``kvswitch index stats`` and ``kvswitch index audit``: look at an index from outside.

The audit compares what the index says each live worker holds with what the worker itself
reports (its ``Snapshot`` over gRPC). On a fleet whose caches are changing, a difference can be
an event still on its way; the audit therefore reads the index, then the snapshot, then the index
again, and counts only what both index reads agree on::

    stale   = in the index (both reads), not on the worker: the router may send work there for
              blocks that are gone
    missing = on the worker, in neither index read: hits the router cannot see
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from kvswitch.cache_index.index import TIER_ROLE, BlockIndex, WorkerInfo
from kvswitch.security import PLAINTEXT, FleetSecurity
from kvswitch.v1 import worker_pb2, worker_pb2_grpc


@dataclass(frozen=True, slots=True)
class WorkerAudit:
    worker_id: str
    address: str
    num_in_index: int
    num_on_worker: int
    num_stale: int
    num_missing: int
    error: str = ""  # the worker could not be asked


async def fetch_snapshot(
    address: str,
    timeout_s: float = 10.0,
    security: FleetSecurity = PLAINTEXT,
    *,
    device_only: bool = False,
) -> tuple[int, set[bytes]]:
    """A worker's ``(event_seq, cached block hashes)`` over gRPC (``device_only``: its device
    tier's alone)."""
    async with security.channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        event_seq, hashes = 0, set()
        request = worker_pb2.SnapshotRequest(device_only=device_only)
        async for chunk in stub.Snapshot(request, timeout=timeout_s):
            event_seq = chunk.event_seq
            hashes.update(chunk.block_hashes)
        return event_seq, hashes


async def audit_worker(
    index: BlockIndex, info: WorkerInfo, security: FleetSecurity = PLAINTEXT
) -> WorkerAudit:
    before = await index.worker_block_hashes(info.worker_id)
    if info.address.startswith(("http://", "https://")):
        # NOTE: an OpenAI-API engine (or its GPU-tier entry): its entries follow its KV events,
        # and it has no Snapshot to compare them with.
        why = "an OpenAI-API engine: no Snapshot to compare its entries with"
        return WorkerAudit(info.worker_id, info.address, len(before), 0, 0, 0, why)
    try:
        # NOTE: a worker's device-tier entry (WORKER#gpu) holds what its device holds.
        device_only = info.role == TIER_ROLE
        _, on_worker = await fetch_snapshot(
            info.address, security=security, device_only=device_only
        )
    except grpc.aio.AioRpcError as e:
        return WorkerAudit(info.worker_id, info.address, len(before), 0, 0, 0, e.details() or "")
    after = await index.worker_block_hashes(info.worker_id)
    in_both = before & after
    return WorkerAudit(
        info.worker_id,
        info.address,
        num_in_index=len(after),
        num_on_worker=len(on_worker),
        num_stale=len(in_both - on_worker),
        num_missing=len(on_worker - (before | after)),
    )


async def audit(index: BlockIndex, security: FleetSecurity = PLAINTEXT) -> list[WorkerAudit]:
    """Each live worker's cache against the index: what it holds that the index lacks, and the
    reverse (``security``: how the workers are reached)."""
    workers = await index.live_workers()
    return list(await asyncio.gather(*(audit_worker(index, w, security) for w in workers)))


@dataclass(frozen=True)
class IndexToolConfig:
    index: str = ""
    prefix: str = "kvswitch"
    # How the fleet's routers and workers are reached (kvswitch/security.py).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    fleet_token: str = ""

    def __post_init__(self) -> None:
        if not self.index:
            raise ValueError(
                "give the index to look at: --index grpc://ROUTER_HOST:PORT for a router's "
                "embedded index (the one kvswitch up prints), or --index redis://HOST:PORT"
            )
        if self.index.startswith("memory://"):
            raise ValueError(
                "an embedded (memory://) index lives inside its process: give a Redis URL, or "
                "grpc://ROUTER_HOST:PORT for a router's embedded index"
            )
        self.security()

    def security(self) -> FleetSecurity:
        return FleetSecurity.of(self)


async def stats_report(config: IndexToolConfig) -> dict:
    from kvswitch.cache_index.connect import connect_index

    index = await connect_index(config.index, prefix=config.prefix, security=config.security())
    try:
        stats = await index.stats()
        workers = await index.live_workers()
        return {
            "num_workers": stats.num_workers,
            "num_entries": stats.num_entries,
            "memory_bytes": stats.memory_bytes,
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "address": w.address,
                    "namespace": w.namespace,
                    "role": w.role,
                    "block_size": w.block_size,
                    "block_hash": w.describe_block_hash(),
                    "num_blocks": w.num_blocks,
                    "num_entries": len(await index.worker_block_hashes(w.worker_id)),
                    **({"degraded": w.degraded} if w.degraded else {}),
                }
                for w in workers
            ],
        }
    finally:
        await index.close()


async def audit_report(config: IndexToolConfig) -> dict:
    from kvswitch.cache_index.connect import connect_index

    security = config.security()
    index = await connect_index(config.index, prefix=config.prefix, security=security)
    try:
        audits = await audit(index, security)
    finally:
        await index.close()
    return {
        "num_stale": sum(a.num_stale for a in audits),
        "num_missing": sum(a.num_missing for a in audits),
        "workers": [
            {
                "worker_id": a.worker_id,
                "address": a.address,
                "num_in_index": a.num_in_index,
                "num_on_worker": a.num_on_worker,
                "num_stale": a.num_stale,
                "num_missing": a.num_missing,
                "error": a.error,
            }
            for a in audits
        ],
    }
