"""The router's HTTP server: uvicorn serving the OpenAI-compatible API (``router/openai_http.py``)
as a task on the router's event loop, started and stopped with the router.

Its socket is bound before anything starts, so that a taken port fails the router's start. The
router keeps its own SIGINT / SIGTERM handling: uvicorn installs none and stops when the router
stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import socket
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import uvicorn

from kvswitch.router.lora_updates import FleetAdapters
from kvswitch.router.openai_http import FrontConfig, OpenAIFront, RouterModels
from kvswitch.router.router import Router
from kvswitch.serving import host_port

if TYPE_CHECKING:
    from kvswitch.router.engine_forward import EngineForwarder
    from kvswitch.router.local_call import LocalStub


class Closeable(Protocol):
    async def close(self) -> None: ...


logger = logging.getLogger(__name__)

_SHUTDOWN_MARGIN_S = 1.0  # for the last streams' errors to reach their clients
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: the router handles SIGINT and SIGTERM itself and stops this server with it.
        yield


@dataclasses.dataclass
class HttpFront:
    """A started HTTP API; ``stop`` it with the router."""

    address: str  # host:port as bound
    scheme: str  # http, or https where the router serves TLS
    server: uvicorn.Server
    task: asyncio.Task
    channel: Closeable  # what its requests are sent on, closed after it

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}/v1"

    async def stop(self, grace_s: float) -> None:
        """Stop taking connections; running requests have ``grace_s`` (and the router's own
        grace for their calls) to finish."""
        # NOTE: past the router's grace, which cancels the calls still running, and so ends
        # their responses: what remains then is a client that stopped reading.
        self.server.config.timeout_graceful_shutdown = math.ceil(grace_s + _SHUTDOWN_MARGIN_S)
        self.server.should_exit = True
        await self.task
        await self.channel.close()


async def start_http_front(
    config: FrontConfig,
    router: Router,
    calls: LocalStub,
    front_key: str,
    engines: EngineForwarder | None = None,
) -> HttpFront:
    """Serve the HTTP API on ``config.host``:``config.http_port`` in front of this process's
    router, called in-process (``calls``), and of its OpenAI-API ``engines`` if it has any;
    OSError if the port cannot be bound."""
    adapters = FleetAdapters(router) if config.lora_updates else None
    front = OpenAIFront(config, RouterModels(router), calls, front_key, engines, adapters)
    return await serve_http(front, config, calls)


def loopback_target(address: str) -> str:
    """host:port to call this process's own server listening on ``address`` (host:port)."""
    host, _, port = address.rpartition(":")
    return host_port("localhost" if host in _WILDCARD_HOSTS else host.strip("[]"), int(port))


async def serve_http(app: Any, config: FrontConfig, channel: Closeable) -> HttpFront:
    """Serve ``app`` (calling on ``channel``) on ``config.host``:``config.http_port``, over TLS
    where ``config.security`` says so; OSError if the port cannot be bound (``channel`` closed)."""
    try:
        sock = _bind(config.host, config.http_port, reuse_port=config.reuse_port)
    except OSError:
        await channel.close()
        raise
    security = config.security
    tls: dict[str, Any] = {}
    if security.tls:
        tls = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
        if security.tls_client_auth:
            tls.update(ssl_ca_certs=security.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    uvicorn_config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,  # the process's logging stays as kvswitch set it
        log_level="warning",
        access_log=False,  # one line a request: requests are logged at DEBUG only
        **tls,
    )
    server = _Server(uvicorn_config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            await channel.close()
            task.result()  # raises why it stopped
            raise OSError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    address = host_port(config.host, sock.getsockname()[1])
    front_server = HttpFront(address, "https" if security.tls else "http", server, task, channel)
    logger.info("OpenAI-compatible HTTP API at %s", front_server.url)
    return front_server


def _bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            # NOTE: the kernel spreads new connections over the processes bound to the port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
