"""Router replicas route as one: a burst split over 2 or 4 routers goes where one router sends it.

The routers are ``kvswitch router`` processes sharing one Redis index (a server of this module's
own); the workers are stubs in this process, registered in that index, that answer a request's
first token at once and hold its stream open until the test lets them go: every request of a
burst is in flight while the next is routed, as in a real burst on one long document. The stubs
report no cache events, so what keeps a burst together is the routers' guesses and in-flight
counts, the state the replicas share (router/replicas.py).

Request ``i`` goes to router ``i mod N``; before request ``i + 1``, every router must count the
same requests in flight per worker and the same outstanding tokens (read from its metrics): the
test waits on that event, not on the clock. The routers run as processes on this host, as the
processes of one ``kvswitch router --processes 2`` on one port, and each on a host (a network
namespace) of its own; a router killed and started again takes the running one's guesses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.benchmarks.stub_engines import NoEvents
from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.hashing import tokens_to_bytes
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis, free_port
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.router.replicas import ReplicaSync
from kvswitch.router.router import Router
from kvswitch.router.server import RouterConfig, start_router
from kvswitch.router.workers import WorkerDirectory, WorkerHandle
from kvswitch.security import INDEX_PASSWORD_ENV
from kvswitch.serving import start_server_process
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvswitch.worker.publisher import EventPublisher
from tests.deploy.netns import hosts_or_skip
from tests.router.harness import wait_until

NAMESPACE = "replica-stub"
BLOCK_SIZE = 16
NUM_WORKERS = 4
DOCUMENT = [(7 * i) % 250 + 1 for i in range(1024)]  # 64 blocks
MAX_TOKENS = 64


@dataclass
class StubFleet:
    """Stub workers on an event loop of their own: each request's first token at once, its
    end when ``release`` is called."""

    index_url: str
    host: str = "127.0.0.1"  # where the stubs listen
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
                yield worker_pb2.WorkerGenerateResponse(chunk=common_pb2.TokenChunk(token_ids=[1]))
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
            address = f"{self.host}:{server.add_insecure_port(f'{self.host}:0')}"
            await server.start()
            index = await connect_index(self.index_url)
            info = WorkerInfo(f"stub-{k}", address, NAMESPACE, BLOCK_SIZE, num_blocks=4096)
            publisher = EventPublisher(index, NoEvents(), info)
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
    metrics_hosts: list[str] | None = None  # where each serves its metrics; None: 127.0.0.1

    @classmethod
    def start(cls, index_url: str, count: int, *extra: str) -> Routers:
        processes, addresses, ports = [], [], []
        for _ in range(count):
            port = free_port()
            popen, address = start_server_process(
                ["router", "--port", "0", "--index", index_url, "--metrics-port", str(port), *extra]
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
        url = self.metrics_url(i)
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

    def metrics_url(self, i: int) -> str:
        host = self.metrics_hosts[i] if self.metrics_hosts else "127.0.0.1"
        return f"http://{host}:{self.metrics_ports[i]}/metrics"

    def counter(self, i: int, name: str) -> float:
        """The sum of router ``i``'s samples of ``name``."""
        url = self.metrics_url(i)
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def agree(self, sent: dict[str, int]) -> bool:
        """Every router counts ``sent`` in flight per worker, with the same outstanding tokens."""
        views = [self.loads(i) for i in range(len(self.metrics_ports))]
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


