"""``kvswitch bench hops``: the floor under a router's added latency, one process hop.

A router adds a hop to every token's way: a message read from one process and written to
another. What a hop costs here, without a router: a sender process writes a message every
``step_ms`` to each of ``num_streams`` streams, each message stamped with the machine's
monotonic clock; a reader process (its own event loop, uvloop where installed, as the router's)
notes the delay of each message it reads. Over each ``transport``:

- ``tcp``: a plain asyncio stream, 8 bytes a message: the kernel and two event loops;
- ``grpc-stream``: a ``grpc.aio`` server stream (a worker's ``Generate``, a router's);
- ``grpc-bidi``: a ``grpc.aio`` bidirectional stream (the router's calls to a worker,
  ``GenerateStream``), the request side held open.

Per transport: ``delay_us`` (p50, p99) over ``num_messages`` messages a stream, the first
``WARMUP_MESSAGES`` left out.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from kvswitch.benchmarks.stub_engines import stamp_us
from kvswitch.benchmarks.timing import machine_info, p50_p99
from kvswitch.serving import run_event_loop

TRANSPORTS = ("tcp", "grpc-stream", "grpc-bidi")
WARMUP_MESSAGES = 10
STAMP = struct.Struct("<q")
SERVICE = "kvswitch.bench.Hops"


@dataclass(frozen=True)
class HopsBenchConfig:
    transports: str = ",".join(TRANSPORTS)
    num_streams: int = 2
    num_messages: int = 300
    step_ms: float = 10.0

    def __post_init__(self) -> None:
        unknown = set(self.transport_list()) - set(TRANSPORTS)
        if unknown or not self.transport_list():
            raise ValueError(
                f"transports: some of {', '.join(TRANSPORTS)}, got {self.transports!r}"
            )
        if self.num_streams < 1 or self.num_messages <= WARMUP_MESSAGES or not self.step_ms > 0:
            raise ValueError(
                f"num_streams >= 1, num_messages > {WARMUP_MESSAGES} and step_ms > 0, please"
            )

    def transport_list(self) -> list[str]:
        return [name.strip() for name in self.transports.split(",") if name.strip()]


def run(config: HopsBenchConfig) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sender = context.Process(target=_send_forever, args=(config, ports), daemon=True)
    sender.start()
    try:
        tcp_port, grpc_port = ports.get(timeout=60)
        figures: dict[str, Any] = {}
        for transport in config.transport_list():
            print(f"  {transport} ...", file=sys.stderr)
            port = tcp_port if transport == "tcp" else grpc_port
            delays_us = _in_a_loop(_read(transport, port, config))
            figures[transport] = {"delay_us": p50_p99(delays_us)}
            print(f"    p50 {figures[transport]['delay_us']['p50']:.0f} us", file=sys.stderr)
    finally:
        sender.kill()
        sender.join()
    return {"config": asdict(config), "machine": machine_info(), **figures}


def _in_a_loop(reading: Any) -> list[float]:
    delays: list[float] = []

    async def main() -> None:
        delays.extend(await reading)

    run_event_loop(main())
    return delays


# -- the sender's process ---------------------------------------------------------------------


def _send_forever(config: HopsBenchConfig, ports: Any) -> None:
    run_event_loop(_serve(config, ports))


async def _serve(config: HopsBenchConfig, ports: Any) -> None:
    step_s = config.step_ms / 1000

    async def stamps() -> AsyncIterator[bytes]:
        for _ in range(config.num_messages):
            await asyncio.sleep(step_s)
            yield STAMP.pack(stamp_us())

    async def on_tcp(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for stamp in stamps():
            writer.write(stamp)
        await writer.drain()
        writer.close()

    async def server_stream(_: bytes, __: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for stamp in stamps():
            yield stamp

    async def bidi(_: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async for stamp in stamps():
            await context.write(stamp)

    tcp = await asyncio.start_server(on_tcp, "127.0.0.1", 0)
    server = grpc.aio.server()
    handlers = {
        "Stream": grpc.unary_stream_rpc_method_handler(server_stream, _same, _same),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, _same, _same),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ports.put((tcp.sockets[0].getsockname()[1], grpc_port))
    await server.wait_for_termination()


def _same(data: bytes) -> bytes:
    return data


# -- the reader's process -----------------------------------------------------------------------


async def _read(transport: str, port: int, config: HopsBenchConfig) -> list[float]:
    if transport == "tcp":
        streams = [_tcp_stream(port, config.num_messages) for _ in range(config.num_streams)]
        return _delays(await asyncio.gather(*streams))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        if transport == "grpc-stream":
            call = channel.unary_stream(f"/{SERVICE}/Stream", _same, _same)
            streams = [_grpc_stream(call(b"")) for _ in range(config.num_streams)]
        else:
            call = channel.stream_stream(f"/{SERVICE}/Bidi", _same, _same)
            streams = [_grpc_stream(call(_held_open())) for _ in range(config.num_streams)]
        return _delays(await asyncio.gather(*streams))


async def _tcp_stream(port: int, num_messages: int) -> list[int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    delays = []
    for _ in range(num_messages):
        stamp = await reader.readexactly(STAMP.size)
        delays.append(stamp_us() - STAMP.unpack(stamp)[0])
    writer.close()
    return delays


async def _grpc_stream(call: Any) -> list[int]:
    return [stamp_us() - STAMP.unpack(stamp)[0] async for stamp in call]


async def _held_open() -> AsyncIterator[bytes]:
    """A bidirectional call's requests: none, the side never closed (as a router's stream)."""
    await asyncio.Event().wait()
    yield b""  # NOTE: never reached; makes this an async generator


def _delays(streams: list[list[int]]) -> list[float]:
    return [float(delay) for delays in streams for delay in delays[WARMUP_MESSAGES:]]
