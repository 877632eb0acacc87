"""What only the Redis backend has: its key layout, AUTH/ACL URLs, round trips, lost scripts and
a server that restarts empty. The shared behaviour is in test_index_contract.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import pytest
import redis
from redis.asyncio.connection import AbstractConnection

from kvswitch.cache_index import redis_scripts
from kvswitch.cache_index.connect import IndexUnreachable, connect_index
from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.cache_index.redis_index import (
    RESYNC_SLICE,
    WORKER_LIST_TTL_S,
    KeySchema,
    RedisIndex,
    hash_tag,
)
from kvswitch.security import INDEX_PASSWORD_ENV
from tests.cache_index.conftest import ACL_PREFIX, REDIS_PASSWORD, unique_prefix

NS = "model-a"
TTL_S = 30.0
CHAIN = hash_prompt_blocks(list(range(64)), 4, NS)  # 16 blocks


def worker(worker_id: str, namespace: str = NS) -> WorkerInfo:
    return WorkerInfo(worker_id, "127.0.0.1:50051", namespace, 4, "prefill", 256, 1024)


def stored(hashes: Iterable[bytes]) -> BlockStored:
    block_hashes = tuple(hashes)
    return BlockStored(block_hashes)


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
            # single Redis only: the namespace's inverted map and slot table
            f"{prefix}:ns:{NS}:map": "hash",
            f"{prefix}:ns:{NS}:slots": "hash",
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
            b"max_model_len": b"1024",
            b"block_hash": b"xxh3",
            b"block_hash_key_id": b"",
            b"degraded": b"",
            b"last_seq": b"1",
            b"trusted": b"1",
            b"epoch": b"1",
            b"slot": b"0",
        }
        # A resync fills a slot of its own, then takes it: we{ird}% registered in slot 1 and
        # resynced into slot 2 (slot 1, its set empty, was free at once).
        assert admin.hgetall(f"{prefix}:ns:{NS}:slots") == {b"a": b"0", b"we{ird}%": b"2"}
        # bit k of a map value: the worker in slot k holds the block
        assert admin.hgetall(f"{prefix}:ns:{NS}:map") == {
            **{h: b"\x05" for h in CHAIN[:2]},
            CHAIN[2]: b"\x01",
        }
        assert admin.smembers(f"{prefix}:w:{{a}}:blocks") == set(CHAIN[:3])
        assert 0 < admin.pttl(f"{prefix}:w:{{a}}:alive") <= TTL_S * 1000
        assert admin.pttl(f"{prefix}:w:{{a}}:blocks") == -1
        assert admin.hgetall(f"{prefix}:workers") == {b"a": NS.encode(), b"we{ird}%": NS.encode()}
    assert hash_tag("%{}") == "%25%7B%7D"
    assert KeySchema("p").worker("a").all == ["p:w:{a}:meta", "p:w:{a}:alive", "p:w:{a}:blocks"]
    assert KeySchema("p").namespace_map("m") == "p:ns:m:map"
    assert KeySchema("p").namespace_slots("m") == "p:ns:m:slots"
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
            keys = [*schema.worker(f"w{i}").all, schema.worker(f"w{i}").snapshot("gen")]
            assert len({admin.keyslot(key) for key in keys}) == 1
            nodes.add(admin.get_node_from_key(keys[0]).name)
        assert len(nodes) == 3
        # The namespace map is a single-Redis layout: a cluster never writes one.
        for node_keys in admin.scan_iter("*:ns:*", target_nodes=redis.RedisCluster.ALL_NODES):
            assert node_keys.endswith(b":workers"), node_keys


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


def test_a_url_without_a_password_takes_the_one_in_the_environment(
    redis_auth_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's --index URL is on its command line, for anyone on the host to read: the
    password can come from KVSWITCH_INDEX_PASSWORD instead; a password in the URL wins."""
    host = redis_auth_url.rsplit("@", 1)[1]

    async def body() -> None:
        monkeypatch.setenv(INDEX_PASSWORD_ENV, REDIS_PASSWORD)
        index = await connect_index(f"redis://{host}", prefix=unique_prefix())
        await index.register(worker("a"), TTL_S)
        assert [info.worker_id for info in await index.live_workers()] == ["a"]
        await index.close()
        monkeypatch.setenv(INDEX_PASSWORD_ENV, "wrong")
        with pytest.raises(IndexUnreachable, match="invalid username-password"):
            await connect_index(f"redis://{host}")
        await (await connect_index(redis_auth_url)).close()
        monkeypatch.delenv(INDEX_PASSWORD_ENV)
        with pytest.raises(IndexUnreachable, match="authenticated"):
            await connect_index(f"redis://{host}")

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