class Burst:
    """Questions on one document, each held open once routed; the routers must agree on the
    load after each before the next is sent."""

    def __init__(self, stubs: StubFleet, routers: Routers, salt: str) -> None:
        self.stubs, self.routers, self.salt = stubs, routers, salt
        self.sent: dict[str, int] = {}  # requests held per worker
        self.workers: list[str] = []  # where each went
        self._channels: list[grpc.Channel] = []
        self._calls: list[Any] = []
        wait_until(lambda: routers.agree({}), "the routers to see every stub")

    def send(self, address: str, i: int) -> str:
        """Question ``i`` to the router at ``address`` on a connection of its own; its worker."""
        question = [251, 252, i % 250 + 1, 253]
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids_u32le=tokens_to_bytes(DOCUMENT + question)),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
            cache_salt=self.salt,
        )
        first = len(self.stubs.received)
        # NOTE: a subchannel pool of its own, else gRPC reuses one connection for every channel.
        channel = grpc.insecure_channel(address, [("grpc.use_local_subchannel_pool", 1)])
        self._channels.append(channel)
        call = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120)
        assert next(call).HasField("chunk")  # routed, and its prompt "prefilled"
        self._calls.append(call)
        worker_id = self.stubs.received[first]
        self.workers.append(worker_id)
        self.sent[worker_id] = self.sent.get(worker_id, 0) + 1
        wait_until(lambda: self.routers.agree(self.sent), f"the routers to agree after {i}")
        return worker_id

    def end(self) -> None:
        self.stubs.release()
        for call in self._calls:
            assert list(call)[-1].HasField("final")
        for channel in self._channels:
            channel.close()
        wait_until(lambda: self.routers.agree({}), "the routers to see the burst end")


def route_burst(stubs: StubFleet, routers: Routers, salt: str, num_requests: int = 16) -> list[str]:
    """Question i to router i mod N; the worker each went to."""
    burst = Burst(stubs, routers, salt)
    try:
        for i in range(num_requests):
            burst.send(routers.addresses[i % len(routers.addresses)], i)
    finally:
        burst.end()
    return burst.workers


@pytest.fixture(scope="module")
def one_router_spread(stubs: StubFleet, redis_url: str) -> list[str]:
    routers = Routers.start(redis_url, 1)
    try:
        spread = route_burst(stubs, routers, salt="burst-1")
    finally:
        routers.stop()
    # The burst is kept together while its holder is not too loaded, then spread: both the
    # guesses and the in-flight counts matter.
    assert spread[:4] == [spread[0]] * 4, spread
    assert len(set(spread)) > 1, spread
    return spread


@pytest.mark.parametrize("count", [2, 4])
def test_routers_spread_a_burst_as_one_router_does(
    stubs: StubFleet, redis_url: str, one_router_spread: list[str], count: int
) -> None:
    routers = Routers.start(redis_url, count)
    try:
        assert route_burst(stubs, routers, salt=f"burst-{count}") == one_router_spread
    finally:
        routers.stop()


def test_a_restarted_router_takes_the_guesses_of_one_that_runs(
    stubs: StubFleet, redis_url: str, one_router_spread: list[str]
) -> None:
    """A router killed and started again learns, from the one that ran on, where the document
    is being prefilled: its first request goes there, as one router's would."""
    routers = Routers.start(redis_url, 2)
    burst = Burst(stubs, routers, salt="restart")
    try:
        holder = burst.send(routers.addresses[0], 0)
        routers.processes[1].kill()
        routers.processes[1].wait(30)
        port = free_port()
        routers.processes[1], routers.addresses[1] = start_server_process(
            ["router", "--port", "0", "--index", redis_url, "--metrics-port", str(port)]
        )
        routers.metrics_ports[1] = port
        wait_until(
            lambda: routers.counter(1, "kvswitch_router_replica_guesses_taken_total") >= 1,
            "the new router to take the running one's guesses",
        )
        assert burst.send(routers.addresses[1], 1) == holder == one_router_spread[1]
    finally:
        burst.end()
        routers.stop()


