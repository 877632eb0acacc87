"""The router's HTTP client for engines (``router/engine_http.py``) against real sockets: a
scripted HTTP/1.1 server on loopback that answers, streams, cuts, refuses and counts the
connections it is given."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kvswitch.benchmarks.vllm_metrics import vllm_metrics_page
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.local_redis import free_port
from kvswitch.router import engine_http
from kvswitch.router.engine_http import EngineConnectError, EngineConnectionLost, EngineHTTP
from kvswitch.router.engines import poll_engine
from kvswitch.security import FleetSecurity
from tests.certs import TestCA


class Engine:
    """Answers each request by ``answer(writer, n, body)`` (n counting the requests), on
    connections it counts."""

    def __init__(self, answer: Callable) -> None:
        self.answer = answer
        self.num_connections = 0
        self.num_requests = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,  # a GET's
                )
                body = await reader.readexactly(length)
                self.num_requests += 1
                self.heads.append(head)
                self.bodies.append(body)
                if await self.answer(writer, self.num_requests, body) is False:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@contextlib.asynccontextmanager
async def engine(answer: Callable, tls: ssl.SSLContext | None = None) -> AsyncIterator[Engine]:
    served = Engine(answer)
    server = await asyncio.start_server(served.serve, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls else "http"
    served.url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield served
    finally:
        server.close()


def whole(text: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(text),
        text,
    )


async def answer_whole(writer: asyncio.StreamWriter, n: int, body: bytes) -> None:
    writer.write(whole(b'{"n": %d, "echo": %s}' % (n, body)))


async def post(client: EngineHTTP, url: str, n: int = 0) -> bytes:
    response = await client.post(url, "/v1/completions", json.dumps({"n": n}).encode(), {})
    try:
        return await response.read()
    finally:
        response.close()


def test_answers_come_whole_and_streamed_on_one_kept_connection() -> None:
    async def stream(writer: asyncio.StreamWriter, n: int, body: bytes) -> None:
        if n != 2:
            return await answer_whole(writer, n, body)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for i in range(3):
            event = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")

    async def main() -> None:
        client = EngineHTTP(api_key="engine-key")
        async with engine(stream) as served:
            assert json.loads(await post(client, served.url, 7)) == {"n": 1, "echo": {"n": 7}}
            response = await client.post(served.url, "/v1/completions", b"{}", {"accept": "x/y"})
            assert (response.status, response.headers["content-type"]) == (200, "text/event-stream")
            received = b"".join([chunk async for chunk in response.chunks()])
            response.close()
            assert received == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"  # de-chunked
            assert json.loads(await post(client, served.url))["n"] == 3
            assert served.num_connections == 1
            head = served.heads[1].decode().lower()
            assert "authorization: bearer engine-key\r\n" in head and "accept: x/y\r\n" in head
            assert head.startswith("post /v1/completions http/1.1\r\nhost: 127.0.0.1:")
        await client.close()

    asyncio.run(main())


def test_gets_and_posts_share_the_kept_connection_and_carry_the_key() -> None:
    async def main() -> None:
        client = EngineHTTP(api_key="engine-key")
        async with engine(answer_whole) as served:
            for n in (1, 2):
                response = await client.get(f"{served.url}/prefix/", "/metrics")
                assert (response.status, await response.read()) == (200, b'{"n": %d, "echo": }' % n)
                response.close()
            assert json.loads(await post(client, served.url))["n"] == 3
            assert (served.num_connections, served.bodies[:2]) == (1, [b"", b""])
            head = served.heads[0].decode().lower()
            assert head.startswith("get /prefix/metrics http/1.1\r\nhost: 127.0.0.1:"), head
            assert "authorization: bearer engine-key\r\n" in head and head.endswith("\r\n\r\n")
        await client.close()

    asyncio.run(main())


def test_an_https_engine_is_polled_and_verified_with_the_fleets_ca(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    served_identity = ca.issue("engine")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(served_identity.cert, served_identity.key)
    page = vllm_metrics_page("m", num_running=2, num_waiting=1, num_blocks=512).encode()

    async def answer(writer: asyncio.StreamWriter, n: int, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page))

    async def main() -> None:
        router_identity = ca.issue("router")
        security = FleetSecurity(router_identity.cert, router_identity.key, ca.cert)
        client = EngineHTTP(security)
        async with engine(answer, tls) as served:
            info = WorkerInfo("e0", served.url, "m", 16)
            load = await poll_engine(client, info, timeout_s=10)
            assert (load.num_running_requests, load.num_waiting_requests) == (2, 1)
            assert load.num_total_blocks == 512
            with pytest.raises(EngineConnectError):  # the system's roots do not know the CA
                await EngineHTTP().get(served.url, "/health")
        await client.close()

    asyncio.run(main())


def test_a_kept_connection_closed_unanswered_is_tried_once_more_on_a_new_one() -> None:
    """The engine takes the second request on the kept connection and closes it unanswered
    (an engine closing it idle, or gone): the request goes again on a new connection."""

    async def close_the_second(writer: asyncio.StreamWriter, n: int, body: bytes) -> bool:
        if n == 2:
            return False
        await answer_whole(writer, n, body)
        return True

    async def main() -> None:
        client = EngineHTTP()
        async with engine(close_the_second) as served:
            assert json.loads(await post(client, served.url))["n"] == 1
            assert json.loads(await post(client, served.url))["n"] == 3
            assert (served.num_connections, served.num_requests) == (2, 3)
        await client.close()

    asyncio.run(main())


def test_an_answer_cut_short_is_an_error_and_its_connection_is_not_kept() -> None:
    async def cut(writer: asyncio.StreamWriter, n: int, body: bytes) -> bool:
        if n == 1:
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"partial')
            await writer.drain()
            return False
        await answer_whole(writer, n, body)
        return True

    async def main() -> None:
        client = EngineHTTP()
        async with engine(cut) as served:
            with pytest.raises(EngineConnectionLost, match="closed the connection"):
                await post(client, served.url)
            assert json.loads(await post(client, served.url))["n"] == 2
            assert served.num_connections == 2
        await client.close()

    asyncio.run(main())


def test_a_stream_left_early_closes_its_connection() -> None:
    """A client that leaves a stream midway: its connection is closed (the engine sees it go
    and stops), not handed to the next request with the rest of the stream on it."""

    async def main() -> None:
        left = asyncio.Event()

        async def endless(writer: asyncio.StreamWriter, n: int, body: bytes) -> bool:
            if n > 1:
                await answer_whole(writer, n, body)
                return True
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                while True:
                    writer.write(b"6\r\ndata: \r\n")
                    await writer.drain()
                    await asyncio.sleep(0.001)
            except ConnectionError:
                left.set()
                return False

        client = EngineHTTP()
        async with engine(endless) as served:
            response = await client.post(served.url, "/v1/completions", b"{}", {})
            async for chunk in response.chunks():
                assert chunk.startswith(b"data: ")
                break
            response.close()
            await asyncio.wait_for(left.wait(), 30)
            assert json.loads(await post(client, served.url))["n"] == 2
            assert served.num_connections == 2
        await client.close()

    asyncio.run(main())


def test_an_idle_connection_past_its_keep_alive_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_http, "KEEP_ALIVE_S", 0.0)

    async def main() -> None:
        client = EngineHTTP()
        async with engine(answer_whole) as served:
            await post(client, served.url)
            await post(client, served.url)
            assert served.num_connections == 2
        await client.close()

    asyncio.run(main())


def test_an_engine_that_refuses_is_a_connect_error() -> None:
    async def main() -> None:
        client = EngineHTTP(connect_timeout_s=5)
        with pytest.raises(EngineConnectError, match=r"127\.0\.0\.1"):
            await client.post(f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}")
        with pytest.raises(ValueError, match="http:// or https://"):
            await client.post("ftp://127.0.0.1:1", "/v1/completions", b"{}")
        await client.close()

    asyncio.run(main())


def test_a_large_answer_is_read_whole_while_the_engine_waits_on_the_reader() -> None:
    """An answer far past the read-ahead limit: reading pauses and resumes as it is taken."""
    size = 8 * engine_http.HIGH_WATER_BYTES

    async def large(writer: asyncio.StreamWriter, n: int, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    async def main() -> None:
        client = EngineHTTP()
        async with engine(large) as served:
            response = await client.post(served.url, "/v1/completions", b"{}")
            chunks = []
            async for chunk in response.chunks():
                chunks.append(chunk)
                await asyncio.sleep(0.001)  # a slow reader
            response.close()
            assert sum(map(len, chunks)) == size and len(chunks) > 1
            assert all(len(c) <= 2 * engine_http.HIGH_WATER_BYTES for c in chunks)
        await client.close()

    asyncio.run(main())
