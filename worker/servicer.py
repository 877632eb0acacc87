"""``kvswitch.v1.Worker``: the servicer translates between protobuf and the engine's types; the
engine runs in an engine core process of its own (``EngineClient``), so a model step never
blocks the event loop that serves RPCs, nor takes its GIL."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import cast

import grpc
import numpy as np

from kvswitch.cache_index.hashing import tokens_from_bytes
from kvswitch.serving import (
    RETRY_AFTER_KEY,
)
from kvswitch.tokenizer import (
    IncrementalDecoder,
    Tokenizer,
)
from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvswitch.worker.block_transfer import BlockTransfers
from kvswitch.worker.call_stream import StreamedCalls
from kvswitch.worker.engine_client import (
    EngineClient,
    EngineDied,
    EngineError,
    EngineStopped,
    LoadReport,
)
from kvswitch.worker.kv_pull import KVPuller, PullFailed, check_kv_source
from kvswitch.worker.metrics import WorkerMetrics
from kvswitch.worker.peers import FleetPeers
from kvswitch.worker.request import FinishReason, Logprobs, RequestOutput, SamplingParams
from kvswitch.worker.worker_config import DEFAULT_MAX_TOKENS, MAX_HASHES_PER_CHUNK, RETRY_AFTER_MS

logger = logging.getLogger(__name__)

_FINISH_REASON_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


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
            logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
            prompt_logprobs=(
                sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
            ),
        )
    except ValueError as e:  # its messages start with the field's name
        raise ValueError(f"sampling.{e}") from None


def logprobs_to_proto(run: Logprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprobs=run.logprobs.tolist(),
        num_top=run.num_top,
        top_token_ids=run.top_token_ids.ravel().tolist(),
        top_logprobs=run.top_logprobs.ravel().tolist(),
    )


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
        loras=load.loras,
        loaded_loras=load.loaded_loras,
        cpu_loras=load.cpu_loras,
        num_free_lora_slots=load.num_free_lora_slots,
        num_host_blocks=load.num_host_blocks,
        num_host_total_blocks=load.num_host_total_blocks,
        num_host_copies=load.num_host_copies,
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
        stream_interval: int = 1,
    ) -> None:
        self._max_requests = max_requests  # running and waiting; 0 = no limit
        self._stream_interval = stream_interval  # the fewest tokens a chunk waits for
        self._engine = engine
        self._transfers = transfers if transfers is not None else BlockTransfers(engine)
        self._puller = KVPuller(
            engine,
            self._transfers,
            peers,
            allow_pull_blocks=allow_pull_blocks,
            on_failure=metrics.kv_pull_failed,
        )
        self._worker_id = worker_id
        self._tokenizer = tokenizer  # None: chunks carry no text
        self._metrics = metrics
        self._max_hashes_per_chunk = max_hashes_per_chunk
        self._streams: set[StreamedCalls] = set()  # the GenerateStreams open now
        self._draining = False

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # NOTE: written with context.write, not as an async generator, so that cancelling the RPC
        # raises CancelledError inside this coroutine and the `finally` below always runs.
        request_id = request.request_id or f"worker-{uuid.uuid4().hex}"
        log_extra = {"request_id": request_id}
        block_hashes: list[bytes] = []  # hashed here only for a pull; else the engine client's
        slots = None  # the blocks the engine holds for a pull
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
                check_kv_source(request.kv_source)
                if request.pooling:
                    raise ValueError(
                        "an embedding is computed where the prompt is: a request with pooling "
                        "cannot take its prompt's KV from a peer (kv_source)"
                    )
                prompt = self._engine.checked_prompt(
                    prompt_token_ids,
                    lora=request.lora or None,
                    num_resumed_tokens=request.num_resumed_tokens,
                    hold_s=request.hold_blocks_ms / 1000,
                )
                hasher = self._engine.hasher(request.cache_salt or None, request.lora or None)
                block_hashes = hasher.hash_blocks(prompt)
                # NOTE: queued first, holding the blocks the pull fills: they count as this
                # worker's queue, and nothing evicts them before the request runs.
                queue, slots = await self._engine.submit_awaiting_kv(
                    request_id,
                    prompt,
                    params,
                    block_hashes=block_hashes,
                    lora=request.lora or None,
                    cache_salt=request.cache_salt or None,
                    num_resumed_tokens=request.num_resumed_tokens,
                    hold_s=request.hold_blocks_ms / 1000,
                )
            else:
                queue = await self._engine.submit(
                    request_id,
                    prompt_token_ids,
                    params,
                    lora=request.lora or None,
                    cache_salt=request.cache_salt or None,
                    num_resumed_tokens=request.num_resumed_tokens,
                    hold_s=request.hold_blocks_ms / 1000,
                    pooling=request.pooling or None,
                    priority=request.priority,
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
        )
        # NOTE: the fewest tokens a chunk waits for: the request's own, else this worker's.
        stream_interval = request.stream_interval or self._stream_interval
        done = False  # the engine is finished with the request
        finish_reason = "abort"  # until the engine says otherwise: the RPC was cancelled
        ttft_s: float | None = None
        try:
            if slots is not None:
                try:
                    stats.num_transferred_blocks = await self._puller.take_prefill(
                        request_id, block_hashes, slots, request.kv_source, context
                    )
                except PullFailed as e:
                    finish_reason = "error"
                    await context.abort(grpc.StatusCode.ABORTED, f"request {request_id}: {e}")
                except EngineStopped as e:
                    finish_reason = "error"
                    await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
            while not done:
                outputs, error = await _next_outputs(queue, stream_interval)
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
                        if output.prompt_logprobs is not None:
                            chunk.prompt_logprobs.CopyFrom(
                                logprobs_to_proto(output.prompt_logprobs)
                            )
                        if output.embedding is not None:
                            chunk.embedding.extend(output.embedding)
                runs = [o.logprobs for o in outputs if o.logprobs is not None]
                if runs:
                    chunk.logprobs.CopyFrom(logprobs_to_proto(Logprobs.join(runs)))
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

    async def GenerateStream(
        self,
        requests: AsyncIterator[worker_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        # NOTE: each call runs as Generate above, with a context that puts its messages in the
        # stream's outbox (worker/call_stream.py).
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down")
        calls = StreamedCalls(self.Generate, context)
        self._streams.add(calls)
        try:
            await calls.serve(requests)
        finally:
            self._streams.discard(calls)

    def drain(self) -> None:
        """The worker stops: its streams of calls take no more and end with their last call
        (a stopping gRPC server refuses new calls itself, but a stream's calls are not its)."""
        self._draining = True
        for calls in self._streams:
            calls.drain()

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerLoad:
        return load_to_proto(self._engine.load, self._worker_id)

    async def Snapshot(
        self, request: worker_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            event_seq, block_hashes = await asyncio.wrap_future(
                self._engine.snapshot(device_only=request.device_only)
            )
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
        try:
            return await self._puller.pull_blocks(request, context)
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))

    async def ReleaseBlocks(
        self, request: worker_pb2.ReleaseBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseBlocksResponse:
        if request.transfer_id:
            self._engine.release(request.transfer_id)
        return worker_pb2.ReleaseBlocksResponse()

    async def LoadLoraAdapter(
        self, request: worker_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraAdaptersResponse:
        name = request.lora_name
        if name in self._engine.loras:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"lora_name: adapter {name!r} is served already"
            )
        try:
            await self._engine.load_lora(name, request.lora_path)
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.info("serving LoRA adapter %s from %s", name, request.lora_path)
        return worker_pb2.LoraAdaptersResponse(loras=self._engine.loras)

    async def UnloadLoraAdapter(
        self, request: worker_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoraAdaptersResponse:
        name = request.lora_name
        if name not in self._engine.loras:
            served = ", ".join(self._engine.loras) or "none"
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"lora_name: adapter {name!r} is not served here; served: {served}",
            )
        try:
            await self._engine.unload_lora(name)
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _unavailable(e))
        except ValueError as e:  # requests name it
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        logger.info("no longer serving LoRA adapter %s", name)
        return worker_pb2.LoraAdaptersResponse(loras=self._engine.loras)


