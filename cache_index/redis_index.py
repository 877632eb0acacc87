"""The block-hash index in Redis (or a Redis Cluster), shared by every router replica.

Each worker's state lives in three keys that share one hash tag, and every read-check-write on
them is one Lua script (``cache_index/redis_scripts.py``), so a worker's entries are consistent
on a cluster too. A registry of worker ids (all of them, and per namespace) lets match, stats
and reclaim find the workers. On a single Redis (not a cluster) the same scripts also keep, per
namespace, an inverted map block hash -> bitmap of worker slots, which lets ``match`` read the
chain once for all workers. docs/INDEX.md has the key layout and the round trips per call.

No call runs a script whose work grows with a worker's whole set: a snapshot goes in slices
of ``RESYNC_SLICE`` blocks and a set taken out of use is cleared ``CLEAR_SLICE`` blocks at a
time, so lookups and heartbeats are served between the slices however large the worker.

While the server is unreachable every call raises ``redis.exceptions.ConnectionError`` once the
injected retry policy gives up. A server that comes back empty (a restart without persistence)
knows no workers: ``apply`` answers UNKNOWN_WORKER, and the worker registers and resyncs.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from kvswitch.cache_index import redis_scripts
from kvswitch.cache_index.events import AllBlocksCleared, BlockStored, CacheEvent
from kvswitch.cache_index.hashing import HASH_BYTES, XXH3
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, IndexStats, WorkerInfo, check_seq
from kvswitch.cache_index.redis_clients import (
    CancelSafeRedis,
    CancelSafeRedisCluster,
    keeping_cancel,
)

AnyPipeline = Pipeline | ClusterPipeline

# NOTE: a script runs alone on Redis, so these bound how long a lookup can wait behind an index
# write: a few milliseconds at most (a 200,000-block resync as one script stalled lookups
# 0.45 s, a million-block one 4 s; docs/INDEX.md has the figures).
RESYNC_SLICE = 512  # snapshot hashes per RESYNC_FILL
CLEAR_SLICE = 512  # retired blocks whose map bits one CLEAR_RETIRED clears


def default_retry() -> Retry:
    """Three more tries on connection errors and timeouts, after 0.1, 0.2 and 0.4 s."""
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3)


@dataclass(frozen=True, slots=True)
class WorkerKeys:
    """One worker's keys; they share the hash tag, so one script may touch them all."""

    meta: str
    alive: str
    blocks: str

    @property
    def all(self) -> list[str]:
        """In the order every per-worker script takes them as KEYS."""
        return [self.meta, self.alive, self.blocks]

    def snapshot(self, generation: str) -> str:
        """The set a resync of ``generation`` fills, in the same slot, renamed onto blocks by
        RESYNC_COMMIT (the scripts derive the same name)."""
        return f"{self.blocks}:snapshot:{generation}"


@dataclass(frozen=True, slots=True)
class KeySchema:
    """Every key name the index uses; all start with ``prefix:``."""

    prefix: str

    def __post_init__(self) -> None:
        if not self.prefix or "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"prefix must be non-empty and free of '{{' and '}}': {self.prefix!r}")

    @property
    def worker_key_prefix(self) -> str:
        return f"{self.prefix}:w:{{"

    @property
    def registry(self) -> str:
        """HASH worker id -> namespace, of every worker that may have keys."""
        return f"{self.prefix}:workers"

    @property
    def namespace_prefix(self) -> str:
        """What the scripts prepend to a namespace to name its map and slot table."""
        return f"{self.prefix}:ns:"

    def namespace(self, namespace: str) -> str:
        """SET of the ids of the workers registered under ``namespace``."""
        return f"{self.namespace_prefix}{namespace}:workers"

    def namespace_map(self, namespace: str) -> str:
        """Single Redis only: HASH block hash -> bitmap of the slots of the workers holding it."""
        return f"{self.namespace_prefix}{namespace}:map"

    def namespace_untrusted(self, namespace: str) -> str:
        """Single Redis only: SET of the ids of the namespace's workers waiting for a resync."""
        return f"{self.namespace_prefix}{namespace}:untrusted"

    def namespace_slots(self, namespace: str) -> str:
        """Single Redis only: HASH worker id -> its slot (bit) in the namespace's map."""
        return f"{self.namespace_prefix}{namespace}:slots"

    def namespace_retired(self, namespace: str) -> str:
        """Single Redis only: HASH slot -> a set taken out of use whose map bits are not all
        cleared yet (the slot stays reserved until they are)."""
        return f"{self.namespace_prefix}{namespace}:retired"

    def namespace_pending(self, namespace: str) -> str:
        """Single Redis only: HASH slot -> the id of the worker whose resync fills it."""
        return f"{self.namespace_prefix}{namespace}:pending"

    def worker(self, worker_id: str) -> WorkerKeys:
        base = f"{self.worker_key_prefix}{hash_tag(worker_id)}}}:"
        return WorkerKeys(base + "meta", base + "alive", base + "blocks")


