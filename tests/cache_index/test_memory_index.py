"""What only the embedded index has: it shares the router's event loop, so its long calls
yield to it. The shared behaviour is in test_index_contract.py."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kvswitch.cache_index import memory_index
from kvswitch.cache_index.events import AllBlocksCleared, BlockStored
from kvswitch.cache_index.hashing import hash_prompt_blocks
from kvswitch.cache_index.index import ApplyStatus, WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex

NS = "model-a"
CHAIN = hash_prompt_blocks(list(range(64)), 4, NS)  # 16 blocks


def worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "127.0.0.1:50051", NS, 4)


def many_hashes(n: int, salt: int) -> list[bytes]:
    return [(salt << 64 | i).to_bytes(16, "big") for i in range(n)]


async def count_turns_until(task: asyncio.Task, index: MemoryIndex) -> int:
    """How many times this loop got a turn, and the other worker matched in full, before
    ``task`` finished."""
    num_turns = 0
    while not task.done():
        assert (await index.match(NS, CHAIN))["b"] == len(CHAIN)
        num_turns += 1
        await asyncio.sleep(0)
    await task
    return num_turns


def test_a_large_resync_and_the_sets_it_retires_yield_to_the_loop_between_slices() -> None:
    num_slices = 5
    snapshot = many_hashes(num_slices * memory_index.SLICE, salt=1)

    async def main() -> None:
        index = MemoryIndex()
        for worker_id in ("a", "b"):
            await index.register(worker(worker_id), 30.0)
        await index.apply("b", 1, [BlockStored(tuple(CHAIN))])
        # The snapshot goes in a slice at a time, lookups answered in between ...
        resync = asyncio.create_task(index.resync("a", 1, snapshot))
        assert await count_turns_until(resync, index) >= num_slices - 1
        assert (await index.match(NS, snapshot))["a"] == len(snapshot)
        # ... and so does clearing the set a new incarnation leaves behind.
        register = asyncio.create_task(index.register(worker("a"), 30.0))
        assert await count_turns_until(register, index) >= num_slices - 1
        assert (await index.stats()).num_entries == len(CHAIN)
        assert index._hash_to_workers.keys() == set(CHAIN)  # every bit of a's old set cleared

    asyncio.run(main())


def test_a_register_during_a_resync_supersedes_it_and_leaves_nothing_behind() -> None:
    snapshot = many_hashes(3 * memory_index.SLICE, salt=2)

    async def main() -> None:
        index = MemoryIndex()
        await index.register(worker("a"), 30.0)
        resync = asyncio.create_task(index.resync("a", 7, snapshot))
        await asyncio.sleep(0)  # the first slice is in
        await index.register(worker("a"), 30.0)  # a restarted worker
        with pytest.raises(KeyError, match="not registered"):
            await resync
        assert await index.match(NS, snapshot) == {"a": 0}
        assert index._hash_to_workers == {}  # the stale snapshot's bits are cleared
        assert await index.apply("a", 1, [AllBlocksCleared()]) is ApplyStatus.APPLIED

    asyncio.run(main())


def _entries_the_collector_walks() -> int:
    """How many references the garbage collector follows in a full collection's containers."""
    gc.collect()
    return sum(len(gc.get_referents(o)) for o in gc.get_objects())


def test_held_blocks_add_nothing_for_the_garbage_collector_to_walk() -> None:
    """The index lives in the router's process: every block the collector had to visit on each
    full collection would hold the router's loop (40 ms a million blocks). Blocks taken in by
    events, by a resync and by a clear must leave nothing per block for it to walk."""
    stored, snapshot, more = many_hashes(20_000, 1), many_hashes(20_000, 2), many_hashes(5_000, 3)

    async def main() -> int:
        index = MemoryIndex()
        before = _entries_the_collector_walks()
        for worker_id in ("a", "b"):
            await index.register(worker(worker_id), 60)
        assert await index.apply("a", 1, [BlockStored(tuple(stored))]) is ApplyStatus.APPLIED
        await index.resync("b", 5, snapshot)
        events = [AllBlocksCleared(), BlockStored(tuple(more))]
        assert await index.apply("b", 6, events) is ApplyStatus.APPLIED
        assert (await index.stats()).num_entries == len(stored) + len(more)
        return _entries_the_collector_walks() - before

    assert asyncio.run(main()) < 1_000
