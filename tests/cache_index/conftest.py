"""Real redis-server processes for the index tests, and ``make_index`` over every backend.

Servers listen on 127.0.0.1 at random free ports (never 6379), keep nothing on disk and are
killed at teardown. ``redis-server`` and ``redis-cli`` must be on PATH: without them these tests
fail, they do not skip (CI installs them). The ``grpc`` backend is a real gRPC server on
127.0.0.1, in the test's own event loop, serving an embedded index to a ``GrpcIndex``.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest
import redis

from kvswitch.cache_index.grpc_index import GrpcIndex, add_index_service
from kvswitch.cache_index.index import BlockIndex
from kvswitch.cache_index.local_redis import LocalRedis, LocalRedisCluster
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.cache_index.redis_index import RedisIndex

MakeIndex = Callable[[], Awaitable[BlockIndex]]

REDIS_PASSWORD = "kvswitch-default-secret"
ACL_USER = "kvswitch-router"
ACL_PASSWORD = "kvswitch-acl-secret"
ACL_PREFIX = "kvs-acl"  # the ACL user may touch only keys under this prefix


def _require_redis() -> None:
    for name in ("redis-server", "redis-cli"):
        if shutil.which(name) is None:
            pytest.fail(
                f"{name} is not on PATH: the cache index tests run a real Redis "
                "(apt-get install redis-server)",
                pytrace=False,
            )


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    _require_redis()
    with LocalRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def _redis_auth_server() -> Iterator[LocalRedis]:
    _require_redis()
    with LocalRedis(password=REDIS_PASSWORD) as server:
        with redis.Redis(port=server.port, password=REDIS_PASSWORD) as admin:
            rules = ("on", f">{ACL_PASSWORD}", "resetkeys", f"~{ACL_PREFIX}:*", "+@all")
            admin.execute_command("ACL", "SETUSER", ACL_USER, *rules, "-@dangerous")
        yield server


@pytest.fixture(scope="session")
def redis_auth_url(_redis_auth_server: LocalRedis) -> str:
    """The default user, with the server's requirepass password."""
    return f"redis://:{REDIS_PASSWORD}@127.0.0.1:{_redis_auth_server.port}/0"


@pytest.fixture(scope="session")
def redis_acl_url(_redis_auth_server: LocalRedis) -> str:
    """An ACL user that may touch only keys under ``ACL_PREFIX``."""
    return f"redis://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{_redis_auth_server.port}/0"


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A Redis Cluster of three primaries, no replicas; the URL names the first."""
    _require_redis()
    with LocalRedisCluster(num_nodes=3) as cluster:
        yield cluster.url


@pytest.fixture
def spawn_redis() -> Iterator[Callable[..., LocalRedis]]:
    """Start a private redis-server for one test (stopped at teardown); ``stop()`` then
    ``start()`` gives a fresh, empty server on the same port."""
    _require_redis()
    servers: list[LocalRedis] = []

    def spawn(**kwargs: object) -> LocalRedis:
        server = LocalRedis(**kwargs)
        servers.append(server)
        return server.start()

    yield spawn
    for server in servers:
        server.stop()


def unique_prefix() -> str:
    """A key prefix no other test uses, so tests sharing a server never see each other's keys."""
    return f"kvs-test-{uuid.uuid4().hex[:12]}"


class ServedIndex(GrpcIndex):
    """A ``GrpcIndex`` with its own server on 127.0.0.1, which serves ``served`` (a fresh
    ``MemoryIndex`` by default); ``close()`` stops the server too, cancelling calls in flight.
    Start one with ``await ServedIndex.start()`` (port 0: a free one)."""

    def __init__(self, target: str, server: grpc.aio.Server, served: BlockIndex) -> None:
        super().__init__(target)
        self.server = server
        self.served = served

    @classmethod
    async def start(cls, served: BlockIndex | None = None, port: int = 0) -> ServedIndex:
        served = served or MemoryIndex()
        server = grpc.aio.server()
        add_index_service(server, served)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return cls(f"127.0.0.1:{port}", server, served)

    async def close(self) -> None:
        await super().close()
        await self.server.stop(grace=None)


@pytest.fixture(params=["memory", "grpc", "redis", "cluster"])
def make_index(request: pytest.FixtureRequest) -> MakeIndex:
    """An async factory of fresh, empty indexes of one backend; call it in the test's own event
    loop (the Redis and gRPC clients bind to the loop they are created in)."""
    backend: str = request.param
    if backend == "memory":

        async def make_memory() -> BlockIndex:
            return MemoryIndex()

        return make_memory
    if backend == "grpc":
        return ServedIndex.start
    url = request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url")
    prefix = unique_prefix()

    async def make_redis() -> BlockIndex:
        return await RedisIndex.connect(url, prefix=prefix, cluster=backend == "cluster")

    return make_redis