def hash_tag(worker_id: str) -> str:
    """``worker_id`` with ``%``, ``{`` and ``}`` percent-encoded, so that it is a whole hash tag.

    MATCH_NAMESPACE does the same in Lua; the two must agree."""
    return worker_id.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


# How long a Redis Cluster client trusts its list of a namespace's workers (see _cluster_workers).
WORKER_LIST_TTL_S = 0.5


class RedisIndex(BlockIndex):
    """``BlockIndex`` on ``redis.asyncio``; build one with ``await RedisIndex.connect(url)``."""

    unavailable_errors = (RedisError, RedisClusterException, OSError)

    def __init__(self, client: Redis | RedisCluster, keys: KeySchema, *, cluster: bool) -> None:
        self._client = client
        self._keys = keys
        self._cluster = cluster
        # The per-worker scripts keep the namespace maps only when given their prefix: a cluster
        # cannot, as a worker's keys and its namespace's map sit in different slots.
        self._map_prefix = "" if cluster else keys.namespace_prefix
        self._register = client.register_script(redis_scripts.REGISTER)
        self._apply = client.register_script(redis_scripts.APPLY)
        self._resync_begin = client.register_script(redis_scripts.RESYNC_BEGIN)
        self._resync_fill = client.register_script(redis_scripts.RESYNC_FILL)
        self._resync_commit = client.register_script(redis_scripts.RESYNC_COMMIT)
        self._drop = client.register_script(redis_scripts.DROP)
        self._clear_retired = client.register_script(redis_scripts.CLEAR_RETIRED)
        self._match_node = client.register_script(redis_scripts.MATCH_NODE)
        self._match_namespace = client.register_script(redis_scripts.MATCH_NAMESPACE)
        self._worker_stats = client.register_script(redis_scripts.WORKER_STATS)
        # Cluster only: namespace -> (when read, its worker ids), so that a match asks each node
        # once and nothing else; see _cluster_workers.
        self._namespace_workers: dict[str, tuple[float, list[str]]] = {}

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        prefix: str = "kvswitch",
        cluster: bool = False,
        retry: Retry | None = None,
        socket_timeout_s: float | None = 5.0,
        password: str | None = None,
    ) -> RedisIndex:
        """Connect to ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS) and load
        the scripts; a wrong address or password fails here. ``cluster=True`` takes the URL of
        any one node of a Redis Cluster. ``password``, if given, is used instead of the URL's."""
        keys = KeySchema(prefix)
        options: dict[str, Any] = {
            "retry": retry or default_retry(),
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
        }
        if password is not None:
            options["password"] = password
        client_class = CancelSafeRedisCluster if cluster else CancelSafeRedis
        client = client_class.from_url(url, **options)
        index = cls(client, keys, cluster=cluster)
        try:
            await index._load_scripts()
        except BaseException:
            await client.aclose()
            raise
        return index

    async def close(self) -> None:
        await self._client.aclose()

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        self._namespace_workers.clear()
        keys = self._keys.worker(info.worker_id)
        old_namespace = await self._register(
            keys=keys.all,
            args=[_ttl_ms(ttl_s), self._map_prefix, info.worker_id, *_info_to_fields(info)],
        )
        # NOTE: listed only after the script ran, which _unlist's re-check relies on.
        old = None if old_namespace is None else old_namespace.decode()
        await self._pipeline(lambda pipe: self._list(pipe, info.worker_id, info.namespace, old))
        if old is not None:
            await self._clear_retired_sets(old)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        ttl_ms = _ttl_ms(ttl_s)
        return bool(await self._client.pexpire(self._keys.worker(worker_id).alive, ttl_ms))

    async def deregister(self, worker_id: str) -> None:
        self._namespace_workers.clear()

        def build(pipe: AnyPipeline) -> None:
            args = ["0", self._map_prefix, worker_id]
            self._queue(pipe, self._drop, self._keys.worker(worker_id).all, args)
            pipe.hget(self._keys.registry, worker_id)

        dropped_namespace, listed_namespace = await self._pipeline(build)
        namespace = dropped_namespace or listed_namespace
        await self._unlist({worker_id: None if namespace is None else namespace.decode()})
        if dropped_namespace is not None:
            await self._clear_retired_sets(dropped_namespace.decode())

    async def live_workers(self, namespace: str | None = None) -> list[WorkerInfo]:
        if namespace is None:
            listed = await self._client.hkeys(self._keys.registry)
        else:
            listed = await self._client.smembers(self._keys.namespace(namespace))
        worker_ids = sorted(worker_id.decode() for worker_id in listed)

        def build(pipe: AnyPipeline) -> None:
            for worker_id in worker_ids:
                keys = self._keys.worker(worker_id)
                pipe.exists(keys.alive)
                pipe.hgetall(keys.meta)

        replies = await self._pipeline(build)
        workers = []
        for worker_id, alive, meta in zip(worker_ids, replies[::2], replies[1::2], strict=True):
            if not alive or not meta:
                continue
            info = _info_from_fields(worker_id, meta)
            if namespace is None or info.namespace == namespace:
                workers.append(info)
        return workers

    async def apply(self, worker_id: str, seq: int, events: Sequence[CacheEvent]) -> ApplyStatus:
        check_seq(seq)
        keys = self._keys.worker(worker_id).all
        args = [seq, self._map_prefix, worker_id, *_events_to_args(events)]
        status = ApplyStatus((await self._apply(keys=keys, args=args)).decode())
        if status is ApplyStatus.APPLIED and any(isinstance(e, AllBlocksCleared) for e in events):
            namespace = await self._client.hget(self._keys.worker(worker_id).meta, "namespace")
            if namespace is not None:
                await self._clear_retired_sets(namespace.decode())
        return status

    async def resync(self, worker_id: str, seq: int, block_hashes: Iterable[bytes]) -> None:
        """In slices: RESYNC_BEGIN leaves the worker out of match and reserves a slot for the
        snapshot, each RESYNC_FILL adds ``RESYNC_SLICE`` hashes, RESYNC_COMMIT swaps the snapshot
        in. The generation token makes a stale resync (the worker registered again, or a newer
        resync began) write nothing; whatever it left behind is retired and cleared."""
        if seq < 0:
            raise ValueError(f"a snapshot's sequence number must be >= 0, got {seq}")
        keys = self._keys.worker(worker_id)
        generation = uuid.uuid4().hex
        snapshot = keys.snapshot(generation)
        hashes = list(block_hashes)
        lapsed = KeyError(f"worker {worker_id!r} is not registered (or its registration lapsed)")
        namespace = await self._run(
            self._resync_begin, keys.all, [self._map_prefix, worker_id, generation]
        )
        if namespace is None:
            raise lapsed
        for start in range(0, len(hashes), RESYNC_SLICE):
            args = [self._map_prefix, generation, *hashes[start : start + RESYNC_SLICE]]
            if not await self._run(self._resync_fill, [keys.meta, snapshot], args):
                raise lapsed  # superseded: registered again or dropped meanwhile
        commit_args = [seq, self._map_prefix, worker_id, generation]
        committed = await self._run(self._resync_commit, [*keys.all, snapshot], commit_args)
        await self._clear_retired_sets(namespace.decode())
        if not committed:
            raise lapsed

    async def match(self, namespace: str, block_hashes: Sequence[bytes]) -> dict[str, int]:
        if block_hashes and set(map(len, block_hashes)) != {HASH_BYTES}:
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes each")
        chain = b"".join(block_hashes)
        if not self._cluster:
            # One script over the namespace's map: one HMGET of the chain answers every worker.
            reply = await self._match_namespace(
                keys=[
                    self._keys.namespace_slots(namespace),
                    self._keys.namespace_map(namespace),
                    self._keys.namespace_untrusted(namespace),
                ],
                args=[self._keys.worker_key_prefix, namespace, chain],
            )
            return {reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 2)}
        # NOTE: one MATCH_NODE per node, all at once, for the workers the registry lists whose
        # keys it serves.
        worker_ids = await self._cluster_workers(namespace)
        client: RedisCluster = self._client  # type: ignore[assignment]
        node_to_workers: dict[Any, list[str]] = {}
        for worker_id in worker_ids:
            node = client.get_node_from_key(self._keys.worker(worker_id).meta)
            node_to_workers.setdefault(node, []).append(worker_id)

        async def ask(node: Any, node_worker_ids: list[str]) -> list[int]:
            keys = [key for w in node_worker_ids for key in self._keys.worker(w).all]
            args = ["EVALSHA", self._match_node.sha, 0, namespace, chain, *keys]
            try:
                return await client.execute_command(*args, target_nodes=node)
            except NoScriptError:
                await self._load_scripts()
                return await client.execute_command(*args, target_nodes=node)

        replies = await asyncio.gather(*(ask(n, ws) for n, ws in node_to_workers.items()))
        counts = {}
        for node_worker_ids, node_counts in zip(node_to_workers.values(), replies, strict=True):
            counts.update(zip(node_worker_ids, node_counts, strict=True))
        return {w: counts[w] for w in worker_ids if counts[w] >= 0}

    async def _cluster_workers(self, namespace: str) -> list[str]:
        """The namespace's registered worker ids, read at most every ``WORKER_LIST_TTL_S``.

        Lapsed, deregistered and untrusted workers answer -1 to MATCH_NODE, so a stale list
        never puts a wrong worker in an answer; it can only leave out, for that long, a worker
        that another client registered meanwhile. This client's own changes refresh it at once.
        """
        now = time.monotonic()
        cached = self._namespace_workers.get(namespace)
        if cached is not None and now - cached[0] < WORKER_LIST_TTL_S:
            return cached[1]
        listed = await self._client.smembers(self._keys.namespace(namespace))
        worker_ids = sorted(worker_id.decode() for worker_id in listed)
        self._namespace_workers[namespace] = (now, worker_ids)
        return worker_ids

    async def worker_block_hashes(self, worker_id: str) -> set[bytes]:
        keys = self._keys.worker(worker_id)
        if not await self._client.exists(keys.alive):
            return set()
        return set(await self._client.smembers(keys.blocks))

    async def stats(self) -> IndexStats:
        listed = await self._client.hgetall(self._keys.registry)
        worker_ids = [worker_id.decode() for worker_id in listed]
        # Single Redis: the namespace maps and slot tables count too.
        namespaces = [] if self._cluster else sorted({ns.decode() for ns in listed.values()})

        def build(pipe: AnyPipeline) -> None:
            for worker_id in worker_ids:
                self._queue(pipe, self._worker_stats, self._keys.worker(worker_id).all, [])
            for namespace in namespaces:
                pipe.memory_usage(self._keys.namespace_map(namespace))
                pipe.memory_usage(self._keys.namespace_slots(namespace))

        replies = await self._pipeline(build)
        live = [reply for reply in replies[: len(worker_ids)] if reply[0]]
        map_bytes = sum(reply or 0 for reply in replies[len(worker_ids) :])
        return IndexStats(len(live), sum(r[1] for r in live), sum(r[2] for r in live) + map_bytes)

    async def reclaim_expired(self) -> int:
        self._namespace_workers.clear()
        listed = await self._client.hgetall(self._keys.registry)
        worker_to_namespace = {w.decode(): ns.decode() for w, ns in listed.items()}
        worker_ids = list(worker_to_namespace)

        def check(pipe: AnyPipeline) -> None:
            for worker_id in worker_ids:
                pipe.exists(self._keys.worker(worker_id).alive)

        alive = await self._pipeline(check)
        lapsed = [w for w, is_alive in zip(worker_ids, alive, strict=True) if not is_alive]
        num_dropped = 0
        if lapsed:

            def drop(pipe: AnyPipeline) -> None:
                for worker_id in lapsed:
                    # '1': a worker that registered again since the check above is left alone.
                    args = ["1", self._map_prefix, worker_id]
                    self._queue(pipe, self._drop, self._keys.worker(worker_id).all, args)

            dropped = await self._pipeline(drop)
            await self._unlist({worker_id: worker_to_namespace[worker_id] for worker_id in lapsed})
            num_dropped = sum(namespace is not None for namespace in dropped)
        # NOTE: every namespace, not only those of the workers dropped now: a caller that died
        # while clearing a retired set left the rest to this loop.
        for namespace in sorted(set(worker_to_namespace.values())):
            await self._clear_retired_sets(namespace)
        return num_dropped

    async def _clear_retired_sets(self, namespace: str) -> None:
        """Clear the map bits of the namespace's retired sets, ``CLEAR_SLICE`` blocks per script
        call, until their slots are free. A caller that dies half-way leaves the rest to the
        next call that retires a set in the namespace, or to ``reclaim_expired``."""
        if self._cluster:
            return  # no map: a retired set was unlinked at once
        args = [self._map_prefix, namespace, CLEAR_SLICE]
        while await self._run(self._clear_retired, [], args):
            pass

    def _list(
        self, pipe: AnyPipeline, worker_id: str, namespace: str, old_namespace: str | None
    ) -> None:
        pipe.hset(self._keys.registry, worker_id, namespace)
        pipe.sadd(self._keys.namespace(namespace), worker_id)
        if old_namespace is not None and old_namespace != namespace:
            pipe.srem(self._keys.namespace(old_namespace), worker_id)

    async def _unlist(self, worker_to_namespace: dict[str, str | None]) -> None:
        """Take workers out of the registry, then list again any that is live by now.

        A worker that registers meanwhile lists itself only after its REGISTER script ran: if
        the re-check, made after the removal, missed that script, its listing came later."""
        worker_ids = list(worker_to_namespace)

        def remove(pipe: AnyPipeline) -> None:
            pipe.hdel(self._keys.registry, *worker_ids)
            for worker_id, namespace in worker_to_namespace.items():
                if namespace is not None:
                    pipe.srem(self._keys.namespace(namespace), worker_id)

        def check(pipe: AnyPipeline) -> None:
            for worker_id in worker_ids:
                keys = self._keys.worker(worker_id)
                pipe.exists(keys.alive)
                pipe.hget(keys.meta, "namespace")

        await self._pipeline(remove)
        replies = await self._pipeline(check)
        relist = [
            (worker_id, namespace.decode())
            for worker_id, alive, namespace in zip(
                worker_ids, replies[::2], replies[1::2], strict=True
            )
            if alive and namespace is not None
        ]
        if relist:

            def restore(pipe: AnyPipeline) -> None:
                for worker_id, namespace in relist:
                    self._list(pipe, worker_id, namespace, None)

            await self._pipeline(restore)

    async def _run(self, script: AsyncScript, keys: list[str], args: Sequence[Any]) -> Any:
        """One script call (redis-py loads the script again if the server lost it)."""
        return await script(keys=keys, args=args)

    def _queue(
        self, pipe: AnyPipeline, script: AsyncScript, keys: list[str], args: Sequence[Any]
    ) -> None:
        # NOTE: through execute_command: redis-py blocks the evalsha method in cluster pipelines
        # (it cannot load scripts there), and _pipeline loads them itself.
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    async def _pipeline(self, build: Callable[[AnyPipeline], None]) -> list[Any]:
        """Run what ``build`` queues as one pipeline (one per node on a cluster, sent at once).

        A server that lost its scripts (a restart, SCRIPT FLUSH) gets them again, and the
        pipeline runs once more: every queued command may run twice, so each must be
        idempotent."""
        try:
            return await self._execute(build)
        except NoScriptError:
            await self._load_scripts()
            return await self._execute(build)

    async def _execute(self, build: Callable[[AnyPipeline], None]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        build(pipe)
        return await keeping_cancel(pipe.execute())

    async def _load_scripts(self) -> None:
        # NOTE: on a cluster SCRIPT LOAD goes to every primary.
        for source in redis_scripts.ALL_SCRIPTS:
            await self._client.script_load(source)


def _ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, math.ceil(ttl_s * 1000))


