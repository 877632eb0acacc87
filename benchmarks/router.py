"""``kvswitch bench router``: what the router adds to a request, and how many it routes per second.

A real router runs as its own process (``kvswitch router``, embedded index). The workers are
stubs in this process: they register and publish a cached prefix like real workers, but answer
``Generate`` at once with one token, so that only the router's own work is measured: reading the
request, hashing the prompt's blocks, the index lookup, scoring, and the extra gRPC hop.

- overhead: for an 8,192-token prompt (token ids, as little-endian uint32 bytes: what the client
  SDK sends the router and the router the worker), one request straight to a stub worker and one
  through the router, in alternation; overhead = routed minus direct latency (to the final
  message), p50 and p99 over the pairs.
- decisions_per_s: the router's decision path alone, in this process (hash the prompt, match it
  in an embedded index of ``num_workers`` stubs, score them, record the guess), per second.
- requests_per_s: requests routed end to end per second by ``concurrency`` client threads.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.hashing import BlockHasher, tokens_from_bytes, tokens_to_bytes
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.router.router import Router
from kvswitch.router.workers import WorkerDirectory
from kvswitch.serving import start_server_process
from kvswitch.tokenizer import ByteTokenizer
from kvswitch.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvswitch.worker.call_stream import StreamedCalls
from kvswitch.worker.publisher import EventPublisher
from kvswitch.worker.servicer import prompt_from_proto

NAMESPACE = "stub-model"


@dataclass(frozen=True)
class RouterBenchConfig:
    num_prompt_tokens: int = 8192
    block_size: int = 16
    num_workers: int = 4
    num_pairs: int = 300
    concurrency: int = 16
    duration_s: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < self.block_size:
            raise ValueError("num_prompt_tokens must hold at least one block")
        for name in ("num_workers", "num_pairs", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {self.duration_s}")


class StubWorker(worker_pb2_grpc.WorkerServicer):
    """Answers every request at once with one token; reports an idle load."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def Generate(self, request, context):
        yield worker_pb2.WorkerGenerateResponse(chunk=common_pb2.TokenChunk(token_ids=[0]))
        stats = common_pb2.RequestStats(
            worker_id=self.worker_id,
            num_prompt_tokens=len(prompt_from_proto(request)),
            num_output_tokens=1,
        )
        final = worker_pb2.WorkerGenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=stats
        )
        yield worker_pb2.WorkerGenerateResponse(final=final)

    async def GenerateStream(self, requests, context):
        await StreamedCalls(self.Generate, context).serve(requests)

    async def GetLoad(self, request, context):
        return worker_pb2.WorkerLoad(worker_id=self.worker_id, num_free_blocks=1024)


class _CachedPrefix:
    """The event source of a stub: no events, a snapshot holding one chain."""

    def __init__(self, block_hashes: list[bytes]) -> None:
        self._block_hashes = block_hashes

    def take_cache_events(self) -> list:
        return []

    def snapshot(self) -> Future:
        future: Future = Future()
        future.set_result((0, self._block_hashes))
        return future


