"""The behaviour every block-index backend shares: embedded, Redis and Redis Cluster alike.

``make_index`` (tests/cache_index/conftest.py) gives a fresh, empty index per test for each
backend; every test body runs in its own event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable

import pytest

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, WorkerInfo, reclaim_forever
from kvswitch.cache_index.memory_index import MemoryIndex
from tests.swallowing import SwallowsCancellationOnce

MakeIndex = Callable[[], Awaitable[BlockIndex]]
NS = "model-a"
TTL_S = 30.0
CHAIN = hash_prompt_blocks(list(range(64)), 4, NS)  # 16 blocks
OTHER = hash_prompt_blocks(list(range(100, 132)), 4, NS)  # 8 blocks, a different chain


def worker(worker_id: str, namespace: str = NS) -> WorkerInfo:
    return WorkerInfo(
        worker_id, f"127.0.0.1:{50000 + len(worker_id)}", namespace, 4, "both", 128, 2048
    )


def stored(hashes: list[bytes]) -> BlockStored:
    return BlockStored(tuple(hashes))


def leading_runs(held: dict[str, set[bytes]], chain: list[bytes]) -> dict[str, int]:
    """What match must answer: per worker, how many of the chain's leading blocks it holds."""
    result = {}
    for worker_id, hashes in held.items():
        n = 0
        while n < len(chain) and chain[n] in hashes:
            n += 1
        result[worker_id] = n
    return result


def run(make_index: MakeIndex, body: Callable[[BlockIndex], Awaitable[None]]) -> None:
    async def main() -> None:
        index = await make_index()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())


