"""``kvswitch bench index``: lookup latency, event ingestion and memory of the block index, and
what a large resync does to lookups and to the other workers' liveness.

The fleet: ``num_workers`` workers of one model, each holding a different-length prefix of one
8,192-token prompt (512 blocks of 16: with 8 workers, worker k holds the first 64 * (k + 1)
blocks) plus its share of ``num_other_blocks`` unrelated blocks. A lookup is one ``match`` of the
prompt's 512-block chain. While lookups are timed every worker heartbeats as its publisher would
(``heartbeat_s``, registrations lapsing after ``ttl_s``).

With ``resync_blocks``, one more worker holds that many blocks, loses a batch, and resyncs a
snapshot of as many (half of them new) while lookups go on: ``lookup_p99_during_resync_ms``, and
the longest the lookups' event loop went without a turn, ``loop_stall_max_during_resync_ms``. For
the Redis backends the resync comes from a process of its own, as it does from a worker; the
embedded index takes it on the lookups' own event loop, as a router does. A worker is dropped
if a heartbeat of it was refused or a lookup left it out.

Ingestion is one publisher applying event batches in order, each batch storing 64 blocks and
removing 64 (128 block events), awaiting each batch as a worker's publisher does. The Redis
backends start their own servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.events import BlockRemoved, BlockStored
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis, LocalRedisCluster
from kvswitch.serving import cancel_and_wait

BACKENDS = ("memory", "redis", "redis-cluster", "cluster")  # cluster: redis-cluster's old name
NAMESPACE = "bench-model"
RESYNCING = "resyncing"  # the worker that resyncs
LOAD_SLICE = 8192  # blocks per apply while the fleet's blocks are loaded
PROCESS_EXIT_S = 10.0  # the resyncing process's time to end once its part is done


@dataclass(frozen=True)
class IndexBenchConfig:
    backend: str = "memory"
    num_workers: int = 8
    num_prompt_tokens: int = 8192
    block_size: int = 16
    num_other_blocks: int = 16384  # unrelated blocks over the whole fleet, spread evenly
    resync_blocks: int = 0  # > 0: one more worker resyncs this many blocks during lookups
    num_lookups: int = 2000
    num_event_batches: int = 500
    heartbeat_s: float = 0.5
    ttl_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_workers <= 0 or self.num_lookups <= 0 or self.num_event_batches <= 0:
            raise ValueError("num_workers, num_lookups and num_event_batches must be positive")
        if self.num_other_blocks < 0 or self.resync_blocks < 0:
            raise ValueError("num_other_blocks and resync_blocks must be >= 0")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError("heartbeat_s and ttl_s must satisfy 0 < heartbeat_s < ttl_s")


def _random_hashes(rng: np.random.Generator, n: int) -> list[bytes]:
    data = rng.bytes(16 * n)
    return [data[i : i + 16] for i in range(0, len(data), 16)]


def _resync_sets(config: IndexBenchConfig) -> tuple[list[bytes], list[bytes]]:
    """What the resyncing worker holds at first, and its snapshot: half the same, half new."""
    rng = np.random.default_rng(config.seed + 1)
    held = _random_hashes(rng, config.resync_blocks)
    half = config.resync_blocks // 2
    return held, held[:half] + _random_hashes(rng, config.resync_blocks - half)


@dataclass
class _Fleet:
    """The fleet's liveness, as its publishers' heartbeats and the lookups see it."""

    config: IndexBenchConfig
    worker_ids: list[str]
    dropped: set[str] = field(default_factory=set)
    num_busy: int = 0

    def note_error(self, error: Exception) -> None:
        if "BUSY" in str(error):
            self.num_busy += 1

    async def heartbeat_forever(self, index: BlockIndex, worker_id: str) -> None:
        while True:
            try:
                if not await index.heartbeat(worker_id, self.config.ttl_s):
                    self.dropped.add(worker_id)
            except index.unavailable_errors as e:
                self.note_error(e)
            await asyncio.sleep(self.config.heartbeat_s)

    async def timed_lookups(
        self, index: BlockIndex, chain: list[bytes], until: asyncio.Future | int
    ) -> list[float]:
        """Lookup latencies, for ``until`` lookups or until the future is done (at least one)."""
        latencies_ms: list[float] = []
        num_tries = 0

        def more() -> bool:
            if isinstance(until, int):
                return len(latencies_ms) < until
            return num_tries == 0 or not until.done()

        while more():
            num_tries += 1
            start = time.perf_counter()
            try:
                matches = await index.match(NAMESPACE, chain)
            except index.unavailable_errors as e:
                self.note_error(e)
                continue
            latencies_ms.append((time.perf_counter() - start) * 1e3)
            self.dropped.update(w for w in self.worker_ids if w not in matches)
            await asyncio.sleep(0)  # the embedded index answers without suspending
        return latencies_ms


async def _load(index: BlockIndex, config: IndexBenchConfig, chain: list[bytes]) -> list[str]:
    rng = np.random.default_rng(config.seed)
    step = max(len(chain) // config.num_workers, 1)
    worker_ids = []
    for k in range(config.num_workers):
        worker_id = f"worker-{k}"
        worker_ids.append(worker_id)
        info = WorkerInfo(worker_id, f"127.0.0.1:{50100 + k}", NAMESPACE, config.block_size)
        await index.register(info, 600)  # heartbeats with ttl_s start once all are loaded
        num_other = config.num_other_blocks // config.num_workers
        num_other += k < config.num_other_blocks % config.num_workers
        held = chain[: step * (k + 1)] + _random_hashes(rng, num_other)
        for seq, start in enumerate(range(0, len(held), LOAD_SLICE), start=1):
            batch = [BlockStored(tuple(held[start : start + LOAD_SLICE]))]
            await index.apply(worker_id, seq, batch)
        if k % 8 == 7 or k == config.num_workers - 1:
            print(f"  loaded {k + 1} workers", file=sys.stderr)
    return worker_ids


async def _ingestion(index: BlockIndex, config: IndexBenchConfig) -> float:
    """Block events per second of one publisher's batches, applied in order."""
    rng = np.random.default_rng(config.seed + 2)
    publisher = "publisher"
    await index.register(WorkerInfo(publisher, "127.0.0.1:1", NAMESPACE, config.block_size), 600)
    batches = []
    previous: list[bytes] = []
    for _ in range(config.num_event_batches):
        new = _random_hashes(rng, 64)
        events = [BlockStored(tuple(new))]
        if previous:
            events.append(BlockRemoved(tuple(previous)))
        batches.append(events)
        previous = new
    num_block_events = sum(len(e.block_hashes) for events in batches for e in events)
    start = time.perf_counter()
    for seq, events in enumerate(batches, start=1):
        await index.apply(publisher, seq, events)
    events_per_s = num_block_events / (time.perf_counter() - start)
    await index.deregister(publisher)
    return events_per_s


