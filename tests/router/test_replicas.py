"""Router replicas route as one: a burst split over 2 or 4 routers goes where one router sends it.

The routers are ``kvswitch router`` processes sharing one Redis index (a server of this module's
own); the workers are stubs in this process, registered in that index, that answer a request's
first token at once and hold its stream open until the test lets them go: every request of a
burst is in flight while the next is routed, as in a real burst on one long document. The stubs
report no cache events, so what keeps a burst together is the routers' guesses and in-flight
counts, the state the replicas share (router/replicas.py).

Request ``i`` goes to router ``i mod N``; before request ``i + 1``, every router must count the
same requests in flight per worker and the same outstanding tokens (read from its metrics): the
test waits on that event, not on the clock.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.hashing import tokens_to_bytes
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis, free_port
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvswitch.worker.publisher import EventPublisher
from tests.router.harness import wait_until

NAMESPACE = "replica-stub"
BLOCK_SIZE = 16
NUM_WORKERS = 4
DOCUMENT = [(7 * i) % 250 + 1 for i in range(1024)]  # 64 blocks
MAX_TOKENS = 64


class _NoEvents:
    def take_cache_events(self) -> list:
        return []

    def snapshot(self) -> Any:
        from concurrent.futures import Future

        future: Future = Future()
        future.set_result((0, []))
        return future


@dataclass
class StubFleet:
    """Stub workers on an event loop of their own: each request's first token at once, its
    end when ``release`` is called."""

    index_url: str
    received: list[str] = field(default_factory=list)  # the worker of each request, in order
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _release: asyncio.Event | None = None

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(30), "the stub workers did not start"

    def release(self) -> None:
        """Let every request held so far end (and hold the next ones)."""

        def swap() -> None:
            assert self._release is not None
            self._release.set()
            self._release = asyncio.Event()

        self._loop.call_soon_threadsafe(swap)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main(ready))

    async def _main(self, ready: threading.Event) -> None:
        self._release = asyncio.Event()
        self._stop = asyncio.Event()
        fleet = self

        class Stub(worker_pb2_grpc.WorkerServicer):
            def __init__(self, worker_id: str) -> None:
                self.worker_id = worker_id

            async def Generate(self, request: Any, context: Any) -> Any:
                fleet.received.append(self.worker_id)
                release = fleet._release
                yield worker_pb2.WorkerGenerateResponse(
                    chunk=common_pb2.TokenChunk(token_ids=[1])
                )
                assert release is not None
                await release.wait()
                stats = common_pb2.RequestStats(worker_id=self.worker_id, num_output_tokens=1)
                yield worker_pb2.WorkerGenerateResponse(
                    final=worker_pb2.WorkerGenerateFinal(
                        finish_reason=common_pb2.FINISH_REASON_LENGTH, stats=stats
                    )
                )

            async def GetLoad(self, request: Any, context: Any) -> Any:
                return worker_pb2.WorkerLoad(worker_id=self.worker_id, num_free_blocks=4096)

        servers, publishers = [], []
        for k in range(NUM_WORKERS):
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(Stub(f"stub-{k}"), server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            index = await connect_index(self.index_url)
            info = WorkerInfo(f"stub-{k}", address, NAMESPACE, BLOCK_SIZE, num_blocks=4096)
            publisher = EventPublisher(index, _NoEvents(), info)
            publisher.start()
            servers.append(server)
            publishers.append(publisher)
        ready.set()
        await self._stop.wait()
        for publisher in publishers:
            await publisher.stop()
        for server in servers:
            await server.stop(0)


@dataclass
class Routers:
    """``kvswitch router`` processes on one Redis index, each with its metrics port."""

    processes: list[Any]
    addresses: list[str]
    metrics_ports: list[int]

    @classmethod
    def start(cls, index_url: str, count: int, *extra: str) -> Routers:
        processes, addresses, ports = [], [], []
        for _ in range(count):
            port = free_port()
            popen, address = start_server_process(
                ["router", "--port", "0", "--index", index_url, "--metrics-port", str(port)]
                + list(extra)
            )
            processes.append(popen)
            addresses.append(address)
            ports.append(port)
        return cls(processes, addresses, ports)

    def stop(self) -> None:
        for popen in self.processes:
            popen.terminate()
        for popen in self.processes:
            popen.wait(30)

    def loads(self, i: int) -> dict[str, tuple[float, float]]:
        """Router ``i``'s view per worker: requests in flight (its own and the other routers'),
        outstanding tokens."""
        url = f"http://127.0.0.1:{self.metrics_ports[i]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        requests: dict[str, float] = {}
        tokens: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                worker_id = sample.labels.get("worker_id")
                if sample.name in (
                    "kvswitch_router_worker_in_flight_requests",
                    "kvswitch_router_worker_replica_requests",
                ):
                    requests[worker_id] = requests.get(worker_id, 0) + sample.value
                elif sample.name == "kvswitch_router_worker_outstanding_tokens":
                    tokens[worker_id] = sample.value
        return {w: (requests.get(w, 0), tokens.get(w, 0)) for w in tokens}

    def agree(self, sent: dict[str, int]) -> bool:
        """Every router counts ``sent`` in flight per worker, with the same outstanding tokens."""
        views = [self.loads(i) for i in range(len(self.addresses))]
        for view in views:
            if {w: n for w, (n, _) in view.items() if n} != {w: n for w, n in sent.items() if n}:
                return False
        return all(view == views[0] for view in views)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def stubs(redis_url: str) -> Iterator[StubFleet]:
    fleet = StubFleet(redis_url)
    fleet.start()
    yield fleet
    fleet.stop()


def route_burst(
    stubs: StubFleet, routers: Routers, salt: str, num_requests: int = 16
) -> list[str]:
    """Send ``num_requests`` questions on one document, request i to router i mod N, each
    held open; the worker each went to."""
    channels = [grpc.insecure_channel(a) for a in routers.addresses]
    calls = []
    first = len(stubs.received)
    sent: dict[str, int] = {}
    wait_until(lambda: routers.agree(sent), "the routers to see every stub")
    try:
        for i in range(num_requests):
            question = [251, 252, i % 250 + 1, 253]
            request = router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids_u32le=tokens_to_bytes(DOCUMENT + question)),
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
                cache_salt=salt,
            )
            call = router_pb2_grpc.RouterStub(channels[i % len(channels)]).Generate(
                request, timeout=120
            )
            assert next(call).HasField("chunk")  # routed, and its prompt "prefilled"
            calls.append(call)
            worker_id = stubs.received[first + i]
            sent[worker_id] = sent.get(worker_id, 0) + 1
            wait_until(lambda: routers.agree(sent), f"the routers to agree after request {i}")
        stubs.release()
        for call in calls:
            assert list(call)[-1].HasField("final")
        wait_until(lambda: routers.agree({}), "the routers to see the burst end")
    finally:
        for channel in channels:
            channel.close()
    return stubs.received[first : first + num_requests]


def test_two_and_four_routers_spread_a_burst_as_one_router_does(
    stubs: StubFleet, redis_url: str
) -> None:
    spreads = {}
    for count in (1, 2, 4):
        routers = Routers.start(redis_url, count)
        try:
            spreads[count] = route_burst(stubs, routers, salt=f"burst-{count}")
        finally:
            routers.stop()
    assert spreads[2] == spreads[1] and spreads[4] == spreads[1], spreads
    # The burst is kept together while its holder is not too loaded, then spread: both the
    # guesses and the in-flight counts mattered.
    assert spreads[1][:4] == [spreads[1][0]] * 4, spreads[1]
    assert len(set(spreads[1])) > 1, spreads[1]
