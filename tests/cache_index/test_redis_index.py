"""What only the Redis backend has: its key layout, AUTH/ACL URLs, round trips, lost scripts and
a server that restarts empty. The shared behaviour is in test_index_contract.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import pytest
import redis
from redis.asyncio.connection import AbstractConnection

from cache_index.events import BlockStored
from cache_index.hashing import hash_prompt_blocks
from cache_index.index import ApplyStatus, BlockIndex, WorkerInfo
from cache_index.local_redis import LocalRedis
from cache_index.redis_index import KeySchema, RedisIndex, hash_tag
from tests.cache_index.conftest import ACL_PREFIX, unique_prefix

NS = "model-a"
TTL_S = 30.0
CHAIN = hash_prompt_blocks(list(range(64)), 4, NS)  # 16 blocks


def worker(worker_id: str, namespace: str = NS) -> WorkerInfo:
    return WorkerInfo(worker_id, "127.0.0.1:50051", namespace, 4, "prefill", 256)


def stored(hashes: Iterable[bytes]) -> BlockStored:
    block_hashes = tuple(hashes)
    return BlockStored(block_hashes, b"\x00" * 16, tuple(range(4 * len(block_hashes))), 4)


def many_hashes(n: int, salt: int = 0) -> list[bytes]:
    return [(salt << 64 | i).to_bytes(16, "big") for i in range(n)]


def run(body: Coroutine[Any, Any, None]) -> None:
    asyncio.run(body)


@pytest.fixture(params=["redis", "cluster"])
def connect(request: pytest.FixtureRequest) -> Callable[..., Awaitable[RedisIndex]]:
    """Connects a RedisIndex with a fresh prefix to the session's single Redis or cluster."""
    cluster = request.param == "cluster"
    url = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")

    async def connect_index(prefix: str | None = None) -> RedisIndex:
        return await RedisIndex.connect(url, prefix=prefix or unique_prefix(), cluster=cluster)

    return connect_index


def test_keys_follow_the_documented_schema(redis_url: str) -> None:
    prefix = unique_prefix()

    async def body() -> None:
        index = await RedisIndex.connect(redis_url, prefix=prefix)
        await index.register(worker("a"), TTL_S)
        await index.register(worker("we{ird}%"), TTL_S)
        await index.apply("a", 1, [stored(CHAIN[:3])])
        await index.resync("we{ird}%", 4, CHAIN[:2])
        await index.close()

    run(body())
    with redis.Redis.from_url(redis_url) as admin:
        keys = {key.decode(): admin.type(key).decode() for key in admin.scan_iter(f"{prefix}*")}
        assert keys == {
            f"{prefix}:workers": "hash",
            f"{prefix}:ns:{NS}:workers": "set",
            f"{prefix}:w:{{a}}:meta": "hash",
            f"{prefix}:w:{{a}}:alive": "string",
            f"{prefix}:w:{{a}}:blocks": "set",
            # braces and % are escaped, so the whole id stays the hash tag (no snapshot is left)
            f"{prefix}:w:{{we%7Bird%7D%25}}:meta": "hash",
            f"{prefix}:w:{{we%7Bird%7D%25}}:alive": "string",
            f"{prefix}:w:{{we%7Bird%7D%25}}:blocks": "set",
        }
        assert admin.hgetall(f"{prefix}:w:{{a}}:meta") == {
            b"address": b"127.0.0.1:50051",
            b"namespace": NS.encode(),
            b"block_size": b"4",
            b"role": b"prefill",
            b"num_blocks": b"256",
            b"last_seq": b"1",
            b"trusted": b"1",
            b"epoch": b"1",
        }
        assert admin.smembers(f"{prefix}:w:{{a}}:blocks") == set(CHAIN[:3])
        assert 0 < admin.pttl(f"{prefix}:w:{{a}}:alive") <= TTL_S * 1000
        assert admin.pttl(f"{prefix}:w:{{a}}:blocks") == -1
        assert admin.hgetall(f"{prefix}:workers") == {b"a": NS.encode(), b"we{ird}%": NS.encode()}
    assert hash_tag("%{}") == "%25%7B%7D"
    assert KeySchema("p").worker("a").all == ["p:w:{a}:meta", "p:w:{a}:alive", "p:w:{a}:blocks"]
    with pytest.raises(ValueError, match="prefix"):
        KeySchema("p{x}")


def test_a_worker_keys_share_one_slot_and_workers_spread_over_nodes(
    redis_cluster_url: str,
) -> None:
    async def body() -> None:
        index = await RedisIndex.connect(redis_cluster_url, prefix=unique_prefix(), cluster=True)
        worker_ids = [f"w{i}" for i in range(12)]
        for i, worker_id in enumerate(worker_ids):
            await index.register(worker(worker_id), TTL_S)
            await index.apply(worker_id, 1, [stored(CHAIN[:i])])
        assert await index.match(NS, CHAIN) == {w: i for i, w in enumerate(worker_ids)}
        await index.close()

    run(body())
    with redis.RedisCluster.from_url(redis_cluster_url) as admin:
        schema = KeySchema("any")
        nodes = set()
        for i in range(12):
            keys = [*schema.worker(f"w{i}").all, schema.worker(f"w{i}").new_snapshot()]
            assert len({admin.keyslot(key) for key in keys}) == 1
            nodes.add(admin.get_node_from_key(keys[0]).name)
        assert len(nodes) == 3