async def _prepare_resync(index: BlockIndex, config: IndexBenchConfig) -> list[bytes]:
    """Registers the resyncing worker with its first set, then loses a batch: it is untrusted
    until its snapshot is in. Returns the snapshot."""
    held, snapshot = _resync_sets(config)
    info = WorkerInfo(RESYNCING, "127.0.0.1:2", NAMESPACE, config.block_size)
    await index.register(info, 600)  # its heartbeats start with the resync
    seq = 0
    for seq, start in enumerate(range(0, len(held), LOAD_SLICE), start=1):
        await index.apply(RESYNCING, seq, [BlockStored(tuple(held[start : start + LOAD_SLICE]))])
    status = await index.apply(RESYNCING, seq + 2, [])
    assert status is ApplyStatus.NEEDS_RESYNC, status
    return snapshot


def _resync_in_a_process(url: str, config: IndexBenchConfig, ready, go, done) -> None:
    """A worker's publisher: connects, says ``ready``, waits for ``go``, resyncs, sets
    ``done``."""

    async def main() -> None:
        index = await connect_index(url, prefix="bench")
        _, snapshot = _resync_sets(config)
        ready.set()
        go.wait()
        await index.resync(RESYNCING, 10**6, snapshot)
        done.set()
        await index.close()

    asyncio.run(main())


