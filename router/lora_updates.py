"""LoRA adapters loaded and unloaded across the fleet at run time (``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, with ``kvswitch router --lora-updates``).

Placement: an adapter loads on every live worker of the router's model (each holds it in host
memory and takes a device slot only when a request needs one); the cost policy's adapter
affinity then keeps each adapter's requests on the few workers that have it in a slot, so the
fleet needs no placement plan of its own. The folder must be readable on every worker's host
(shared storage), as for ``--lora``. Unloading asks every worker that serves the adapter; a
worker with requests of it running or waiting refuses, and keeps serving it until a later
unload.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from kvswitch.router.router import Router
from kvswitch.router.workers import WorkerHandle
from kvswitch.v1 import worker_pb2

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0  # reading an adapter from a slow disk


@dataclass
class LoraUpdate:
    """What the workers said to one load or unload."""

    lora_name: str
    done: list[str] = field(default_factory=list)  # the workers that did it (or had it so)
    refused: dict[str, tuple[grpc.StatusCode, str]] = field(default_factory=dict)  # id: why

    def describe_refusals(self) -> str:
        return "; ".join(f"{worker_id}: {why}" for worker_id, (_, why) in self.refused.items())

    def describe(self) -> str:
        done = ", ".join(self.done) or "no worker"
        return f"{done}; refused by {self.describe_refusals()}" if self.refused else done


class FleetAdapters:
    """Loads and unloads adapters on the workers a router routes to."""

    def __init__(self, router: Router, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._router = router
        self._timeout_s = timeout_s

    def _workers(self) -> list[WorkerHandle]:
        """The live workers of the router's model (OpenAI-API engines load their own)."""
        namespace = self._router.namespace
        return [
            h
            for h in self._router.directory.handles()
            if not h.is_engine and (not namespace or h.info.namespace == namespace)
        ]

    async def load(self, name: str, path: str) -> LoraUpdate:
        """Load the adapter in the folder ``path`` as ``name`` on every worker."""
        request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        # NOTE: a worker that serves it already counts as done: a load again fills the gaps.
        update = await self._ask(
            self._workers(), "LoadLoraAdapter", request, grpc.StatusCode.ALREADY_EXISTS
        )
        logger.info("LoRA adapter %s from %s: loaded on %s", name, path, update.describe())
        return update

    async def unload(self, name: str) -> LoraUpdate:
        """Unload the adapter ``name`` from every worker that serves it."""
        request = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
        workers = [h for h in self._workers() if h.serves(name)]
        update = await self._ask(workers, "UnloadLoraAdapter", request, grpc.StatusCode.NOT_FOUND)
        logger.info("LoRA adapter %s: unloaded from %s", name, update.describe())
        return update

    async def _ask(
        self,
        workers: list[WorkerHandle],
        method: str,
        request: worker_pb2.LoadLoraAdapterRequest | worker_pb2.UnloadLoraAdapterRequest,
        already: grpc.StatusCode,
    ) -> LoraUpdate:
        """Call ``method`` on every worker at once; a worker answering ``already`` had it done.
        Then polls the loads, so that requests are routed by what the workers serve now."""
        results = await asyncio.gather(*(self._call(h, method, request) for h in workers))
        update = LoraUpdate(request.lora_name)
        for handle, error in zip(workers, results, strict=True):
            if error is None or error[0] is already:
                update.done.append(handle.worker_id)
            else:
                update.refused[handle.worker_id] = error
        await self._router.directory.poll_loads()
        return update

    async def _call(
        self, handle: WorkerHandle, method: str, request: object
    ) -> tuple[grpc.StatusCode, str] | None:
        """None once the worker did it; else its status and why."""
        assert handle.stub is not None
        try:
            await getattr(handle.stub, method)(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or e.code().name
        return None
