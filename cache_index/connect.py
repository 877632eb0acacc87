"""Open a block index from a URL: the one place that knows which backend a URL names.

memory://                         the embedded index (this process only)
redis://[user:password@]host:port/db, rediss://...        one Redis (rediss: TLS)
redis+cluster://host:port, rediss+cluster://host:port     a Redis Cluster (any node)
grpc://host:port                  the embedded index of a router, served over gRPC

A Redis URL without a password takes the one in ``KVSWITCH_INDEX_PASSWORD``, if set: the safe way
to hand it to a server, whose command line anyone on the host can read.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from kvswitch.cache_index.index import BlockIndex
from kvswitch.security import INDEX_PASSWORD_ENV, PLAINTEXT, FleetSecurity

DEFAULT_PREFIX = "kvswitch"
SCHEMES = "memory://, redis://, rediss://, redis+cluster://, rediss+cluster:// or grpc://"


class IndexUnreachable(ConnectionError):
    """No block index answers at the URL (refused, timed out, a cluster with no reachable node)."""


async def connect_index(
    url: str, *, prefix: str = DEFAULT_PREFIX, security: FleetSecurity = PLAINTEXT
) -> BlockIndex:
    """The index ``url`` names, connected; ValueError for a URL that names none,
    ``IndexUnreachable`` (a ConnectionError) when it does not answer. ``security``: how a
    ``grpc://`` index (a router's) is reached."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"index URL {url!r} has no scheme: use {SCHEMES}")
    if scheme == "memory":
        from kvswitch.cache_index.memory_index import MemoryIndex

        return MemoryIndex()
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        from kvswitch.cache_index.redis_index import RedisIndex

        base_scheme, _, cluster = scheme.partition("+")
        password = None
        if urlsplit(url).password is None:
            password = os.environ.get(INDEX_PASSWORD_ENV) or None
        try:
            return await RedisIndex.connect(
                f"{base_scheme}://{rest}", prefix=prefix, cluster=bool(cluster), password=password
            )
        except RedisIndex.unavailable_errors as e:
            raise IndexUnreachable(f"cannot use the Redis at {redacted(url)}: {e}") from e
        except ValueError as e:  # redis-py's own reading of the URL: a port that is no number
            raise ValueError(f"index URL {redacted(url)}: {e}") from e
    if scheme == "grpc":
        from kvswitch.cache_index.grpc_index import GrpcIndex

        if not rest:
            raise ValueError(f"index URL {url!r} names no server: use grpc://host:port")
        try:
            return await GrpcIndex.connect(rest, security=security)
        except GrpcIndex.unavailable_errors as e:
            raise IndexUnreachable(str(e)) from e
    raise ValueError(f"unknown index URL scheme {scheme!r}: use {SCHEMES}")


def pubsub_client(url: str) -> Any:
    """A ``redis.asyncio.Redis`` (one that keeps cancels: ``redis_clients``) to the server a
    Redis index URL names (for a cluster, the node it names: every node relays pub/sub), with the
    password as ``connect_index`` takes it (the URL's, else ``KVSWITCH_INDEX_PASSWORD``).
    ValueError for a URL that is not a Redis's."""
    from kvswitch.cache_index.redis_clients import CancelSafeRedis

    scheme, _, rest = url.partition("://")
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise ValueError(f"{redacted(url)} is not a Redis URL")
    options: dict[str, Any] = {}
    if urlsplit(url).password is None and os.environ.get(INDEX_PASSWORD_ENV):
        options["password"] = os.environ[INDEX_PASSWORD_ENV]
    return CancelSafeRedis.from_url(f"{scheme.partition('+')[0]}://{rest}", **options)


def redacted(url: str) -> str:
    """``url`` with its password, if any, as ``***``: fit for a log line or an error."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password, and the password (None, and ``url`` as it is, if it has
    none): a server started with the first and the second in ``KVSWITCH_INDEX_PASSWORD`` reaches
    the same index, with no password on its command line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    username = userinfo.partition(":")[0]
    netloc = f"{username}@{host}" if username else host
    return parts._replace(netloc=netloc).geturl(), unquote(parts.password)