async def _measure(index: BlockIndex, config: IndexBenchConfig, url: str) -> dict:
    rng = np.random.default_rng(config.seed)
    tokens = rng.integers(0, 32000, config.num_prompt_tokens, dtype=np.uint32)
    chain = hash_prompt_blocks(tokens, config.block_size, NAMESPACE)
    print(f"loading {config.num_workers} workers ...", file=sys.stderr)
    worker_ids = await _load(index, config, chain)
    step = max(len(chain) // config.num_workers, 1)
    expected = {w: min(step * (k + 1), len(chain)) for k, w in enumerate(worker_ids)}
    if await index.match(NAMESPACE, chain) != expected:
        raise RuntimeError("the index answered a wrong match; figures would be meaningless")
    fleet = _Fleet(config, worker_ids)
    heartbeats = [asyncio.create_task(fleet.heartbeat_forever(index, w)) for w in worker_ids]
    figures: dict = {}
    try:
        latencies_ms = sorted(await fleet.timed_lookups(index, chain, config.num_lookups))
        figures |= _percentiles(latencies_ms)
        print(f"  lookup p50 {figures['lookup_p50_ms']:.3f} ms", file=sys.stderr)
        if config.resync_blocks:
            figures |= await _during_resync(index, config, url, fleet, chain)
    finally:
        for task in heartbeats:
            task.cancel()
        await asyncio.gather(*heartbeats, return_exceptions=True)
    figures["workers_dropped"] = len(fleet.dropped)
    figures["busy_errors"] = fleet.num_busy
    stats = await index.stats()
    figures["bytes_per_entry"] = stats.memory_bytes / stats.num_entries
    figures["num_entries"] = stats.num_entries
    figures["events_per_s"] = await _ingestion(index, config)
    print(f"  ingestion {figures['events_per_s']:,.0f} block events/s", file=sys.stderr)
    return figures


async def _during_resync(
    index: BlockIndex, config: IndexBenchConfig, url: str, fleet: _Fleet, chain: list[bytes]
) -> dict:
    print(f"resyncing {config.resync_blocks:,} blocks during lookups ...", file=sys.stderr)
    snapshot = await _prepare_resync(index, config)
    heartbeat = asyncio.create_task(fleet.heartbeat_forever(index, RESYNCING))
    stalls_ms: list[float] = []
    ticker = asyncio.create_task(_time_loop_stalls(stalls_ms))
    try:
        latencies_ms, resync_s = await _timed_resync(index, config, url, fleet, chain, snapshot)
        await asyncio.sleep(0.005)  # the ticker's turn, if the resync held the loop until now
    finally:
        await cancel_and_wait([heartbeat, ticker])
    if (await index.match(NAMESPACE, snapshot[:1])).get(RESYNCING) != 1:
        raise RuntimeError("the snapshot is not in the index after the resync")
    latencies_ms.sort()
    print(
        f"  resync {resync_s:.2f} s; {len(latencies_ms)} lookups meanwhile, p99 "
        f"{latencies_ms[int(0.99 * (len(latencies_ms) - 1))] if latencies_ms else 0:.3f} ms",
        file=sys.stderr,
    )
    return {
        **_percentiles(latencies_ms, "_during_resync"),
        "num_lookups_during_resync": len(latencies_ms),
        "resync_s": resync_s,
        # The longest the event loop of the lookups went without a turn: for the embedded index
        # it is the router's own loop, held while a resync runs in one piece.
        "loop_stall_max_during_resync_ms": max(stalls_ms, default=0.0),
    }


async def _timed_resync(
    index: BlockIndex,
    config: IndexBenchConfig,
    url: str,
    fleet: _Fleet,
    chain: list[bytes],
    snapshot: list[bytes],
) -> tuple[list[float], float]:
    """The lookups' latencies while the resyncing worker sends its snapshot (from this loop for
    the embedded index, else from a process of its own), and how long the resync took."""
    if config.backend == "memory":
        start = time.perf_counter()
        resync: asyncio.Future = asyncio.ensure_future(index.resync(RESYNCING, 10**6, snapshot))
        latencies_ms = await fleet.timed_lookups(index, chain, resync)
        await resync
        return latencies_ms, time.perf_counter() - start
    spawn = multiprocessing.get_context("spawn")
    ready, go, done = spawn.Event(), spawn.Event(), spawn.Event()
    process = spawn.Process(target=_resync_in_a_process, args=(url, config, ready, go, done))
    process.start()
    try:
        await _set_by(process, ready)
        go.set()
        start = time.perf_counter()
        resync = asyncio.ensure_future(_set_by(process, done))
        latencies_ms = await fleet.timed_lookups(index, chain, resync)
        await resync
        resync_s = time.perf_counter() - start
    finally:
        await asyncio.get_running_loop().run_in_executor(None, process.join, PROCESS_EXIT_S)
        if process.exitcode is None:  # the lookups failed while it waited for its turn
            process.kill()
            process.join()
    if process.exitcode:
        raise RuntimeError(f"the resyncing process failed ({process.exitcode})")
    return latencies_ms, resync_s


async def _set_by(process: multiprocessing.process.BaseProcess, event: Any) -> None:
    """Returns once ``process`` sets ``event``; RuntimeError if it ends without."""
    while not await asyncio.to_thread(event.wait, 0.1):
        if process.exitcode is not None:
            raise RuntimeError(f"the resyncing process ended ({process.exitcode}) before its turn")


async def _time_loop_stalls(stalls_ms: list[float]) -> None:
    """Every millisecond or so, how much later than asked this loop got its turn."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(0.001)
        stalls_ms.append((loop.time() - asked - 0.001) * 1e3)


def _percentiles(latencies_ms: list[float], suffix: str = "") -> dict[str, float | None]:
    """``lookup_p50_ms``, ``lookup_p99_ms`` and ``lookup_max_ms``, with ``suffix`` before
    ``_ms`` (``lookup_p99_during_resync_ms``); None where no lookup was timed."""
    names = [f"lookup_{q}{suffix}_ms" for q in ("p50", "p99", "max")]
    if not latencies_ms:
        return dict.fromkeys(names)
    p99 = latencies_ms[int(0.99 * (len(latencies_ms) - 1))]
    return dict(zip(names, (statistics.median(latencies_ms), p99, latencies_ms[-1]), strict=True))


def run(config: IndexBenchConfig) -> dict:
    server: LocalRedis | LocalRedisCluster | None = None
    if config.backend == "memory":
        url = "memory://"
    elif config.backend == "redis":
        server = LocalRedis().start()
        url = server.url
    else:
        server = LocalRedisCluster().start()
        url = server.url.replace("redis://", "redis+cluster://")

    async def main() -> dict:
        index = await connect_index(url, prefix="bench")
        try:
            return await _measure(index, config, url)
        finally:
            await index.close()

    try:
        figures = asyncio.run(main())
    finally:
        if server is not None:
            server.stop()
    return {
        **figures,
        "backend": config.backend,
        "config": dataclasses.asdict(config),
        "machine": machine_info(),
    }
