"""``kvswitch bench polls``: what following a fleet costs a router at rest, in load polls.

A router asks each worker or engine of its fleet for its load every ``load_poll_s`` (0.1 s by
default). With ``kind`` ``engines``: ``num_engines`` stub OpenAI-API engines in one process
answer ``/health`` and ``/metrics`` with a page of a vLLM server's size and names
(``benchmarks/vllm_metrics.py``) from a bare asyncio server (so that serving them costs the
stubs little), each with the ZeroMQ socket of its KV events bound, which never publishes; the
router follows them in engine mode. With ``workers``: as many gRPC stub workers (one process,
a ``grpc.aio`` server each) registered in the router's embedded index answer its ``GetLoad``.
No request is routed. Once every one has been polled, for ``duration_s``: ``router_cores``
(its CPU time, from ``/proc``, over the time), ``polls_per_s`` (polls answered) and
``cpu_us_per_poll``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvswitch.benchmarks.stub_engines import serve_grpc_stubs, silent_publishers
from kvswitch.benchmarks.timing import cpu_seconds, machine_info
from kvswitch.benchmarks.vllm_metrics import vllm_metrics_page
from kvswitch.cache_index.local_redis import free_port, free_ports
from kvswitch.serving import start_server_process

READY_TIMEOUT_S = 60.0
MODEL = "stub"
KINDS = ("engines", "workers")


@dataclass(frozen=True)
class PollsBenchConfig:
    kind: str = "engines"
    num_engines: int = 64
    load_poll_s: float = 0.1
    duration_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.num_engines < 1 or not self.load_poll_s > 0 or not self.duration_s > 0:
            raise ValueError("num_engines >= 1, load_poll_s > 0 and duration_s > 0, please")


def run(config: PollsBenchConfig) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    counts = context.Array("q", config.num_engines, lock=False)  # polls answered, per one
    fleet = _engines if config.kind == "engines" else _workers
    with fleet(config, context, counts) as router:
        print(f"  a router following {config.num_engines} {config.kind}", file=sys.stderr)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(counts):
            if router.poll() is not None:
                raise RuntimeError(f"the router exited with {router.returncode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not poll each one in {READY_TIMEOUT_S} s")
            time.sleep(0.1)
        time.sleep(1.0)  # NOTE: past its start's work (the first polls, the feeds' connections)
        polls_before, cpu_before, started = sum(counts), cpu_seconds(router.pid), time.monotonic()
        time.sleep(config.duration_s)
        elapsed_s = time.monotonic() - started
        cpu_s = cpu_seconds(router.pid) - cpu_before
        num_polls = sum(counts) - polls_before
    figures = {
        "router_cores": cpu_s / elapsed_s,
        "polls_per_s": num_polls / elapsed_s,
        "polls_per_s_asked": config.num_engines / config.load_poll_s,
        "cpu_us_per_poll": cpu_s / max(num_polls, 1) * 1e6,
    }
    if config.kind == "engines":
        figures["metrics_page_bytes"] = len(_page())
    return {"config": asdict(config), "machine": machine_info(), **figures}


@contextlib.contextmanager
def _engines(config: PollsBenchConfig, context: Any, counts: Any) -> Iterator[subprocess.Popen]:
    """A router in engine mode following stub engines that count their ``/metrics`` pages."""
    ports = free_ports(2 * config.num_engines)
    ports, event_ports = ports[: config.num_engines], ports[config.num_engines :]
    ready = context.Queue()
    stubs = context.Process(
        target=serve_pages, args=(ports, event_ports, counts, ready), daemon=True
    )
    stubs.start()
    try:
        if not ready.get(timeout=READY_TIMEOUT_S):
            raise RuntimeError("the stub engines did not start")
        engines: list[str] = []
        for k, (port, event_port) in enumerate(zip(ports, event_ports, strict=True)):
            engines += ["--engine", f"e{k}=http://127.0.0.1:{port}"]
            engines += ["--engine-events", f"e{k}=tcp://127.0.0.1:{event_port}"]
        command = [sys.executable, "-m", "kvswitch.app.cli", "router", "--port", "0"]
        command += ["--http-port", str(free_port()), "--namespace", MODEL]
        command += ["--load-poll-s", str(config.load_poll_s), *engines]
        router = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield router
        finally:
            router.terminate()
            router.wait(30)
    finally:
        stubs.kill()


@contextlib.contextmanager
def _workers(config: PollsBenchConfig, context: Any, counts: Any) -> Iterator[subprocess.Popen]:
    """A router with its embedded index and gRPC stub workers registered there, counting
    their ``GetLoad`` calls."""
    router, address = start_server_process(
        ["router", "--port", "0", "--load-poll-s", str(config.load_poll_s)]
    )
    addresses = context.Queue()
    stubs = context.Process(
        target=serve_grpc_stubs,
        args=(config.num_engines, f"grpc://{address}", addresses, counts),
        daemon=True,
    )
    stubs.start()
    try:
        for _ in range(config.num_engines):
            addresses.get(timeout=READY_TIMEOUT_S)
        yield router
    finally:
        stubs.kill()
        router.terminate()
        router.wait(30)


def _page() -> bytes:
    return vllm_metrics_page(MODEL).encode()


def serve_pages(ports: list[int], event_ports: list[int], counts: Any, ready: Any) -> None:
    """Engines on ``ports`` answering ``/metrics`` (counted in ``counts``) and anything else
    (``/health``) with 200, their event sockets bound on ``event_ports``; until killed."""
    publishers = silent_publishers(event_ports)
    page = _page()
    metrics = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (
        len(page),
        page,
    )
    health = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

    class Engine(asyncio.Protocol):
        def __init__(self, k: int) -> None:
            self.k = k
            self.buffer = b""

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
                if head.startswith(b"GET /metrics "):
                    counts[self.k] += 1
                    self.transport.write(metrics)
                else:
                    self.transport.write(health)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for k, port in enumerate(ports):
            await loop.create_server(lambda k=k: Engine(k), "127.0.0.1", port)
        ready.put(True)
        await asyncio.Event().wait()

    try:
        asyncio.run(main())
    finally:
        for socket in publishers:
            socket.close(linger=0)