class _StubFleet:
    """Stub workers on a background event loop, registered with the router's index."""

    def __init__(self, router_address: str, config: RouterBenchConfig, prompt: list[int]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        chain = BlockHasher(NAMESPACE, config.block_size).hash_blocks(prompt)
        self.addresses: list[str] = []
        self._servers: list[grpc.aio.Server] = []
        self._publishers: list[EventPublisher] = []
        for k in range(config.num_workers):
            # Worker k holds a prefix of the prompt of its own length: the router has to choose.
            held = chain[: len(chain) * (k + 1) // config.num_workers]
            self._run(self._start(f"stub-{k}", router_address, held, config.block_size))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(
        self, worker_id: str, router_address: str, held: list[bytes], block_size: int
    ) -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(StubWorker(worker_id), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        index = await connect_index(f"grpc://{router_address}")
        info = WorkerInfo(worker_id, address, NAMESPACE, block_size, num_blocks=1024)
        publisher = EventPublisher(index, _CachedPrefix(held), info)
        publisher.start()
        self.addresses.append(address)
        self._servers.append(server)
        self._publishers.append(publisher)

    def close(self) -> None:
        async def stop() -> None:
            for publisher in self._publishers:
                await publisher.stop()
                await publisher.index.close()
            for server in self._servers:
                await server.stop(0)

        self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _run_stub_fleet(
    router_address: str, config: RouterBenchConfig, prompt: list[int], addresses, stop
) -> None:
    """A child process: serve the stubs until told to stop; the last stub's address goes back
    (it holds the whole prompt, so the router sends there: the direct path goes there too)."""
    fleet = _StubFleet(router_address, config, prompt)
    addresses.put(fleet.addresses[-1])
    stop.wait()
    fleet.close()


def _time_call(call, request) -> float:
    started = time.perf_counter()
    for _ in call(request, timeout=10):
        pass
    return time.perf_counter() - started


def run(config: RouterBenchConfig) -> dict[str, object]:
    rng = np.random.default_rng(config.seed)
    prompt = rng.integers(0, 32000, config.num_prompt_tokens).tolist()
    sampling = common_pb2.SamplingParams(max_tokens=1)
    prompt_bytes = tokens_to_bytes(prompt)
    routed_request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids_u32le=prompt_bytes), sampling=sampling
    )
    direct_request = worker_pb2.WorkerGenerateRequest(
        prompt_token_ids_u32le=prompt_bytes, sampling=sampling
    )

    print("starting a router and stub workers ...", file=sys.stderr)
    router, router_address = start_server_process(["router", "--port", "0", "--index", "memory://"])
    # NOTE: the stubs get a process of their own, so that they do not compete with the client
    # threads of this one for the interpreter lock.
    context = multiprocessing.get_context("spawn")
    addresses = context.Queue()
    stop = context.Event()
    fleet = context.Process(
        target=_run_stub_fleet, args=(router_address, config, prompt, addresses, stop)
    )
    fleet.start()
    try:
        worker_address = addresses.get(timeout=60)
        with (
            grpc.insecure_channel(router_address) as router_channel,
            grpc.insecure_channel(worker_address) as worker_channel,
        ):
            routed = router_pb2_grpc.RouterStub(router_channel).Generate
            direct = worker_pb2_grpc.WorkerStub(worker_channel).Generate
            _wait_for_routing(routed, routed_request, f"stub-{config.num_workers - 1}")
            for _ in range(20):  # warm both paths
                _time_call(direct, direct_request)
                _time_call(routed, routed_request)
            overheads_ms, direct_ms = [], []
            for i in range(config.num_pairs):
                direct_s = _time_call(direct, direct_request)
                routed_s = _time_call(routed, routed_request)
                overheads_ms.append((routed_s - direct_s) * 1000)
                direct_ms.append(direct_s * 1000)
                if (i + 1) % 100 == 0:
                    print(f"  {i + 1} pairs", file=sys.stderr)
            requests_per_s = _throughput(routed, routed_request, config)
    finally:
        stop.set()
        fleet.join(30)
        router.terminate()
        router.wait(10)
    quantiles = statistics.quantiles(overheads_ms, n=100)
    return {
        "overhead_p50_ms": statistics.median(overheads_ms),
        "overhead_p99_ms": quantiles[98],
        "direct_p50_ms": statistics.median(direct_ms),
        "decisions_per_s": asyncio.run(_decisions_per_s(config, prompt)),
        "requests_per_s": requests_per_s,
        "num_prompt_tokens": config.num_prompt_tokens,
        "num_workers": config.num_workers,
        "concurrency": config.concurrency,
        "machine": machine_info(),
    }


def _wait_for_routing(routed, request, expected_worker: str) -> None:
    """Until the router sees every stub and the index holds their prefixes."""
    deadline = time.monotonic() + 30
    while True:
        try:
            worker_id = list(routed(request, timeout=10))[-1].final.stats.worker_id
        except grpc.RpcError as e:  # no worker registered yet
            worker_id = e.details()
        if worker_id == expected_worker:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests went to {worker_id}, not {expected_worker}")
        time.sleep(0.1)


def _throughput(routed, request, config: RouterBenchConfig) -> float:
    deadline = time.perf_counter() + config.duration_s
    counts = [0] * config.concurrency

    def client(slot: int) -> None:
        while time.perf_counter() < deadline:
            _time_call(routed, request)
            counts[slot] += 1

    started = time.perf_counter()
    with ThreadPoolExecutor(config.concurrency) as pool:
        list(pool.map(client, range(config.concurrency)))
    return sum(counts) / (time.perf_counter() - started)


async def _decisions_per_s(config: RouterBenchConfig, prompt: list[int]) -> float:
    """The router's own decision path, in this process: plan (hash the prompt's blocks), choose
    (index match, guesses, policy), record the guess; stub workers known to an embedded index."""
    index = MemoryIndex()
    chain = BlockHasher(NAMESPACE, config.block_size).hash_blocks(prompt)
    for k in range(config.num_workers):
        info = WorkerInfo(
            f"stub-{k}", f"127.0.0.1:{k + 1}", NAMESPACE, config.block_size, "both", 1024
        )
        await index.register(info, ttl_s=600)
        await index.resync(info.worker_id, 1, chain[: len(chain) * (k + 1) // config.num_workers])
    directory = WorkerDirectory(index)
    await directory.refresh()
    router = Router(index, directory, ByteTokenizer())
    ids = tokens_from_bytes(tokens_to_bytes(prompt))  # as the servicer gets them
    count = 0
    started = time.perf_counter()
    deadline = started + config.duration_s
    while time.perf_counter() < deadline:
        for _ in range(100):
            plan = router.plan(token_ids=ids)
            decision, _ = await router.choose(plan)
            router.routed(plan, decision)
        count += 100
    rate = count / (time.perf_counter() - started)
    await directory.stop()
    return rate
