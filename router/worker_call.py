"""One call to one worker: its responses as they come, its errors sorted by whose fault they are.

A worker's status says what the router does next::

    INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE,
    PERMISSION_DENIED, UNAUTHENTICATED, ABORTED          -> Refused: the request is at fault
    DEADLINE_EXCEEDED                                   -> Refused: the client's deadline passed
    RESOURCE_EXHAUSTED                                  -> WorkerBusy: full; another may take it
    anything else, a stream without a final message,
    a worker lost (its load polls, its channel closed)  -> WorkerFailed: fail over
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from kvswitch.router.disagg import DisaggConfig
from kvswitch.router.workers import InFlight, WorkerDirectory, WorkerHandle
from kvswitch.serving import retry_after_ms
from kvswitch.v1 import worker_pb2

# A worker that answers with one of these judged the request, not itself: tell the client.
CLIENT_ERRORS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    # A decode worker's KV transfer failed and the policy says fail (router/disagg.py).
    grpc.StatusCode.ABORTED,
)


class WorkerError(Exception):
    """A worker did not serve the request; ``handle`` is that worker."""

    def __init__(self, handle: WorkerHandle, why: str) -> None:
        super().__init__(why)
        self.handle = handle


class WorkerFailed(WorkerError):
    """A worker failed the request in a way another worker may not (it died, it is stopping).

    ``engine_failed``: its engine raised while running the request (INTERNAL). The request may be
    what breaks engines, so it gets one more worker, not ``max_failovers``.
    """

    def __init__(self, handle: WorkerHandle, why: str, *, engine_failed: bool = False) -> None:
        super().__init__(handle, f"worker {handle.worker_id}: {why}")
        self.engine_failed = engine_failed


class WorkerBusy(WorkerError):
    """A worker is at its queue limit (RESOURCE_EXHAUSTED): another may take the request."""

    def __init__(self, handle: WorkerHandle, retry_after_ms: int) -> None:
        super().__init__(handle, f"worker {handle.worker_id} is at its queue limit")
        self.retry_after_ms = retry_after_ms


class Refused(WorkerError):
    """The worker judged the request itself (bad input, deadline passed): tell the client."""

    def __init__(self, handle: WorkerHandle, code: grpc.StatusCode, details: str) -> None:
        super().__init__(handle, details)
        self.code = code
        self.details = details


async def relay(
    worker_request: worker_pb2.WorkerGenerateRequest,
    handle: WorkerHandle,
    flight: InFlight,
    directory: WorkerDirectory,
    timeout_s: float | None,
) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    """The worker's responses, each counted against ``flight`` as it comes. Its own failures
    raise ``WorkerFailed`` (try another worker), its verdicts on the request ``Refused`` (tell
    the client), its queue limit ``WorkerBusy``; the call is cancelled with the caller."""
    try:
        assert handle.streams is not None, "an engine is reached over HTTP"
        call = handle.streams.generate(worker_request, timeout=timeout_s)
    except grpc.aio.UsageError:  # its channel closed: it left after it was chosen
        raise WorkerFailed(handle, "it left the fleet") from None
    # NOTE: a worker cut off without a word (its link down, its process stopped) sends
    # nothing, not even an error: once its load poll fails, its streams stop waiting.
    lost = handle.lost
    watcher = asyncio.get_running_loop().create_task(_cancel_when(lost, call))
    try:
        async for response in call:
            if response.HasField("chunk"):
                # NOTE: in this order, the first token's output goes out with the prefill's end
                # to the other router replicas.
                directory.produced(flight, len(response.chunk.token_ids))
                directory.first_token(flight)
            yield response
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if lost.is_set() and task is not None and not task.cancelling():
            raise WorkerFailed(handle, "it stopped answering its load polls") from None
        raise
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code in CLIENT_ERRORS:
            raise Refused(handle, code, e.details() or code.name) from None
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise WorkerBusy(handle, retry_after_ms(e.trailing_metadata())) from None
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Refused(handle, code, "the request's deadline passed") from None
        raise WorkerFailed(
            handle,
            f"{code.name}: {e.details()}",
            engine_failed=code is grpc.StatusCode.INTERNAL,
        ) from None
    finally:
        watcher.cancel()
        call.cancel()


async def _cancel_when(event: asyncio.Event, call: grpc.aio.Call) -> None:
    await event.wait()
    call.cancel()


def kv_source(handle: WorkerHandle, transfer_id: str, disagg: DisaggConfig) -> worker_pb2.KVSource:
    """Where a worker takes blocks from before it computes: ``handle``'s blocks held under
    ``transfer_id`` (a prefill's lease), or its cached ones (``transfer_id`` empty)."""
    return worker_pb2.KVSource(
        peer_address=handle.info.address,
        transfer_id=transfer_id,
        transport=disagg.transport,
        on_failure=disagg.on_transfer_failure,
    )


async def release_blocks(handle: WorkerHandle, transfer_id: str) -> None:
    """Tell a prefill worker that nobody will fetch the blocks it holds; if it cannot be
    told, its lease runs out."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await handle.stub.ReleaseBlocks(
            worker_pb2.ReleaseBlocksRequest(transfer_id=transfer_id), timeout=1.0
        )