def test_two_prefixes_on_one_redis_never_see_each_other(
    connect: Callable[..., Awaitable[RedisIndex]],
) -> None:
    async def body() -> None:
        left, right = await connect(), await connect()
        await left.register(worker("a"), TTL_S)
        await right.register(worker("a"), 0.2)
        await right.register(worker("b"), TTL_S)
        assert await left.apply("a", 1, [stored(CHAIN)]) is ApplyStatus.APPLIED
        assert await right.apply("a", 1, [stored(CHAIN[:2])]) is ApplyStatus.APPLIED
        assert await left.match(NS, CHAIN) == {"a": 16}
        assert await right.match(NS, CHAIN) == {"a": 2, "b": 0}
        assert [w.worker_id for w in await left.live_workers()] == ["a"]
        await asyncio.sleep(0.3)
        assert await right.reclaim_expired() == 1
        assert await left.reclaim_expired() == 0
        await right.deregister("b")
        assert (await left.stats()).num_entries == 16
        assert await left.match(NS, CHAIN) == {"a": 16}
        assert await right.live_workers() == []
        await left.close()
        await right.close()

    run(body())


def test_password_and_acl_user_urls(redis_auth_url: str, redis_acl_url: str) -> None:
    async def round_trip(url: str, prefix: str) -> None:
        index = await RedisIndex.connect(url, prefix=prefix)
        await index.register(worker("a"), 0.2)
        await index.register(worker("b"), TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.resync("b", 3, CHAIN[:5])
        assert await index.match(NS, CHAIN) == {"a": 16, "b": 5}
        assert await index.heartbeat("b", TTL_S) is True
        assert (await index.stats()).num_entries == 21
        await asyncio.sleep(0.3)
        assert await index.reclaim_expired() == 1
        await index.deregister("b")
        assert await index.live_workers() == []
        await index.close()

    async def body() -> None:
        await round_trip(redis_auth_url, unique_prefix())
        # The ACL user may touch only keys under its prefix: every script stays inside it.
        await round_trip(redis_acl_url, f"{ACL_PREFIX}:{unique_prefix()}")
        index = await RedisIndex.connect(redis_acl_url, prefix=unique_prefix())
        with pytest.raises(redis.exceptions.NoPermissionError):
            await index.register(worker("a"), TTL_S)
        await index.close()

    run(body())


def test_a_wrong_or_missing_password_fails_at_connect(redis_auth_url: str) -> None:
    host = redis_auth_url.rsplit("@", 1)[1]

    async def body() -> None:
        for url in (f"redis://:wrong@{host}", f"redis://nobody:wrong@{host}", f"redis://{host}"):
            with pytest.raises(redis.exceptions.AuthenticationError):
                await RedisIndex.connect(url)

    run(body())


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts writes to the server per connection address: a command, or a whole pipeline to one
    node, is one write and one round trip."""
    counts: Counter[str] = Counter()
    send = AbstractConnection.send_packed_command

    async def counting_send(self: AbstractConnection, command: Any, check_health: bool = True):
        counts[f"{self.host}:{self.port}"] += 1
        return await send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting_send)
    return counts


def test_match_is_one_round_trip_on_a_single_redis(redis_url: str, sends: Counter[str]) -> None:
    def evalsha_calls(admin: redis.Redis) -> int:
        return admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    async def body() -> None:
        index = await RedisIndex.connect(redis_url, prefix=unique_prefix())
        for i in range(8):
            await index.register(worker(f"w{i}"), TTL_S)
            await index.apply(f"w{i}", 1, [stored(CHAIN[:i])])
        await index.apply("w7", 3, [stored(CHAIN)])  # batch 2 lost: w7 is untrusted
        with redis.Redis.from_url(redis_url) as admin:
            before = evalsha_calls(admin)
            sends.clear()
            assert await index.match(NS, CHAIN) == {f"w{i}": i for i in range(7)}
            assert sum(sends.values()) == 1
            assert evalsha_calls(admin) == before + 1
        await index.close()

    run(body())


def test_match_on_a_cluster_reads_the_registry_then_each_node_once(
    redis_cluster_url: str, sends: Counter[str]
) -> None:
    async def body() -> None:
        index = await RedisIndex.connect(redis_cluster_url, prefix=unique_prefix(), cluster=True)
        for i in range(12):
            await index.register(worker(f"w{i}"), TTL_S)
        sends.clear()
        assert await index.match(NS, CHAIN) == {f"w{i}": 0 for i in range(12)}
        # SMEMBERS of the registry, then one pipeline per node (the workers span all three).
        assert sum(sends.values()) == 1 + 3
        assert len(sends) == 3
        await index.close()

    run(body())


def test_scripts_are_loaded_again_after_script_flush(
    connect: Callable[..., Awaitable[RedisIndex]], request: pytest.FixtureRequest
) -> None:
    async def body() -> None:
        index = await connect()
        await index.register(worker("a"), TTL_S)
        await index._client.script_flush()  # on a cluster, every primary
        await index.resync("a", 1, CHAIN[:4])  # a pipeline
        await index._client.script_flush()
        assert await index.apply("a", 2, [stored(CHAIN[4:6])]) is ApplyStatus.APPLIED
        await index._client.script_flush()
        assert await index.match(NS, CHAIN) == {"a": 6}
        await index._client.script_flush()
        assert (await index.stats()).num_entries == 6
        await index.close()

    run(body())


def test_large_batches_and_snapshots(connect: Callable[..., Awaitable[RedisIndex]]) -> None:
    """Longer than the slices APPLY unpacks and resync writes at once."""

    async def body() -> None:
        index = await connect()
        await index.register(worker("a"), TTL_S)
        batch = many_hashes(4321)
        assert await index.apply("a", 1, [stored(batch)]) is ApplyStatus.APPLIED
        assert await index.match(NS, batch) == {"a": 4321}
        snapshot = many_hashes(25_001, salt=1)
        await index.resync("a", 9, snapshot)
        assert await index.match(NS, snapshot) == {"a": 25_001}
        assert (await index.stats()).num_entries == 25_001
        await index.close()

    run(body())


def test_a_worker_that_registers_under_another_namespace_moves(
    connect: Callable[..., Awaitable[RedisIndex]],
) -> None:
    async def body() -> None:
        index = await connect()
        await index.register(worker("a"), TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.register(worker("a", namespace="model-b"), TTL_S)
        assert await index.match(NS, CHAIN) == {}
        assert await index.live_workers(NS) == []
        assert await index.live_workers("model-b") == [worker("a", namespace="model-b")]
        assert await index.match("model-b", CHAIN) == {"a": 0}
        await index.close()

    run(body())


def test_taking_a_live_worker_off_the_registry_puts_it_back(
    connect: Callable[..., Awaitable[RedisIndex]],
) -> None:
    """Reclaim unlists lapsed workers; one that registered again meanwhile must stay listed."""

    async def body() -> None:
        index = await connect()
        await index.register(worker("a"), TTL_S)
        await index._unlist({"a": NS})
        assert await index.live_workers(NS) == [worker("a")]
        assert await index.match(NS, CHAIN) == {"a": 0}
        await index.close()

    run(body())


def test_a_server_that_restarts_empty(spawn_redis: Callable[..., LocalRedis]) -> None:
    server = spawn_redis()

    async def body() -> None:
        index: BlockIndex = await RedisIndex.connect(server.url, prefix=unique_prefix())
        await index.register(worker("a"), TTL_S)
        assert await index.apply("a", 1, [stored(CHAIN[:4])]) is ApplyStatus.APPLIED
        server.stop()
        # Down: every call raises once the retry policy gives up.
        with pytest.raises(redis.exceptions.ConnectionError):
            await index.apply("a", 2, [stored(CHAIN[4:8])])
        with pytest.raises(redis.exceptions.ConnectionError):
            await index.match(NS, CHAIN)
        server.start()
        # Back, empty (and without the scripts): the worker is unknown until it registers
        # again and sends a snapshot.
        assert await index.apply("a", 2, [stored(CHAIN[4:8])]) is ApplyStatus.UNKNOWN_WORKER
        assert await index.match(NS, CHAIN) == {}
        await index.register(worker("a"), TTL_S)
        await index.resync("a", 2, CHAIN[:8])
        assert await index.apply("a", 3, [stored(CHAIN[8:10])]) is ApplyStatus.APPLIED
        assert await index.match(NS, CHAIN) == {"a": 10}
        await index.close()

    run(body())


def test_tls_urls_with_auth(spawn_redis: Callable[..., LocalRedis]) -> None:
    """``rediss://`` with the server's CA certificate and a password: the index works as usual."""
    server = spawn_redis(tls=True, password="tls-secret")
    assert server.url.startswith("rediss://:tls-secret@")

    async def main() -> None:
        index = await RedisIndex.connect(server.url, prefix=unique_prefix())
        try:
            info = WorkerInfo("w", "127.0.0.1:1", "m", 4)
            await index.register(info, 30)
            chain = [bytes([i]) * 16 for i in range(5)]
            root = b"\x00" * 16
            await index.apply("w", 1, [BlockStored(tuple(chain[:3]), root, (), 4)])
            assert await index.match("m", chain) == {"w": 3}
        finally:
            await index.close()
        # Plain TCP to the TLS port is refused at connect.
        plain = server.url.replace("rediss://", "redis://").split("?")[0]
        with pytest.raises(redis.exceptions.ConnectionError):
            await RedisIndex.connect(plain, prefix=unique_prefix())

    asyncio.run(main())