async def _next_outputs(
    queue: asyncio.Queue[RequestOutput | EngineError], min_tokens: int = 1
) -> tuple[list[RequestOutput], EngineError | None]:
    """Wait for outputs of ``min_tokens`` tokens at least, then take every one already queued:
    a client that reads slower than the engine decodes gets several tokens per chunk instead of
    falling behind. The first token (its output carries the TTFT), the end and an error do not
    wait for more. An error, if one came, is the queue's last item."""
    items: list[RequestOutput | EngineError] = []
    while True:
        items.append(await queue.get())
        while not queue.empty():
            items.append(queue.get_nowait())
        last = items[-1]
        if isinstance(last, EngineError):
            return [], last
        outputs = cast("list[RequestOutput]", items)
        if (
            last.finished
            or min_tokens <= 1
            or sum(len(o.new_token_ids) for o in outputs) >= min_tokens
            or any(o.ttft_s is not None for o in outputs)
        ):
            return outputs, None


def _error_status(request_id: str, error: EngineError) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, f"request {request_id}: {_unavailable(error)}"
    return grpc.StatusCode.INTERNAL, f"request {request_id}: {error}"


def _unavailable(error: EngineStopped) -> str:
    if isinstance(error, EngineDied):
        return f"this worker is stopping: {error}"
    return "this worker is shutting down"
