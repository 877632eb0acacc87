"""Stub engines for the router benchmarks: no model, answers at once.

An OpenAI-API stub (``serve_http_stubs``) answers ``/v1/completions`` with ``num_tokens`` tokens
of one character each: whole, or as one server-sent event a token (vLLM's stream, usage last
when asked), as fast as they are read; for the prompt "paced every N ms", an event every N ms,
its text the time it left (``stamp_us``). And what the routers ask of an engine besides:
``/health``, ``/metrics`` (a page of vLLM's size and names, ``vllm_metrics.py``),
``/v1/models``, ``/tokenize`` (vllm-router's), SGLang's ``/get_model_info`` and
``/get_server_info``. Each also binds a ZeroMQ PUB socket that never publishes: the KV-event
stream a kvswitch router in engine mode follows.

A gRPC stub (``serve_grpc_stubs``) is a kvswitch worker's ``Generate`` doing the same, one token a
message (or, as a worker does for a request's ``stream_interval``, the first token alone and then
that many a message), registered in a router's embedded index.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from kvswitch.benchmarks.vllm_metrics import vllm_metrics_page

MODEL = "stub"
BLOCK_SIZE = 16
NUM_BLOCKS = 4096


class NoEvents:
    """A stub worker's event source: no cache events, an empty snapshot."""

    def take_cache_events(self) -> list:
        return []

    def snapshot(self) -> Any:
        from concurrent.futures import Future

        future: Future = Future()
        future.set_result((0, []))
        return future


_METRICS = vllm_metrics_page(MODEL, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


PACED = "paced every "  # a prompt "paced every 10 ms": a token a step, each stamped


def stamp_us() -> int:
    """The machine's monotonic clock in microseconds: one clock for every process here."""
    return time.monotonic_ns() // 1000


def _paced_step_s(prompt: str) -> float:
    """The step a prompt ``PACED`` + "N ms" asks for; 0 for any other prompt."""
    if not prompt.startswith(PACED) or not prompt.endswith(" ms"):
        return 0.0
    return float(prompt[len(PACED) : -len(" ms")]) / 1000


def _app(num_tokens: int) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> Response:
        body = await request.json()
        wanted = int(body.get("max_tokens") or num_tokens)
        created = 1
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "cmpl-stub",
                    "object": "text_completion",
                    "created": created,
                    "model": MODEL,
                    "choices": [{"index": 0, "text": "x" * wanted, "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": 8,
                        "completion_tokens": wanted,
                        "total_tokens": 8 + wanted,
                    },
                }
            )
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        prompt = body.get("prompt")
        step_s = _paced_step_s(prompt) if isinstance(prompt, str) else 0.0

        async def events() -> Any:
            chunk = {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": created,
                "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": None}],
            }
            line = f"data: {json.dumps(chunk)}\n\n".encode()
            for _ in range(wanted - 1):
                if step_s:
                    # NOTE: a decode step's token, its text the time it leaves (stamp_us).
                    await asyncio.sleep(step_s)
                    chunk["choices"][0]["text"] = str(stamp_us())
                    line = f"data: {json.dumps(chunk)}\n\n".encode()
                yield line
            chunk["choices"][0]["finish_reason"] = "length"
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if with_usage:
                usage = {
                    "prompt_tokens": 8,
                    "completion_tokens": wanted,
                    "total_tokens": 8 + wanted,
                }
                last = {**chunk, "choices": [], "usage": usage}
                yield f"data: {json.dumps(last)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        text = body.get("prompt") or ""
        tokens = list(text.encode()[:8192]) if isinstance(text, str) else list(text)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 131072})

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 131072}]}
        )

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})

    async def server_info(request: Request) -> Response:
        return JSONResponse({"model_path": MODEL, "dp_size": 1, "tp_size": 1, "version": "stub"})

    async def health(request: Request) -> Response:
        return PlainTextResponse("")

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(_METRICS)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models),
            Route("/get_model_info", model_info),
            Route("/model_info", model_info),
            Route("/get_server_info", server_info),
            Route("/server_info", server_info),
            Route("/health", health),
            Route("/health_generate", health),
            Route("/metrics", metrics),
        ]
    )


