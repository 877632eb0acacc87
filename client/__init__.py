"""The Python client SDK for the kvswitch router (see docs/CLIENT.md).

- ``sync_client``: ``Client`` and its ``Stream`` (blocking)
- ``async_client``: ``AsyncClient`` and its ``AsyncStream`` (asyncio)
- ``request``: ``GenerateParams``, a request's arguments, checked, and its protobuf
- ``result``: ``Chunk``, ``GenerateResult``, ``Stats``, ``RouteInfo``, ``FinishReason``,
  ``TokenLogprobs``
- ``retry``: ``RetryPolicy`` (what is retried, backoff) and ``Attempts`` (deadline, count)
- ``channel``: TLS credentials and the bearer-token metadata
- ``errors``: ``KvswitchError`` and ``KvswitchTimeoutError``
"""

from kvswitch.client.async_client import AsyncClient, AsyncStream
from kvswitch.client.errors import KvswitchError, KvswitchTimeoutError
from kvswitch.client.result import (
    Chunk,
    FinishReason,
    GenerateResult,
    RouteInfo,
    Stats,
    TokenLogprobs,
)
from kvswitch.client.sync_client import Client, Stream

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "FinishReason",
    "GenerateResult",
    "KvswitchError",
    "KvswitchTimeoutError",
    "RouteInfo",
    "Stats",
    "Stream",
    "TokenLogprobs",
]
