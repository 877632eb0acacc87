"""How a kvswitch process secures its gRPC hops: TLS (mutual, as an option) and the fleet token.

One ``FleetSecurity`` per process, the same for every hop it serves or calls::

    client  --(router token)-->  router  --(fleet token)-->  worker  --(fleet token)-->  peer
                                   ^                           |
                                   +------(fleet token)--------+  (the embedded index)

TLS is on when a certificate is given: the process then serves TLS and calls its peers over TLS,
trusting ``tls_ca`` (the system's roots when empty). With ``tls_client_auth`` a server also asks
each caller for a certificate signed by ``tls_ca``, and the process presents its own when it
calls. The fleet token travels as ``authorization: Bearer <token>`` on every call between
routers and workers; ``kvswitch.guard.ServerGuard`` checks it.

``check_exposure`` is the one rule every server starts under: a port that other machines can reach
takes callers only with credentials (the fleet token or mutual TLS; API keys for the HTTP API),
unless the operator asked for an open one with ``--insecure``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvswitch.serving import host_port

TOKEN_ENV = "KVSWITCH_TOKEN"  # the router's client token, instead of --token
FLEET_TOKEN_ENV = "KVSWITCH_FLEET_TOKEN"  # instead of --fleet-token
API_KEYS_ENV = "KVSWITCH_API_KEYS"  # instead of --api-key: the HTTP API's keys, comma-separated
ENGINE_API_KEY_ENV = "KVSWITCH_ENGINE_API_KEY"  # instead of --engine-api-key
# The password of a Redis index whose URL carries none: a URL on a command line is for anyone on the
# host to read (ps, /proc), an environment variable only for the process's user.
INDEX_PASSWORD_ENV = "KVSWITCH_INDEX_PASSWORD"

# How a gRPC server that other machines can reach is kept from taking any caller.
FLEET_WAYS_OUT = (
    f"a fleet token (--fleet-token or {FLEET_TOKEN_ENV})",
    "mutual TLS (--tls-cert, --tls-key, --tls-ca and --tls-client-auth)",
)
# How the router's OpenAI-compatible HTTP API is.
HTTP_WAYS_OUT = (
    f"API keys (--api-key or {API_KEYS_ENV}; or the client token, --token)",
    FLEET_WAYS_OUT[1],
)


@dataclasses.dataclass(frozen=True)
class FleetSecurity:
    """TLS files (PEM paths) and the bearer token routers and workers present to each other."""

    tls_cert: str = ""  # this process's certificate chain; TLS is on when set
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # CA bundle to verify servers (and clients, with tls_client_auth)
    tls_client_auth: bool = False  # mutual TLS: callers must present a certificate
    fleet_token: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_auth and not (self.tls_cert and self.tls_ca):
            raise ValueError(
                "tls_client_auth needs tls_cert and tls_key (presented to peers) and tls_ca "
                "(to verify callers)"
            )
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca without tls_cert: give this process a certificate too")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")

    @classmethod
    def of(cls, config: object) -> FleetSecurity:
        """The security a component's config sets with fields named as this class's."""
        return cls(**{field.name: getattr(config, field.name) for field in dataclasses.fields(cls)})

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def authenticates_callers(self) -> bool:
        """Whether a server with this security takes only callers that prove they are of the
        fleet: by the fleet token, or by a certificate of its CA."""
        return bool(self.fleet_token) or self.tls_client_auth

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """What a server listens with; None for plaintext."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))],
            root_certificates=_read(self.tls_ca) if self.tls_client_auth else None,
            require_client_auth=self.tls_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """What a call to a router or worker goes over; None for plaintext."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            private_key=_read(self.tls_key) if self.tls_client_auth else None,
            certificate_chain=_read(self.tls_cert) if self.tls_client_auth else None,
        )

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on ``address``; the port bound. RuntimeError if it cannot be."""
        credentials = self.server_credentials()
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to another router or worker, its calls carrying the fleet token."""
        interceptors = bearer_token_interceptors(self.fleet_token) if self.fleet_token else None
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            target, credentials, options=options, interceptors=interceptors
        )


PLAINTEXT = FleetSecurity()


def parse_api_keys(text: str) -> tuple[str, ...]:
    """The API keys of a comma-separated list (spaces around each dropped); ValueError for a key
    an HTTP header cannot carry as ``Bearer KEY`` (not printable ASCII, or with a space)."""
    keys = tuple(key.strip() for key in text.split(",") if key.strip())
    for key in keys:
        if not (key.isascii() and key.isprintable()) or " " in key:
            raise ValueError(
                "api_key: a key must be printable ASCII without spaces (keys are comma-separated)"
            )
    return keys


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only: 127.0.0.0/8,
    ``::1`` (bracketed or not) and ``localhost``. A wildcard (``0.0.0.0``, ``::``, empty) and any
    other name are not: a name may resolve to anything."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(
    server: str, host: str, port: int, ways_out: Sequence[str], *, guarded: bool, insecure: bool
) -> None:
    """ValueError unless ``server``, to listen on ``host``:``port``, is safe to start: it listens
    on loopback only, or it is ``guarded`` (its callers must show one of ``ways_out``), or the
    operator passed ``insecure``. The message names the address and every way out."""
    if guarded or insecure or is_loopback(host):
        return
    ways = " or ".join(ways_out)
    raise ValueError(
        f"{server} would listen on {host_port(host, port)}, which other machines can reach, and "
        f"take any caller there: give it {ways}; or listen on 127.0.0.1 only; or pass "
        "--insecure to serve it open anyway"
    )


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def bearer_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``authorization: Bearer <token>`` to every call of a channel.

    NOTE: one object per kind of call: a channel files each interceptor under the first kind
    it is an instance of, so one object implementing all four would only see unary calls."""
    header = ("authorization", f"Bearer {token}")
    return [kind(header) for kind in _TOKEN_INTERCEPTORS]


class _WithHeader:
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return details._replace(metadata=metadata)


class _UnaryUnary(_WithHeader, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_WithHeader, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_WithHeader, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_WithHeader, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


_TOKEN_INTERCEPTORS = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