def test_match_counts_leading_blocks_per_worker(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        for worker_id in ("a", "b", "c"):
            await index.register(worker(worker_id), TTL_S)
        assert await index.apply("a", 1, [stored(CHAIN[:10])]) is ApplyStatus.APPLIED
        assert await index.apply("b", 1, [stored(CHAIN[:3]), stored(OTHER)]) is ApplyStatus.APPLIED
        # c holds blocks 1.. but not block 0: a hit must start at the chain's first block.
        assert await index.apply("c", 1, [stored(CHAIN[1:])]) is ApplyStatus.APPLIED
        assert await index.match(NS, CHAIN) == {"a": 10, "b": 3, "c": 0}
        assert await index.match(NS, CHAIN[:2]) == {"a": 2, "b": 2, "c": 0}
        assert await index.match(NS, OTHER) == {"a": 0, "b": 8, "c": 0}
        assert await index.match(NS, []) == {"a": 0, "b": 0, "c": 0}
        assert await index.match("model-b", CHAIN) == {}

    run(make_index, body)


def test_a_hole_in_a_chain_stops_the_match(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        await index.register(worker("a"), TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.apply("a", 2, [BlockRemoved((CHAIN[5],))])
        assert await index.match(NS, CHAIN) == {"a": 5}
        await index.apply("a", 3, [AllBlocksCleared(), stored(CHAIN[:2])])
        assert await index.match(NS, CHAIN) == {"a": 2}

    run(make_index, body)


def test_sequence_numbers_duplicates_and_gaps(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        await index.register(worker("a"), TTL_S)
        await index.register(worker("b"), TTL_S)
        assert await index.apply("a", 1, [stored(CHAIN[:4])]) is ApplyStatus.APPLIED
        # Applying a batch twice is harmless.
        assert await index.apply("a", 1, [stored(CHAIN[:8])]) is ApplyStatus.DUPLICATE
        assert await index.match(NS, CHAIN) == {"a": 4, "b": 0}
        # Batch 2 was lost: a is untrusted and left out until it resyncs.
        assert await index.apply("a", 3, [stored(CHAIN[:8])]) is ApplyStatus.NEEDS_RESYNC
        assert await index.match(NS, CHAIN) == {"b": 0}
        assert await index.apply("a", 2, [stored(CHAIN[:6])]) is ApplyStatus.NEEDS_RESYNC
        await index.resync("a", 7, CHAIN[:12])
        assert await index.match(NS, CHAIN) == {"a": 12, "b": 0}
        assert await index.apply("a", 7, [BlockRemoved((CHAIN[0],))]) is ApplyStatus.DUPLICATE
        assert await index.apply("a", 8, [BlockRemoved((CHAIN[11],))]) is ApplyStatus.APPLIED
        assert await index.match(NS, CHAIN) == {"a": 11, "b": 0}
        with pytest.raises(ValueError):
            await index.apply("a", 0, [])

    run(make_index, body)


def test_resync_replaces_entries_at_once(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        await index.register(worker("a"), TTL_S)
        await index.apply("a", 1, [stored(CHAIN), stored(OTHER)])
        await index.resync("a", 1, OTHER[:3])
        assert await index.match(NS, CHAIN) == {"a": 0}
        assert await index.match(NS, OTHER) == {"a": 3}
        await index.resync("a", 2, [])
        assert await index.match(NS, OTHER) == {"a": 0}
        assert (await index.stats()).num_entries == 0

    run(make_index, body)


def test_lookups_during_a_large_resync_never_claim_a_dropped_block(make_index: MakeIndex) -> None:
    """Until a snapshot of 20,000 blocks is whole, the worker claims no block it dropped (here
    in a batch the index never got); the others' answers never change. (That lookups are
    answered between the snapshot's slices is pinned per backend: test_memory_index.py,
    test_redis_index.py.)"""
    rng = random.Random(5)
    snapshot = CHAIN[:4] + [rng.randbytes(16) for _ in range(20_000)]

    async def body(index: BlockIndex) -> None:
        for worker_id in ("a", "b"):
            await index.register(worker(worker_id), TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.apply("b", 1, [stored(CHAIN[:8])])
        # Batch 2, which removed CHAIN[4:], was lost: batch 3 finds the gap.
        assert await index.apply("a", 3, [stored(snapshot[4:8])]) is ApplyStatus.NEEDS_RESYNC
        resync = asyncio.create_task(index.resync("a", 5, snapshot))
        while not resync.done():
            matches = await index.match(NS, CHAIN)
            assert matches.get("a", 0) <= 4 and matches["b"] == 8, matches
            await asyncio.sleep(0)  # the embedded index answers without suspending
        await resync
        assert await index.match(NS, CHAIN) == {"a": 4, "b": 8}
        assert (await index.stats()).num_entries == len(snapshot) + 8
        assert await index.apply("a", 6, [stored(OTHER)]) is ApplyStatus.APPLIED

    run(make_index, body)


def test_unknown_and_reregistered_workers(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        assert await index.apply("ghost", 1, [stored(CHAIN)]) is ApplyStatus.UNKNOWN_WORKER
        assert await index.heartbeat("ghost", TTL_S) is False
        await index.register(worker("a"), TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.apply("a", 2, [stored(OTHER)])
        # A restarted worker registers again and starts empty, its sequence from 1.
        await index.register(worker("a"), TTL_S)
        assert await index.match(NS, CHAIN) == {"a": 0}
        assert await index.apply("a", 1, [stored(CHAIN[:2])]) is ApplyStatus.APPLIED
        assert await index.match(NS, CHAIN) == {"a": 2}
        await index.deregister("a")
        assert await index.match(NS, CHAIN) == {}
        assert await index.live_workers() == []
        await index.deregister("a")  # twice is fine

    run(make_index, body)


def test_lapsed_workers_leave_match_at_once_and_are_reclaimed(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        await index.register(worker("short"), 0.3)
        await index.register(worker("long"), TTL_S)
        await index.apply("short", 1, [stored(CHAIN)])
        await index.apply("long", 1, [stored(CHAIN[:2])])
        assert await index.heartbeat("short", 0.3) is True
        assert await index.match(NS, CHAIN) == {"short": 16, "long": 2}
        await asyncio.sleep(0.5)
        assert await index.match(NS, CHAIN) == {"long": 2}
        assert [w.worker_id for w in await index.live_workers()] == ["long"]
        assert await index.heartbeat("short", TTL_S) is False
        assert await index.apply("short", 2, [stored(OTHER)]) is ApplyStatus.UNKNOWN_WORKER
        assert await index.reclaim_expired() == 1
        stats = await index.stats()
        assert (stats.num_workers, stats.num_entries) == (1, 2)

    run(make_index, body)


def test_workers_by_namespace_and_stats(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        await index.register(worker("a"), TTL_S)
        # An engine whose events were lost past replay is registered degraded, and read so.
        degraded = dataclasses.replace(
            worker("z", namespace="model-b"), degraded="batches 1..2 were lost"
        )
        await index.register(degraded, TTL_S)
        await index.apply("a", 1, [stored(CHAIN)])
        await index.apply("z", 1, [stored(OTHER)])
        assert [w.worker_id for w in await index.live_workers()] == ["a", "z"]
        assert await index.live_workers("model-b") == [degraded]
        assert await index.match("model-b", OTHER) == {"z": 8}
        assert await index.worker_block_hashes("z") == set(OTHER)
        assert await index.worker_block_hashes("nobody") == set()
        stats = await index.stats()
        assert (stats.num_workers, stats.num_entries) == (2, 24)
        assert stats.memory_bytes >= 24 * 16

    run(make_index, body)


def test_replaying_a_worker_event_stream_matches_its_pool() -> None:
    """The events a real block pool emits, applied in batches, describe its cache exactly."""
    from kvswitch.cache_index.hashing import BlockHasher
    from kvswitch.worker.kv_cache_manager import KVCacheManager
    from kvswitch.worker.request import Request
    from tests.worker.driver import admit

    async def main() -> None:
        index = MemoryIndex()
        await index.register(WorkerInfo("w", "x:1", NS, 4), TTL_S)
        manager = KVCacheManager(num_blocks=12, block_size=4)
        hasher = BlockHasher(NS, 4)
        for seq, i in enumerate(range(6), start=1):
            request = Request(f"r{i}", [i % 2, *range(i, i + 17)], hasher)
            admit(manager, request)
            manager.free(request)
            assert await index.apply("w", seq, manager.take_events()) is ApplyStatus.APPLIED
            chain = request.block_hashes
            num_cached = 0
            while num_cached < len(chain) and manager.pool.get_cached_block(chain[num_cached]):
                num_cached += 1
            assert await index.match(NS, chain) == {"w": num_cached}

    asyncio.run(main())


def test_lapsed_entries_are_reclaimed_in_the_background(make_index: MakeIndex) -> None:
    async def body(index: BlockIndex) -> None:
        await index.register(worker("gone"), 0.2)
        await index.apply("gone", 1, [stored(CHAIN)])
        reclaimer = asyncio.create_task(reclaim_forever(index, 0.05))
        await asyncio.sleep(0.6)  # the TTL, then several reclaim rounds
        reclaimer.cancel()
        # The background task already did it: nothing is left to reclaim.
        assert await index.reclaim_expired() == 0
        assert (await index.stats()).num_entries == 0

    run(make_index, body)


def test_the_reclaimer_stops_even_if_the_index_swallows_its_cancellation() -> None:
    """A client library may turn the task's cancellation into an error the loop retries on."""

    class SwallowingIndex(MemoryIndex):
        def __init__(self) -> None:
            super().__init__()
            self.hang = SwallowsCancellationOnce(TimeoutError("the cancellation, made a timeout"))

        async def reclaim_expired(self) -> int:
            await self.hang()
            return 0

    async def main() -> None:
        index = SwallowingIndex()
        reclaimer = asyncio.create_task(reclaim_forever(index, 0.001))
        await asyncio.wait_for(index.hang.entered.wait(), 5)
        reclaimer.cancel()
        done, _ = await asyncio.wait([reclaimer], timeout=2)
        assert done, "the reclaimer went on after its cancellation"
        assert reclaimer.cancelled()

    asyncio.run(main())


def test_match_agrees_with_each_workers_set_through_random_changes(make_index: MakeIndex) -> None:
    """Workers come, go, store, evict, clear and resync over chains that share prefixes; every
    lookup must give each worker the run of leading blocks it holds."""
    rng = random.Random(11)
    chains = [
        hash_prompt_blocks([rng.randrange(2) for _ in range(4 * 12)], 4, NS) for _ in range(6)
    ]
    held: dict[str, set[bytes]] = {}
    seqs: dict[str, int] = {}

    async def body(index: BlockIndex) -> None:
        for _ in range(150):
            worker_id = f"w{rng.randrange(4)}"
            chain = rng.choice(chains)
            action = rng.random()
            if worker_id not in held or action < 0.05:
                await index.register(worker(worker_id), TTL_S)
                held[worker_id], seqs[worker_id] = set(), 0
            elif action < 0.1:
                await index.deregister(worker_id)
                del held[worker_id]
            elif action < 0.15:
                snapshot = set(rng.sample(chain, rng.randrange(len(chain))))
                await index.resync(worker_id, seqs[worker_id], snapshot)
                held[worker_id] = snapshot
            else:
                start = rng.randrange(len(chain))
                end = rng.randrange(start, len(chain)) + 1
                if action < 0.6:
                    event = stored(chain[start:end])
                    held[worker_id].update(chain[start:end])
                elif action < 0.97:
                    event = BlockRemoved(tuple(chain[start:end]))
                    held[worker_id].difference_update(chain[start:end])
                else:
                    event = AllBlocksCleared()
                    held[worker_id].clear()
                seqs[worker_id] += 1
                status = await index.apply(worker_id, seqs[worker_id], [event])
                assert status is ApplyStatus.APPLIED
            lookup = rng.choice(chains)[: rng.randrange(1, 13)]
            assert await index.match(NS, lookup) == leading_runs(held, lookup)

    run(make_index, body)


def test_match_is_exact_for_a_fleet_of_many_slots(make_index: MakeIndex) -> None:
    """Seventy workers fill slots past 32 and 64 (the single-Redis map's bitmaps span words, the
    top bit of a word included), with gaps where workers left; each holds a random run of the
    chain and blocks beyond a hole. Every lookup gives each worker exactly its leading run."""
    rng = random.Random(5)
    chain = hash_prompt_blocks(list(range(4 * 40)), 4, NS)  # 40 blocks
    held: dict[str, set[bytes]] = {}

    async def body(index: BlockIndex) -> None:
        for k in range(70):
            worker_id = f"w{k}"
            await index.register(worker(worker_id), TTL_S)
            hashes = set(chain[: rng.randrange(len(chain) + 1)])
            hashes.update(rng.sample(chain, rng.randrange(6)))
            held[worker_id] = hashes
            if hashes:
                await index.apply(worker_id, 1, [stored(sorted(hashes))])
        for k in rng.sample(range(70), 9):
            await index.deregister(f"w{k}")
            del held[f"w{k}"]
        for length in (1, 2, 9, 31, 40):
            assert await index.match(NS, chain[:length]) == leading_runs(held, chain[:length])

    run(make_index, body)