def test_router_processes_share_one_port_and_route_as_one(
    stubs: StubFleet, redis_url: str, one_router_spread: list[str]
) -> None:
    port, metrics_port = free_port(), _free_port_pair()
    args = ["--processes", "2", "--port", str(port), "--metrics-port", str(metrics_port)]
    popen, address = start_server_process(["router", "--index", redis_url, *args])
    routers = Routers([popen], [address], [metrics_port, metrics_port + 1])
    try:
        # Each request on a connection of its own: the kernel spreads them over the processes.
        assert route_burst(stubs, routers, salt="processes") == one_router_spread
        routed = [routers.counter(i, "kvswitch_router_routing_decisions_total") for i in range(2)]
        assert min(routed) > 0, routed
        # A process that dies is started again, and serves on.
        children = _children(popen.pid)
        assert len(children) == 2, children
        os.kill(children[0], signal.SIGKILL)
        wait_until(
            lambda: len(_children(popen.pid)) == 2 and children[0] not in _children(popen.pid),
            "the dead process to be started again",
        )
        wait_until(
            lambda: _serves_metrics(metrics_port) and _serves_metrics(metrics_port + 1),
            "both processes to serve again",
        )
        assert (
            route_burst(stubs, routers, salt="processes-again", num_requests=4)
            == (one_router_spread[:4])
        )
    finally:
        popen.terminate()
        assert popen.wait(60) == 0
    assert all(not Path(f"/proc/{pid}").exists() for pid in children)


