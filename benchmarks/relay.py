"""``kvswitch bench relay``: how many streamed tokens a router relays a second, per core of its
own, against the same clients going straight to the workers.

The workers are stubs (a process of their own) that stream ``num_output_tokens`` tokens a
request, ``tokens_per_message`` a message, as fast as they are taken: no model, so only the
relay is measured. The routers call them as they call workers, over one ``GenerateStream`` a
stub (a message carries what the stub's calls have ready; a call's chunks the router has not
taken yet join); the clients straight to the stubs make a ``Generate`` call each. Routers run
as ``kvswitch router`` processes over one Redis index (a ``redis-server`` of this run's own)
where the stubs register. Client processes keep ``concurrency`` streams open for
``duration_s``, through the routers (spread over them) or straight to the stubs, and count the
tokens they read.

Figures, for each number of routers (``routers``): ``tokens_per_s`` through them,
``router_cpu_s`` their CPU time (user + system, from ``/proc``) over the window,
``tokens_per_s_per_core`` (tokens over that CPU time: what one core of router relays),
``router_cpu_us_per_token``, ``tokens_per_message_read``; and ``direct_tokens_per_s``, the
clients straight to the stubs. Every process shares the machine's cores, so the per-core figure
is the one to compare.

Decode-paced (``step_ms`` > 0), every stream gets a token a step, and a stub sends what its
reader has not taken yet as one message once it holds ``tokens_per_message`` (a worker's
``--stream-interval``). Each message's first token id is then the time it was sent (the
machine's monotonic clock, in microseconds modulo 2^32), and the clients sample each fourth
message's delay: ``direct_message_delay_us`` and, per router count, ``message_delay_us`` and
``added_delay_us`` (their difference: the router's added latency), at p50 and p99.

With ``api`` "http" the clients read streamed completions from the routers' OpenAI-compatible
API (``--http-port``) instead, and count a token a character of the text (a stub's token is an
"x"); they sample no delays. The clients straight to the stubs stay gRPC: they measure what the
stubs offer.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from kvswitch.benchmarks.stub_engines import stamp_us
from kvswitch.benchmarks.timing import cpu_seconds, machine_info, p50_p99

NAMESPACE = "relay-stub"
APIS = ("grpc", "http")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class RelayBenchConfig:
    routers: str = "1,2"  # router processes to measure with, each count its own run
    num_workers: int = 2
    concurrency: int = 16  # streams open at once, over every client process
    num_clients: int = 2  # client processes
    num_output_tokens: int = 4096  # a request's tokens
    tokens_per_message: int = 1  # a stub's tokens per streamed message
    # 0: a stub streams as fast as it is read. Above 0: every stream gets one token a step of
    # this many milliseconds (a decode step's), and a stub sends what its reader has not taken
    # yet in one message, once there are tokens_per_message (a worker's --stream-interval), as a
    # worker does (worker/servicer.py ``_next_outputs``).
    step_ms: float = 0.0
    duration_s: float = 3.0
    # What the clients call the routers by: "grpc" (the Router service, as the SDK does) or
    # "http" (the OpenAI-compatible API's streamed completions, from the routers' --http-port).
    api: str = "grpc"

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        counts = self.router_counts()
        if not counts or min(counts) < 1:
            raise ValueError(f"routers must list positive counts, got {self.routers!r}")
        for name in ("num_workers", "concurrency", "num_clients", "num_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 1 <= self.tokens_per_message <= self.num_output_tokens:
            raise ValueError("tokens_per_message must be in [1, num_output_tokens]")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be positive, got {self.duration_s}")
        if not 0 <= self.step_ms < 10_000:
            raise ValueError(f"step_ms must be in [0, 10000), got {self.step_ms}")

    def router_counts(self) -> list[int]:
        return [int(n) for n in self.routers.split(",") if n.strip()]


# -- the stub workers (a process of their own) -------------------------------------------------


def _serve_stubs(config: RelayBenchConfig, index_url: str, addresses: Any, stop: Any) -> None:
    import asyncio

    from kvswitch.benchmarks.stub_engines import NoEvents
    from kvswitch.cache_index.connect import connect_index
    from kvswitch.cache_index.index import WorkerInfo
    from kvswitch.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from kvswitch.worker.publisher import EventPublisher

    class Steps:
        """A decode step every ``step_ms``: its number, and an event set as it ends."""

        def __init__(self) -> None:
            self.step = 0
            self.ended = asyncio.Event()

        async def run(self) -> None:
            while True:
                await asyncio.sleep(config.step_ms / 1000)
                self.step += 1
                ended, self.ended = self.ended, asyncio.Event()
                ended.set()

    steps = Steps()

    def stamped(num_tokens: int) -> Any:
        """A chunk of ``num_tokens`` tokens, the first the time it is sent (``stamp``); the text
        an "x" a token (what the HTTP API's clients count)."""
        token_ids = [stamp(), *range(1, num_tokens)]
        chunk = common_pb2.TokenChunk(token_ids=token_ids, text="x" * num_tokens)
        return worker_pb2.WorkerGenerateResponse(chunk=chunk)

    class Stub(worker_pb2_grpc.WorkerServicer):
        def __init__(self, worker_id: str) -> None:
            self.worker_id = worker_id

        async def Generate(self, request, context):
            wanted = request.sampling.max_tokens or config.num_output_tokens
            if config.step_ms:
                async for response in self._paced(wanted):
                    yield response
                return
            size = config.tokens_per_message
            chunk = worker_pb2.WorkerGenerateResponse(
                chunk=common_pb2.TokenChunk(token_ids=list(range(size)), text="x" * size)
            )
            for _ in range(wanted // size):
                yield chunk
            stats = common_pb2.RequestStats(
                worker_id=self.worker_id, num_output_tokens=wanted // size * size
            )
            yield worker_pb2.WorkerGenerateResponse(
                final=worker_pb2.WorkerGenerateFinal(
                    finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=stats
                )
            )

        async def _paced(self, wanted: int) -> Any:
            """A token a step; those the reader has not taken yet go as one message, once
            there are ``tokens_per_message`` (a worker's --stream-interval) or the end."""
            first, sent = steps.step, 0
            while sent < wanted:
                await steps.ended.wait()
                ready = min(steps.step - first, wanted) - sent
                if ready < config.tokens_per_message and sent + ready < wanted:
                    continue
                yield stamped(ready)
                sent += ready
            stats = common_pb2.RequestStats(worker_id=self.worker_id, num_output_tokens=sent)
            yield worker_pb2.WorkerGenerateResponse(
                final=worker_pb2.WorkerGenerateFinal(
                    finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=stats
                )
            )

        async def GenerateStream(self, requests: Any, context: Any) -> None:
            from kvswitch.worker.call_stream import StreamedCalls

            await StreamedCalls(self.Generate, context).serve(requests)

        async def GetLoad(self, request, context):
            return worker_pb2.WorkerLoad(worker_id=self.worker_id, num_free_blocks=1024)

    async def main() -> None:
        servers, publishers = [], []
        ticking = [asyncio.create_task(steps.run())] if config.step_ms else []
        for k in range(config.num_workers):
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(Stub(f"stub-{k}"), server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            index = await connect_index(index_url)
            info = WorkerInfo(f"stub-{k}", address, NAMESPACE, BLOCK_SIZE, num_blocks=1024)
            publisher = EventPublisher(index, NoEvents(), info)
            publisher.start()
            servers.append(server)
            publishers.append(publisher)
            addresses.put(address)
        await asyncio.to_thread(stop.wait)
        for task in ticking:
            task.cancel()
        for publisher in publishers:
            await publisher.stop()
        for server in servers:
            await server.stop(0)

    asyncio.run(main())


# -- the clients (processes of their own) ---------------------------------------------------------


def _client(
    targets: list[str], routed: bool, num_streams: int, config: RelayBenchConfig, results: Any
) -> None:
    """Keep ``num_streams`` streams open to ``targets`` (round robin) for the window; put
    (tokens read a second, requests finished, tokens read, messages read) on ``results``."""
    from kvswitch.cache_index.hashing import tokens_to_bytes
    from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

    prompt = tokens_to_bytes(list(range(32)))
    sampling = common_pb2.SamplingParams(max_tokens=config.num_output_tokens)
    channels = [grpc.insecure_channel(t) for t in targets]
    if routed:
        request: Any = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids_u32le=prompt), sampling=sampling
        )
        calls = [router_pb2_grpc.RouterStub(c).Generate for c in channels]
    else:
        request = worker_pb2.WorkerGenerateRequest(prompt_token_ids_u32le=prompt, sampling=sampling)
        calls = [worker_pb2_grpc.WorkerStub(c).Generate for c in channels]
    if routed and config.api == "http":
        stream_http = _http_stream(targets, config)
    counts = [[0, 0, 0] for _ in range(num_streams)]  # tokens, requests, messages
    # Paced: each message's time from the stub's send to here, in microseconds (a sample).
    delays_us: list[list[int]] = [[] for _ in range(num_streams)]
    started = time.monotonic()
    deadline = started + config.duration_s

    def stream(slot: int) -> None:
        if routed and config.api == "http":
            while time.monotonic() < deadline:
                stream_http(slot, counts[slot], deadline)
            return
        call = calls[slot % len(calls)]
        while time.monotonic() < deadline:
            for message in call(request, timeout=60):
                if message.HasField("chunk"):
                    counts[slot][0] += len(message.chunk.token_ids)
                    counts[slot][2] += 1
                    if config.step_ms and counts[slot][2] % 4 == 0:
                        delays_us[slot].append((stamp() - message.chunk.token_ids[0]) % STAMP_END)
                    if time.monotonic() >= deadline:
                        break
            else:
                counts[slot][1] += 1

    threads = [threading.Thread(target=stream, args=(slot,)) for slot in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = time.monotonic() - started
    for channel in channels:
        channel.close()
    num_tokens = sum(c[0] for c in counts)
    num_messages = sum(c[2] for c in counts)
    delays = [d for slot in delays_us for d in slot]
    results.put(
        (num_tokens / elapsed_s, sum(c[1] for c in counts), num_tokens, num_messages, delays)
    )


def _http_stream(targets: list[str], config: RelayBenchConfig) -> Any:
    """``stream(slot, counts, deadline)``: one streamed completion from ``targets`` (host:port of
    the routers' HTTP APIs, round robin by slot) on the slot's kept-alive connection, counted
    into ``counts`` (tokens, requests, messages) as in the gRPC clients: a token an "x"."""
    import http.client
    import json

    body = json.dumps(
        {
            "model": NAMESPACE,
            "prompt": "Relay, please.",
            "max_tokens": config.num_output_tokens,
            "stream": True,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    connections: dict[int, http.client.HTTPConnection] = {}

    def stream(slot: int, counts: list[int], deadline: float) -> None:
        connection = connections.get(slot)
        if connection is None:
            host, port = targets[slot % len(targets)].rsplit(":", 1)
            connection = connections[slot] = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", body, headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"a completion answered {response.status}: {response.read()!r}")
        for line in response:
            if line.startswith(b"data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                counts[0] += len(text)
                counts[2] += bool(text)  # NOTE: the last event, its finish reason, has none
                if time.monotonic() >= deadline:
                    connection.close()  # NOTE: the rest unread: a new connection next time
                    del connections[slot]
                    return
        counts[1] += 1

    return stream


STAMP_END = 1 << 32


def stamp() -> int:
    """Now, in microseconds of the machine's monotonic clock (every process reads the same),
    modulo 2^32: what fits a token id."""
    return stamp_us() % STAMP_END


def _window(
    context: Any, targets: list[str], routed: bool, config: RelayBenchConfig, pids: list[int]
) -> tuple[float, float, int, int, int, list[int]]:
    """One measured window: (tokens a second, the ``pids``' CPU seconds over it, requests
    finished, tokens read, messages read, paced messages' delays in us, sorted). The CPU time
    spans the clients' start too, when routers idle."""
    results = context.Queue()
    shares = [config.concurrency // config.num_clients] * config.num_clients
    for i in range(config.concurrency % config.num_clients):
        shares[i] += 1
    clients = [
        context.Process(target=_client, args=(targets, routed, n, config, results))
        for n in shares
        if n
    ]
    cpu_before = sum(cpu_seconds(pid) for pid in pids)
    for client in clients:
        client.start()
    totals = [results.get(timeout=config.duration_s + 120) for _ in clients]
    cpu_s = sum(cpu_seconds(pid) for pid in pids) - cpu_before
    for client in clients:
        client.join(30)
    # NOTE: each client's rate over its own window: they start a process each, not at once.
    rate = sum(t[0] for t in totals)
    return (
        rate,
        cpu_s,
        sum(t[1] for t in totals),
        sum(t[2] for t in totals),
        sum(t[3] for t in totals),
        sorted(d for t in totals for d in t[4]),
    )


def run(config: RelayBenchConfig) -> dict[str, object]:
    from kvswitch.cache_index.local_redis import LocalRedis, free_port
    from kvswitch.serving import start_server_process

    context = multiprocessing.get_context("spawn")
    redis = LocalRedis().start()
    addresses, stop = context.Queue(), context.Event()
    stubs = context.Process(target=_serve_stubs, args=(config, redis.url, addresses, stop))
    stubs.start()
    routers: list[tuple[Any, str, str]] = []  # process, gRPC address, HTTP address
    figures: dict[str, object] = {}
    try:
        workers = [addresses.get(timeout=60) for _ in range(config.num_workers)]
        print(f"  {config.num_workers} stub workers; clients straight to them ...", file=sys.stderr)
        direct, _, _, _, _, direct_delays = _window(context, workers, False, config, [])
        figures["direct_tokens_per_s"] = direct
        if config.step_ms:
            figures["direct_message_delay_us"] = p50_p99(direct_delays)
        for count in config.router_counts():
            while len(routers) < count:
                http_port = free_port() if config.api == "http" else -1
                process, address = start_server_process(
                    ["router", "--port", "0", "--index", redis.url, "--wait-for-worker-s", "30"]
                    + ["--http-port", str(http_port)] * (http_port >= 0)
                )
                routers.append((process, address, f"127.0.0.1:{http_port}"))
            in_use = routers[:count]
            _wait_for_stubs([address for _, address, _ in in_use], config)
            targets = [
                http_address if config.api == "http" else address
                for _, address, http_address in in_use
            ]
            print(f"  through {count} router(s) ...", file=sys.stderr)
            tokens_per_s, cpu_s, num_requests, num_tokens, num_messages, delays = _window(
                context, targets, True, config, [process.pid for process, _, _ in in_use]
            )
            figures[f"routers_{count}"] = {
                "tokens_per_s": tokens_per_s,
                "router_cpu_s": cpu_s,
                "tokens_per_s_per_core": num_tokens / cpu_s if cpu_s else 0.0,
                "router_cpu_us_per_token": cpu_s / num_tokens * 1e6 if num_tokens else 0.0,
                "requests_finished": num_requests,
                "tokens_per_message_read": num_tokens / num_messages if num_messages else 0.0,
            }
            if config.step_ms and config.api == "grpc":
                # The router's added latency: a message's delay through it less straight.
                routed = p50_p99(delays)
                figures[f"routers_{count}"]["message_delay_us"] = routed  # type: ignore[index]
                figures[f"routers_{count}"]["added_delay_us"] = {  # type: ignore[index]
                    q: routed[q] - figures["direct_message_delay_us"][q]  # type: ignore[index]
                    for q in routed
                }
    finally:
        stop.set()
        stubs.join(30)
        for process, _, _ in routers:
            process.terminate()
            process.wait(10)
        redis.stop()
    first = figures.get(f"routers_{config.router_counts()[0]}")
    return {
        # NOTE: the headline key: one router's tokens per core of its own.
        "tokens_per_s_per_core": first["tokens_per_s_per_core"] if first else 0.0,  # type: ignore[index]
        **figures,
        "num_workers": config.num_workers,
        "concurrency": config.concurrency,
        "num_output_tokens": config.num_output_tokens,
        "tokens_per_message": config.tokens_per_message,
        "step_ms": config.step_ms,
        "duration_s": config.duration_s,
        "api": config.api,
        "machine": machine_info(),
    }


def _wait_for_stubs(targets: list[str], config: RelayBenchConfig) -> None:
    """Until every router routes a one-token request (it sees the stubs)."""
    from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=list(range(8))),
        sampling=common_pb2.SamplingParams(max_tokens=config.tokens_per_message),
    )
    for target in targets:
        with grpc.insecure_channel(target) as channel:
            deadline = time.monotonic() + 60
            while True:
                try:
                    list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=10))
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