def _events_to_args(events: Sequence[CacheEvent]) -> list[bytes | str | int]:
    """The events as APPLY's ARGV[2..]."""
    args: list[bytes | str | int] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            args.append("cleared")
        else:
            kind = "stored" if isinstance(event, BlockStored) else "removed"
            args += [kind, len(event.block_hashes), *event.block_hashes]
    return args


_INFO_FIELDS = (
    "address",
    "namespace",
    "block_size",
    "role",
    "num_blocks",
    "max_model_len",
    "block_hash",
    "block_hash_key_id",
    "degraded",
)


def _info_to_fields(info: WorkerInfo) -> list[str | int]:
    return [value for name in _INFO_FIELDS for value in (name, getattr(info, name))]


def _info_from_fields(worker_id: str, meta: dict[bytes, bytes]) -> WorkerInfo:
    fields = {name.decode(): value.decode() for name, value in meta.items()}
    return WorkerInfo(
        worker_id=worker_id,
        address=fields["address"],
        namespace=fields["namespace"],
        block_size=int(fields["block_size"]),
        role=fields["role"],
        num_blocks=int(fields["num_blocks"]),
        # NOTE: absent from a worker registered by an older kvswitch: unknown.
        max_model_len=int(fields.get("max_model_len", 0)),
        # NOTE: absent from a worker registered by an older kvswitch: it named blocks with xxh3.
        block_hash=fields.get("block_hash") or XXH3,
        block_hash_key_id=fields.get("block_hash_key_id", ""),
        degraded=fields.get("degraded", ""),
    )