def test_routers_on_hosts_of_their_own_spread_a_burst_as_one_router_does(
    redis_url: str, one_router_spread: list[str]
) -> None:
    """Four routers, each on a host (a network namespace) of its own, Redis on another, the
    stub workers on this process's own address on their network: the burst goes where one
    router sends it."""
    hosts = hosts_or_skip()
    processes: list[Any] = []
    try:
        redis_host = hosts.add("redis", 2)
        here = hosts.attach_here(99)
        processes.append(
            hosts.popen(
                "redis", "redis-server", "--bind", redis_host, "--port", "6379", "--save", "",
                "--appendonly", "no", "--protected-mode", "no",
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        index = f"redis://{redis_host}:6379"
        wait_until(lambda: _redis_answers(redis_host), "redis-server on its host")
        fleet = StubFleet(index, host=here)
        fleet.start()
        addresses, router_hosts = [], []
        for k in range(4):
            router_host = hosts.add(f"r{k}", 11 + k)
            args = ["--host", router_host, "--port", "50051", "--metrics-port", "9100"]
            popen, address = start_server_process(
                ["router", *args, "--index", index, "--insecure"], prefix=hosts.prefix_for(f"r{k}")
            )
            processes.append(popen)
            addresses.append(address)
            router_hosts.append(router_host)
        routers = Routers([], addresses, [9100] * 4, router_hosts)
        try:
            assert route_burst(fleet, routers, salt="hosts") == one_router_spread
        finally:
            fleet.stop()
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait(30)
        hosts.close()


def _redis_answers(host: str) -> bool:
    try:
        with socket.create_connection((host, 6379), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _free_port_pair() -> int:
    """A port that is free with the next one."""
    for _ in range(100):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free ports in a row")


def _children(pid: int) -> list[int]:
    """The router processes ``pid`` started (not multiprocessing's resource tracker)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(c) for c in path.read_text().split()] if path.exists() else []
    return [c for c in children if b"spawn_main" in _cmdline(c)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _serves_metrics(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
            return True
    except OSError:
        return False


# -- the channel's messages, applied in this process (no Redis) ----------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _replica(clock: _Clock | None = None) -> ReplicaSync:
    """A router with its side of the channel; its messages taken by hand, never published."""
    index = MemoryIndex()
    router = Router(index, WorkerDirectory(index), None)
    sync = ReplicaSync(None, "test:routers", router, clock=clock or _Clock())  # type: ignore[arg-type]
    router.replicas = sync
    router.directory.on_load = sync.load_changed
    return sync


def _send(sender: ReplicaSync, *receivers: ReplicaSync) -> None:
    message = sender.take_message()
    assert message is not None
    for receiver in receivers:
        receiver.apply(message)


def _peer_load(sync: ReplicaSync, worker_id: str) -> tuple[int, int, int]:
    load = sync._router.directory.peer_load(worker_id)
    return load.num_requests, load.num_prefill_tokens, load.num_output_tokens


CHAIN = [bytes([i]) * 16 for i in range(1, 5)]


def test_a_request_in_flight_counts_on_the_other_routers_until_it_ends() -> None:
    a, b = _replica(), _replica()
    handle = WorkerHandle(WorkerInfo("w0", "x:1", "ns", 16), None, None)
    flight = a._router.directory.begin(handle, 100, 64)
    _send(a, b)
    assert _peer_load(b, "w0") == (1, 100, 64)
    a._router.directory.produced(flight, 5)
    assert a.take_message() is None  # output tokens wait for the next item or "load"
    a._router.directory.first_token(flight)
    _send(a, b)
    assert _peer_load(b, "w0") == (1, 0, 59)
    a._router.directory.finish(flight)
    _send(a, b)
    assert _peer_load(b, "w0") == (0, 0, 0)
    assert _peer_load(a, "w0") == (0, 0, 0)  # its own requests are not its peers'


def test_a_load_replaces_what_a_lost_message_left_behind() -> None:
    a, b = _replica(), _replica()
    a.load_changed("w0", 1, 10, 20, True)
    _send(a, b)
    a.load_changed("w0", -1, -10, -20, True)
    a.take_message()  # lost on the way
    a.load_changed("w1", 1, 0, 8, True)
    a.load_changed("w1", 0, 0, -3, False)
    a.heartbeat()
    _send(a, b)
    assert (_peer_load(b, "w0"), _peer_load(b, "w1")) == ((0, 0, 0), (1, 0, 5))
    a.load_changed("w1", 0, 0, -5, False)  # the rest of its output, as it ends
    a.load_changed("w1", -1, 0, 0, True)  # the 3 tokens were in the load: not taken twice
    _send(a, b)
    assert _peer_load(b, "w1") == (0, 0, 0)


def test_a_router_that_leaves_or_goes_quiet_is_no_longer_counted() -> None:
    clock = _Clock()
    a, b, c = _replica(), _replica(clock), _replica()
    a.load_changed("w0", 2, 0, 10, True)
    c.load_changed("w0", 1, 0, 5, True)
    _send(a, b)
    _send(c, b)
    assert _peer_load(b, "w0") == (3, 0, 15) and b.num_peers == 2
    c._queue({"k": "bye"})
    _send(c, b)
    assert _peer_load(b, "w0") == (2, 0, 10) and b.num_peers == 1
    clock.now_s = b.config.peer_timeout_s + 0.01  # a: not heard from since
    b.expire_peers()
    assert _peer_load(b, "w0") == (0, 0, 0) and b.num_peers == 0


def test_routes_share_guesses_heat_and_the_tie_rotation() -> None:
    a, b = _replica(), _replica()
    a.routed("w1", CHAIN, guessed=True)
    a.routed("w2", CHAIN[:2], guessed=False)  # its prefix on its way from a peer: no guess
    _send(a, b)
    assert b._router.pending.match(CHAIN, {}) == {"w1": 4}
    assert b._router.num_routed == 2
    assert len(b._router.heat) > 0
    a.withdrawn("w1", CHAIN)
    _send(a, b)
    assert b._router.pending.match(CHAIN, {}) == {}


def test_a_guess_the_index_confirms_on_one_router_goes_on_the_others() -> None:
    a, b = _replica(), _replica()
    a._router.pending.on_confirm = a.confirmed
    a.routed("w1", CHAIN, guessed=True)
    a._router.pending.add("w1", CHAIN)
    _send(a, b)
    assert a._router.pending.match(CHAIN, {"w1": 4}) == {"w1": 4}  # the index lists it now
    _send(a, b)
    # Evicted since: b no longer counts the blocks as about to be there, as a would not.
    assert b._router.pending.match(CHAIN, {}) == {} == a._router.pending.match(CHAIN, {})


def test_a_starting_router_takes_the_guesses_of_one_that_runs() -> None:
    a, c = _replica(), _replica()
    a._router.pending.add("w3", CHAIN)
    new = _replica()
    new.hello()
    _send(new, a, c)
    _send(a, new, c)
    assert new._router.pending.match(CHAIN, {}) == {"w3": 4}
    assert c._router.pending.match(CHAIN, {}) == {}  # the answer was not for it
    assert all(ttl_s <= a._router.pending.ttl_s for _, _, ttl_s in new._router.pending.live())


def test_messages_of_another_version_or_kind_or_from_itself() -> None:
    a, b = _replica(), _replica()
    b.apply(msgpack.packb({"v": 2, "router": "later", "items": [{"k": "bye"}]}))
    assert b.num_peers == 0  # a later version is ignored whole
    b.apply(msgpack.packb({"router": "x", "items": [{"k": "shrug", "what": 1}]}))
    assert b.num_peers == 1  # an unknown kind is skipped; the sender is heard
    a.load_changed("w0", 1, 0, 0, True)
    message = a.take_message()
    assert message is not None
    a.apply(message)
    assert _peer_load(a, "w0") == (0, 0, 0)  # its own message came back
    with pytest.raises(ValueError):
        b.apply(b"\xc1 not msgpack")


def test_the_channel_takes_the_index_password_and_a_user_without_it_routes_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two routers on a Redis with a password, given as the index takes it (in the
    environment): they hear each other. A router whose ACL user may use the index's keys but no
    channel starts and routes alone, saying so."""
    with LocalRedis(password="s3cret") as server:
        with redis.Redis(port=server.port, password="s3cret") as admin:
            rules = ("on", ">acl-pass", "resetkeys", "~kvswitch:*", "resetchannels", "+@all")
            admin.execute_command("ACL", "SETUSER", "keys-only", *rules)
        monkeypatch.setenv(INDEX_PASSWORD_ENV, "s3cret")
        config = RouterConfig(port=0, index=f"redis://127.0.0.1:{server.port}", grace_s=0)
        acl = dataclasses.replace(
            config, index=f"redis://keys-only:acl-pass@127.0.0.1:{server.port}"
        )

        async def main() -> None:
            first, second = await start_router(config), await start_router(config)
            try:
                assert first.router.replicas is not None and second.router.replicas is not None
                deadline = asyncio.get_running_loop().time() + 30
                while first.router.replicas.num_peers < 1:
                    assert asyncio.get_running_loop().time() < deadline, "never heard"
                    await asyncio.sleep(0.05)
                alone = await start_router(acl)
                assert alone.router.replicas is None and not alone.router.shared_rotation
                await alone.stop(0)
            finally:
                await first.stop(0)
                await second.stop(0)

        with caplog.at_level(logging.WARNING, logger="kvswitch.router.server"):
            asyncio.run(main())
    assert "routing alone" in caplog.text and "&kvswitch:routers" in caplog.text


def test_the_documented_acl_user_runs_routers_that_hear_each_other() -> None:
    """docs/SECURITY.md's Redis user for the index, as written there: two routers under it
    register nothing themselves but read the index and hear each other on the channel."""
    security = Path(__file__).parents[2] / "docs" / "SECURITY.md"
    (line,) = [
        line
        for line in security.read_text().splitlines()
        if line.startswith("ACL SETUSER kvswitch")
    ]
    with LocalRedis() as server:
        with redis.Redis(port=server.port) as admin:
            admin.execute_command(*line.split())
        config = RouterConfig(
            port=0, index=f"redis://kvswitch:CHANGE-ME@127.0.0.1:{server.port}", grace_s=0
        )

        async def main() -> None:
            first, second = await start_router(config), await start_router(config)
            try:
                assert first.router.replicas is not None
                deadline = asyncio.get_running_loop().time() + 30
                while first.router.replicas.num_peers < 1:
                    assert asyncio.get_running_loop().time() < deadline, "never heard"
                    await asyncio.sleep(0.05)
                assert await first.index.live_workers() == []
            finally:
                await first.stop(0)
                await second.stop(0)

        asyncio.run(main())
