"""Open a block index from a URL: the one place that knows which backend a URL names.

memory://                         the embedded index (this process only)
redis://[user:password@]host:port/db, rediss://...        one Redis (rediss: TLS)
redis+cluster://host:port, rediss+cluster://host:port     a Redis Cluster (any node)
"""

from __future__ import annotations

from cache_index.index import BlockIndex

DEFAULT_PREFIX = "kvswitch"


async def connect_index(url: str, *, prefix: str = DEFAULT_PREFIX) -> BlockIndex:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"index URL {url!r} has no scheme: use memory://, redis:// or rediss://")
    if scheme == "memory":
        from cache_index.memory_index import MemoryIndex

        return MemoryIndex()
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        from cache_index.redis_index import RedisIndex

        base_scheme, _, cluster = scheme.partition("+")
        return await RedisIndex.connect(
            f"{base_scheme}://{rest}", prefix=prefix, cluster=bool(cluster)
        )
    raise ValueError(f"unknown index URL scheme {scheme!r}: use memory://, redis:// or rediss://")