def cluster_evalsha_calls(url: str) -> int:
    with redis.RedisCluster.from_url(url) as admin:
        stats = admin.info("commandstats", target_nodes=redis.RedisCluster.PRIMARIES)
    return sum(node.get("cmdstat_evalsha", {}).get("calls", 0) for node in stats.values())


def test_match_on_a_cluster_asks_each_node_once(
    redis_cluster_url: str, sends: Counter[str]
) -> None:
    async def body() -> None:
        index = await RedisIndex.connect(redis_cluster_url, prefix=unique_prefix(), cluster=True)
        other = await RedisIndex.connect(redis_cluster_url, prefix=index._keys.prefix, cluster=True)
        for i in range(12):
            await index.register(worker(f"w{i}"), TTL_S)
        sends.clear()
        assert await index.match(NS, CHAIN) == {f"w{i}": 0 for i in range(12)}
        # First the registry (SMEMBERS), then one pipeline per node (the workers span all three).
        assert sum(sends.values()) == 1 + 3
        assert len(sends) == 3
        sends.clear()
        before = cluster_evalsha_calls(redis_cluster_url)
        assert await index.match(NS, CHAIN) == {f"w{i}": 0 for i in range(12)}
        assert sum(sends.values()) == 3  # the worker list is reused: one message per node
        # ... and one script call per node, for all 12 workers (one per worker before).
        assert cluster_evalsha_calls(redis_cluster_url) == before + 3
        # A worker another client registers shows up once the list is read again.
        await other.register(worker("late"), TTL_S)
        assert "late" not in await index.match(NS, CHAIN)
        await asyncio.sleep(WORKER_LIST_TTL_S)
        assert (await index.match(NS, CHAIN))["late"] == 0
        # One that another client removes is gone at once: its node answers that it is.
        await other.deregister("w0")
        assert "w0" not in await index.match(NS, CHAIN)
        await other.close()
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
            await index.apply("w", 1, [BlockStored(tuple(chain[:3]))])
            assert await index.match("m", chain) == {"w": 3}
        finally:
            await index.close()
        # Plain TCP to the TLS port is refused at connect.
        plain = server.url.replace("rediss://", "redis://").split("?")[0]
        with pytest.raises(redis.exceptions.ConnectionError):
            await RedisIndex.connect(plain, prefix=unique_prefix())

    asyncio.run(main())


