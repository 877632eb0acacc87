"""The router's HTTP/1.1 client for OpenAI-API engines: keep-alive connections to each engine,
requests written and answers parsed (``httptools``, the parser uvicorn serves with) on asyncio
protocols.

Every request routed to an engine passes through here, so it is the data plane's client, kept
lean: with httpx in its place the router spent 18.2 us of CPU a relayed token and added 1.16 ms
to a completion, with this 3.4 us and 0.56 ms (``kvswitch bench routers``, docs/BENCHMARKS.md
"The router's data plane, lean"). The engines' load polls (``router/engines.py``) go through it
too: over httpx, a router following 64 engines (a poll of each every 0.1 s) spent its whole core
on them (docs/BENCHMARKS.md, "Polling engines").

    post(url, path, body)    -> EngineResponse once the answer's head has come
    get(url, path)           -> the same, of a GET
        a pooled connection (idle under KEEP_ALIVE_S), else a new one
        cannot connect       -> EngineConnectError (nothing reached the engine)
        a pooled connection closed before any answer (the engine closed it idle, or died)
                             -> once more on a new connection
        lost mid-answer      -> EngineConnectionLost
    EngineResponse.read() / chunks()  the body whole / as it arrives
    EngineResponse.close()   the connection back to the pool if the answer was read whole and
                             the engine keeps it open, else closed
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

from kvswitch.security import PLAINTEXT, FleetSecurity

KEEP_ALIVE_S = 4.0  # NOTE: under uvicorn's (vLLM's server) 5 s, after which the engine closes it
MAX_IDLE_PER_ENGINE = 256
HIGH_WATER_BYTES = 256 << 10  # an answer buffered past this stops reading until it is read


class EngineConnectError(ConnectionError):
    """The engine could not be reached (refused, unreachable, timed out, TLS refused): nothing
    was sent to it."""


class EngineConnectionLost(ConnectionError):
    """The engine's connection closed, or sent what is not HTTP, before its answer ended."""


class _Origin:
    """Where an engine is: its host, port and TLS, and the ``host`` header it is sent."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an engine's URL is http:// or https://, not {url!r}")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.key = (self.host, self.port, self.tls)
        self.host_header = parts.netloc.rpartition("@")[2].encode()


class _Connection(asyncio.Protocol):
    """One connection to an engine and the answer being read on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._num_buffered = 0
        self._paused = False
        self._complete = False
        self._keep_alive = False
        self.received = False  # any byte of the answer
        self._error: Exception | None = None

    # -- a request ------------------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[None]:
        """Write ``request``; the future is done once its answer's head has been read."""
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._head = asyncio.get_running_loop().create_future()
        self.status = 0
        self.headers = {}
        self._body.clear()
        self._num_buffered = 0
        self._complete = self._keep_alive = self.received = False
        self._error = None
        self.transport.write(request)
        return self._head

    async def next_body(self) -> bytes | None:
        """The body's bytes that arrived since the last call (waiting for some); None at its
        end; EngineConnectionLost where the connection went first."""
        while True:
            if self._body:
                data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                self._num_buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self._complete:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._parser is None:  # NOTE: bytes from an idle connection: it cannot be reused
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(EngineConnectionLost("the engine switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(EngineConnectionLost(f"the engine's answer is not HTTP: {e}"))

    def eof_received(self) -> bool | None:
        return None  # closed, and connection_lost says so

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._complete:
            why = f": {exc}" if exc else ""
            self._fail(EngineConnectionLost(f"the engine closed the connection{why}"))

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.status = self._parser.get_status_code()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._num_buffered += len(body)
        if self._num_buffered > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()
        self._parser = None
        self._wake()

    def _fail(self, error: Exception) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # NOTE: retrieved here: a request already cancelled is fine
        self._wake()
        self.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class EngineResponse:
    """An engine's answer, its head read: ``status``, ``headers`` (names in lower case), then
    its body by ``read`` or ``chunks``; ``close`` it."""

    def __init__(self, client: EngineHTTP, origin: _Origin, connection: _Connection) -> None:
        self._client = client
        self._origin = origin
        self._connection: _Connection | None = connection
        self.status = connection.status
        self.headers = connection.headers

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: what came together, in one piece."""
        connection = self._connection
        if connection is None:
            raise RuntimeError("the answer was closed")
        while (data := await connection.next_body()) is not None:
            yield data

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._client._release(self._origin, connection)


class EngineHTTP:
    """Keep-alive connections to engines: ``post`` or ``get``, ``close`` them all at the end.
    ``api_key``: sent to every engine (vLLM's ``--api-key``); ``https://`` engines are
    verified with the fleet's CA (``--tls-ca``; the system's roots without one)."""

    def __init__(
        self,
        security: FleetSecurity = PLAINTEXT,
        api_key: str = "",
        *,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._ssl = ssl.create_default_context(cafile=security.tls_ca or None)
        self._auth = f"authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self._origins: dict[str, _Origin] = {}
        self._idle: defaultdict[tuple[str, int, bool], list[_Connection]] = defaultdict(list)
        self._open: set[_Connection] = set()

    async def post(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> EngineResponse:
        """POST ``body`` to ``path`` of the engine at ``url``; its answer once its head came."""
        origin = self._origin(url)
        head = [f"POST {origin.prefix}{path} HTTP/1.1\r\n".encode(), b"host: ", origin.host_header]
        head.append(b"\r\ncontent-length: %d\r\n" % len(body))
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head += [self._auth, b"\r\n", body]
        return await self._send(origin, b"".join(head))

    async def get(self, url: str, path: str) -> EngineResponse:
        """GET ``path`` of the engine at ``url`` (its ``/health``, its ``/metrics``)."""
        origin = self._origin(url)
        head = [f"GET {origin.prefix}{path} HTTP/1.1\r\n".encode(), b"host: ", origin.host_header]
        return await self._send(origin, b"".join([*head, b"\r\n", self._auth, b"\r\n"]))

    def _origin(self, url: str) -> _Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(url)
        return origin

    async def _send(self, origin: _Origin, request: bytes) -> EngineResponse:
        while True:
            connection = self._pooled(origin)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin)
            try:
                await connection.send(request)
            except BaseException as e:
                connection.close()
                self._open.discard(connection)
                if isinstance(e, EngineConnectionLost) and reused and not connection.received:
                    continue  # NOTE: closed while idle, or by an engine gone: a new connection
                raise
            return EngineResponse(self, origin, connection)

    async def close(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()

    def _pooled(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin.key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEP_ALIVE_S:
                return connection
            connection.close()
            self._open.discard(connection)
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    _Connection,
                    origin.host,
                    origin.port,
                    ssl=self._ssl if origin.tls else None,
                )
        except (OSError, ssl.SSLError, TimeoutError) as e:
            raise EngineConnectError(
                f"{origin.host}:{origin.port}: {e or type(e).__name__}"
            ) from None
        self._open.add(connection)
        return connection

    def _release(self, origin: _Origin, connection: _Connection) -> None:
        idle = self._idle[origin.key]
        if connection.reusable() and len(idle) < MAX_IDLE_PER_ENGINE:
            connection.idle_since = time.monotonic()
            idle.append(connection)
            return
        connection.close()
        self._open.discard(connection)