def silent_publishers(ports: list[int]) -> list[Any]:
    """A ZeroMQ PUB socket bound on each of ``ports`` on loopback: KV-event streams that never
    publish (keep them while they serve)."""
    import zmq

    context = zmq.Context()
    sockets = []
    for port in ports:
        socket = context.socket(zmq.PUB)
        socket.bind(f"tcp://127.0.0.1:{port}")
        sockets.append(socket)
    return sockets


def serve_http_stubs(
    num_engines: int, num_tokens: int, ports: list[int], event_ports: list[int], ready: Any
) -> None:
    """Serve ``num_engines`` stubs on ``ports`` (their KV-event PUB sockets on
    ``event_ports``) until killed; puts True on ``ready`` once they serve."""
    import uvicorn

    publishers = silent_publishers(event_ports)

    async def main() -> None:
        servers = []
        for port in ports[:num_engines]:
            config = uvicorn.Config(
                _app(num_tokens), host="127.0.0.1", port=port, log_level="error", access_log=False
            )
            servers.append(uvicorn.Server(config))
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        while not all(s.started for s in servers):
            await asyncio.sleep(0.01)
        ready.put(True)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    finally:
        for socket in publishers:
            socket.close(linger=0)


def serve_grpc_stubs(
    num_engines: int, index_url: str, addresses: Any, load_polls: Any = None
) -> None:
    """``num_engines`` gRPC stub workers registered in the index at ``index_url``; their
    addresses on ``addresses``; until killed. ``load_polls``: a shared array counting each
    one's ``GetLoad`` calls."""
    import grpc

    from kvswitch.cache_index.connect import connect_index
    from kvswitch.cache_index.index import WorkerInfo
    from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from kvswitch.worker.publisher import EventPublisher

    class Stub(worker_pb2_grpc.WorkerServicer):
        def __init__(self, k: int) -> None:
            self.k = k
            self.worker_id = f"stub-{k}"

        async def Generate(self, request: Any, context: Any) -> Any:
            wanted = request.sampling.max_tokens or 16
            # NOTE: as a worker sends them: the first token alone, then stream_interval a chunk.
            interval = max(request.stream_interval, 1)
            sizes = [1] + [interval] * ((wanted - 1) // interval)
            if (wanted - 1) % interval:
                sizes.append((wanted - 1) % interval)
            for size in sizes:
                yield worker_pb2.WorkerGenerateResponse(
                    chunk=common_pb2.TokenChunk(token_ids=[120] * size, text="x" * size)
                )
            stats = common_pb2.RequestStats(worker_id=self.worker_id, num_output_tokens=wanted)
            yield worker_pb2.WorkerGenerateResponse(
                final=worker_pb2.WorkerGenerateFinal(
                    finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=stats
                )
            )

        async def GenerateStream(self, requests: Any, context: Any) -> None:
            from kvswitch.worker.call_stream import StreamedCalls

            await StreamedCalls(self.Generate, context).serve(requests)

        async def GetLoad(self, request: Any, context: Any) -> Any:
            if load_polls is not None:
                load_polls[self.k] += 1
            return worker_pb2.WorkerLoad(worker_id=self.worker_id, num_free_blocks=NUM_BLOCKS)

    async def main() -> None:
        holders = []
        for k in range(num_engines):
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(Stub(k), server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            index = await connect_index(index_url)
            info = WorkerInfo(f"stub-{k}", address, MODEL, BLOCK_SIZE, num_blocks=NUM_BLOCKS)
            publisher = EventPublisher(index, NoEvents(), info)
            publisher.start()
            holders.append((server, publisher))
            addresses.put(address)
        await asyncio.Event().wait()

    asyncio.run(main())
