"""``kvswitch bench index``: lookup latency, event ingestion and memory of the block index.

The fleet: 8 workers of one model, each holding a different-length prefix of one 8,192-token
prompt (512 blocks of 16: worker k holds the first 64 * (k + 1) blocks) plus unrelated chains of
its own. A lookup is one ``match`` of the prompt's 512-block chain. Ingestion is one publisher
applying event batches in order, each batch storing 64 blocks and removing 64 (128 block events),
awaiting each batch as a worker's publisher does. The redis backends start their own servers.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvswitch.benchmarks.timing import machine_info
from kvswitch.cache_index.connect import connect_index
from kvswitch.cache_index.events import BlockRemoved, BlockStored
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import BlockIndex, WorkerInfo
from kvswitch.cache_index.local_redis import LocalRedis, LocalRedisCluster

BACKENDS = ("memory", "redis", "cluster")


@dataclass(frozen=True)
class IndexBenchConfig:
    backend: str = "memory"
    num_workers: int = 8
    num_prompt_tokens: int = 8192
    block_size: int = 16
    num_other_blocks: int = 2048  # unrelated blocks per worker
    num_lookups: int = 2000
    num_event_batches: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_workers <= 0 or self.num_lookups <= 0 or self.num_event_batches <= 0:
            raise ValueError("num_workers, num_lookups and num_event_batches must be positive")


def _random_hashes(rng: np.random.Generator, n: int) -> list[bytes]:
    data = rng.bytes(16 * n)
    return [data[i : i + 16] for i in range(0, len(data), 16)]


async def _measure(index: BlockIndex, config: IndexBenchConfig) -> dict:
    rng = np.random.default_rng(config.seed)
    namespace = "bench-model"
    tokens = rng.integers(0, 32000, config.num_prompt_tokens, dtype=np.uint32)
    chain = hash_prompt_blocks(tokens, config.block_size, namespace)
    step = max(len(chain) // config.num_workers, 1)
    for k in range(config.num_workers):
        worker_id = f"worker-{k}"
        await index.register(
            WorkerInfo(worker_id, f"127.0.0.1:{50100 + k}", namespace, config.block_size), 600
        )
        held = chain[: step * (k + 1)] + _random_hashes(rng, config.num_other_blocks)
        await index.apply(worker_id, 1, [BlockStored(tuple(held))])
    expected = {f"worker-{k}": min(step * (k + 1), len(chain)) for k in range(config.num_workers)}
    if await index.match(namespace, chain) != expected:
        raise RuntimeError("the index answered a wrong match; figures would be meaningless")

    latencies_ms = []
    for _ in range(config.num_lookups):
        start = time.perf_counter()
        await index.match(namespace, chain)
        latencies_ms.append((time.perf_counter() - start) * 1e3)
    latencies_ms.sort()
    print(f"  lookup p50 {statistics.median(latencies_ms):.3f} ms", file=sys.stderr)

    # Ingestion: one publisher, batches in order.
    publisher = "publisher"
    await index.register(WorkerInfo(publisher, "127.0.0.1:1", namespace, config.block_size), 600)
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
    print(f"  ingestion {events_per_s:,.0f} block events/s", file=sys.stderr)
    await index.deregister(publisher)

    stats = await index.stats()
    return {
        "lookup_p50_ms": statistics.median(latencies_ms),
        "lookup_p99_ms": latencies_ms[int(0.99 * (len(latencies_ms) - 1))],
        "events_per_s": events_per_s,
        "bytes_per_entry": stats.memory_bytes / stats.num_entries,
        "num_entries": stats.num_entries,
    }


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
            return await _measure(index, config)
        finally:
            await index.close()

    try:
        figures = asyncio.run(main())
    finally:
        if server is not None:
            server.stop()
    return {**figures, "backend": config.backend, "machine": machine_info()}