def decoded_map(admin: redis.Redis, prefix: str, namespace: str) -> dict[str, set[bytes]]:
    """The namespace's map read back as worker id -> the hashes whose bit it holds."""
    slot_owner = {
        int(slot): worker_id.decode()
        for worker_id, slot in admin.hgetall(f"{prefix}:ns:{namespace}:slots").items()
    }
    held: dict[str, set[bytes]] = {w: set() for w in slot_owner.values()}
    for block_hash, bitmap in admin.hgetall(f"{prefix}:ns:{namespace}:map").items():
        assert any(bitmap), "an all-zero bitmap is deleted, not kept"
        for slot in range(8 * len(bitmap)):
            if bitmap[slot // 8] >> (slot % 8) & 1:
                held[slot_owner[slot]].add(block_hash)  # a bit of a free slot fails here
    return held


def sets_of(admin: redis.Redis, prefix: str, worker_ids: Iterable[str]) -> dict[str, set[bytes]]:
    schema = KeySchema(prefix)
    return {w: admin.smembers(schema.worker(w).blocks) for w in worker_ids}


def test_the_map_stays_equal_to_the_sets(redis_url: str) -> None:
    """A random run of registers (some moving namespace), applies (some with a gap), resyncs,
    deregisters and reclaims over 12 workers (two bitmap bytes): after each step, every
    namespace's map decodes to exactly the sets of the workers that hold its slots, its untrusted
    set names exactly those of them waiting for a resync, and match agrees with a count over the
    sets."""
    prefix = unique_prefix()
    rng = random.Random(7)
    pool = many_hashes(40, salt=3)
    namespaces = [NS, "model-b"]
    worker_ids = [f"w{i}" for i in range(12)]

    async def body() -> None:
        index = await RedisIndex.connect(redis_url, prefix=prefix)
        seqs: dict[str, int] = {}
        homes: dict[str, str] = {}
        with redis.Redis.from_url(redis_url) as admin:
            for step in range(400):
                worker_id = rng.choice(worker_ids)
                action = rng.random()
                if worker_id not in homes or action < 0.08:
                    homes[worker_id] = rng.choice(namespaces) if action < 0.04 else NS
                    short = rng.random() < 0.05
                    await index.register(
                        worker(worker_id, homes[worker_id]), 0.02 if short else TTL_S
                    )
                    seqs[worker_id] = 0
                    if short:  # lapsed from here on, until it registers again
                        await asyncio.sleep(0.03)
                elif action < 0.13:
                    await index.deregister(worker_id)
                    del homes[worker_id]
                elif action < 0.2:
                    seqs[worker_id] += 1
                    with contextlib.suppress(KeyError):  # its registration lapsed
                        await index.resync(worker_id, seqs[worker_id], rng.sample(pool, 12))
                elif action < 0.23:
                    await index.reclaim_expired()
                    homes = {w: ns for w, ns in homes.items() if await index.heartbeat(w, TTL_S)}
                else:
                    gap = 2 if rng.random() < 0.05 else 1
                    events: list[Any] = [stored(rng.sample(pool, rng.randint(0, 6)))]
                    if rng.random() < 0.5:
                        events.append(BlockRemoved(tuple(rng.sample(pool, rng.randint(0, 6)))))
                    if rng.random() < 0.03:
                        events.insert(rng.randint(0, 1), AllBlocksCleared())
                    status = await index.apply(worker_id, seqs[worker_id] + gap, events)
                    if status is ApplyStatus.APPLIED:
                        seqs[worker_id] += 1
                for namespace in namespaces:
                    held = decoded_map(admin, prefix, namespace)
                    assert held == sets_of(admin, prefix, held), (step, namespace)
                    untrusted = admin.smembers(f"{prefix}:ns:{namespace}:untrusted")
                    assert untrusted == {
                        w.encode()
                        for w in held
                        if admin.hget(KeySchema(prefix).worker(w).meta, "trusted") == b"0"
                    }, step
                    chain = rng.sample(pool, 10)
                    live = {w.worker_id for w in await index.live_workers(namespace)}
                    trusted = {
                        w
                        for w in live
                        if admin.hget(KeySchema(prefix).worker(w).meta, "trusted") == b"1"
                    }
                    expected = {}
                    for w in trusted:
                        blocks = admin.smembers(KeySchema(prefix).worker(w).blocks)
                        expected[w] = next(
                            (n for n, h in enumerate(chain) if h not in blocks), len(chain)
                        )
                    assert await index.match(namespace, chain) == expected, step
        await index.close()

    run(body())


def test_a_dropped_worker_frees_its_slot_and_its_bits(redis_url: str) -> None:
    prefix = unique_prefix()

    async def body() -> None:
        index = await RedisIndex.connect(redis_url, prefix=prefix)
        for worker_id in ("a", "b", "c"):
            await index.register(worker(worker_id), TTL_S)
            await index.apply(worker_id, 1, [stored(CHAIN[:4])])
        with redis.Redis.from_url(redis_url) as admin:
            slots_key = f"{prefix}:ns:{NS}:slots"
            assert admin.hgetall(slots_key) == {b"a": b"0", b"b": b"1", b"c": b"2"}
            assert set(admin.hvals(f"{prefix}:ns:{NS}:map")) == {b"\x07"}
            await index.deregister("b")
            assert admin.hgetall(slots_key) == {b"a": b"0", b"c": b"2"}
            assert set(admin.hvals(f"{prefix}:ns:{NS}:map")) == {b"\x05"}
            await index.register(worker("d"), TTL_S)  # the lowest free slot: b's
            assert admin.hget(slots_key, "d") == b"1"
            assert await index.match(NS, CHAIN) == {"a": 4, "c": 4, "d": 0}
            # A new incarnation takes a free slot while its old set is retired; once the old
            # bits are cleared (before register returns) that slot is free again.
            await index.register(worker("a"), TTL_S)
            assert admin.hget(slots_key, "a") == b"3"
            assert set(admin.hvals(f"{prefix}:ns:{NS}:map")) == {b"\x04"}
            assert not admin.exists(f"{prefix}:ns:{NS}:retired")
            await index.register(worker("e"), TTL_S)
            assert admin.hget(slots_key, "e") == b"0"
            for worker_id in ("a", "c", "d", "e"):
                await index.deregister(worker_id)
            keys = set(admin.scan_iter(f"{prefix}:ns:*"))
            assert not keys, keys  # no map, slot table or registry is left behind
        await index.close()

    run(body())


class SteppedIndex(RedisIndex):
    """A RedisIndex that awaits ``between`` after each of its single script calls, where a test
    acts as another client would between two slices of a resync."""

    between: Callable[[str], Awaitable[None]]

    async def _run(self, script: Any, keys: list[str], args: Any) -> Any:
        reply = await super()._run(script, keys, args)
        await self.between(script.script)
        return reply


def test_a_large_resync_goes_in_slices_that_lookups_come_between(
    connect: Callable[..., Awaitable[RedisIndex]],
) -> None:
    """20,000 blocks: about ten RESYNC_FILL calls, each short, with another client's lookups
    answered between them; the worker is out of match until the commit."""
    snapshot = CHAIN[:4] + many_hashes(20_000, salt=4)
    prefix = unique_prefix()

    async def body() -> None:
        other = await connect(prefix)
        index = await connect(prefix)
        stepped = SteppedIndex(index._client, index._keys, cluster=index._cluster)
        lookups: list[dict[str, int]] = []

        async def lookup(script: str) -> None:
            if script == redis_scripts.RESYNC_FILL:
                lookups.append(await other.match(NS, CHAIN))

        stepped.between = lookup
        for worker_id in ("a", "b"):
            await index.register(worker(worker_id), TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.apply("b", 1, [stored(CHAIN[:8])])
        await stepped.resync("a", 1, snapshot)
        assert len(lookups) == -(-len(snapshot) // RESYNC_SLICE)
        assert all(matches == {"b": 8} for matches in lookups), lookups
        assert await other.match(NS, CHAIN) == {"a": 4, "b": 8}
        await other.close()
        await index.close()

    run(body())


def test_a_register_during_a_resync_supersedes_it_and_leaves_nothing_behind(
    redis_url: str,
) -> None:
    prefix = unique_prefix()
    snapshot = many_hashes(3 * RESYNC_SLICE, salt=5)

    async def body() -> None:
        index = await RedisIndex.connect(redis_url, prefix=prefix)
        stepped = SteppedIndex(index._client, index._keys, cluster=False)
        num_fills = 0

        async def restart_after_the_first_fill(script: str) -> None:
            nonlocal num_fills
            if script == redis_scripts.RESYNC_FILL:
                num_fills += 1
                if num_fills == 1:
                    await index.register(worker("a"), TTL_S)  # the worker restarted

        stepped.between = restart_after_the_first_fill
        await index.register(worker("a"), TTL_S)
        await index.register(worker("b"), TTL_S)
        await index.apply("b", 1, [stored(CHAIN[:8])])
        with pytest.raises(KeyError, match="not registered"):
            await stepped.resync("a", 7, snapshot)
        assert num_fills == 2  # the second slice found its generation gone and wrote nothing
        assert await index.match(NS, snapshot[:8]) == {"a": 0, "b": 0}
        with redis.Redis.from_url(redis_url) as admin:
            assert decoded_map(admin, prefix, NS) == sets_of(admin, prefix, ["a", "b"])
            leftovers = [
                key
                for key in admin.scan_iter(f"{prefix}*")
                if b"snapshot" in key or key.endswith((b":retired", b":pending"))
            ]
            assert not leftovers, leftovers
        await index.close()

    run(body())
