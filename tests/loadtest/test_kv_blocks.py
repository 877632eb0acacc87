"""The simulator's block tables against the worker's KV cache manager: on the same operations
they hit the same blocks, take the same blocks and leave the free queue in the same order."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.loadtest.kv_blocks import BlockTable, KVBlocks
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request

B = 4
NUM_BLOCKS = 24
HASHER = BlockHasher("sim-model", block_size=B)
DOCUMENTS = [list(range(100 * d, 100 * d + 4 * B)) for d in range(3)]


@dataclass
class Live:
    request: Request
    hashes: list[bytes]
    table: BlockTable
    num_computed: int


def check_same(manager: KVCacheManager, blocks: KVBlocks, live: list[Live], seen: set) -> None:
    assert manager.pool.free_queue.block_ids() == blocks.pool.free_queue.block_ids()
    for entry in live:
        ids = [b.block_id for b in entry.table.blocks]
        assert manager.get_block_ids(entry.request.request_id) == ids
    for block_hash in seen:
        real = manager.pool.get_cached_block(block_hash)
        sim = blocks.pool.get_cached_block(block_hash)
        assert (real and real.block_id) == (sim and sim.block_id)


def computed(entry: Live, num_computed: int, next_output: int) -> int:
    """The step ran: once every known token is in, it samples the next (a fresh token id)."""
    entry.num_computed = entry.request.num_computed_tokens = num_computed
    if num_computed == entry.request.num_tokens:
        entry.request.append_token(next_output)
        next_output += 1
    return next_output


@pytest.mark.parametrize("seed", range(6))
def test_the_same_operations_leave_the_same_pool(seed: int) -> None:
    rng = random.Random(seed)
    manager = KVCacheManager(NUM_BLOCKS, B)
    blocks = KVBlocks(NUM_BLOCKS, B)
    live: list[Live] = []
    seen: set[bytes] = set()
    next_output = 10_000  # output tokens never appear in a prompt
    num_hits = num_refused = 0
    for step in range(400):
        action = rng.random()
        if action < 0.3 or not live:  # admit a new request with its first chunk
            document = rng.choice(DOCUMENTS)[: rng.randint(0, 4 * B)]
            tail = [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 2 * B))]
            request = Request(f"r{step}", document + tail, HASHER)
            hashes = list(request.block_hashes)
            seen.update(hashes)
            hit, num_cached = manager.get_computed_blocks(request)
            sim_hit = blocks.lookup(hashes, request.num_tokens)
            assert [b.block_id for b in sim_hit] == [b.block_id for b in hit]
            num_new = min(request.num_tokens - num_cached, rng.randint(1, 3 * B))
            ok = manager.allocate_slots(request, num_new, hit) is not None
            table = BlockTable()
            assert blocks.allocate(table, hashes, num_cached + num_new, sim_hit) == ok
            if ok:
                num_hits += bool(hit)
                live.append(Live(request, hashes, table, 0))
                next_output = computed(live[-1], num_cached + num_new, next_output)
            else:
                num_refused += 1
        elif action < 0.85:  # a step of a running request: its next chunk, or a decode
            entry = rng.choice(live)
            request = entry.request
            # A decode computes the newest token, whose KV is not in yet.
            num_new = min(request.num_tokens - entry.num_computed, rng.randint(1, 3 * B))
            ok = manager.allocate_slots(request, num_new) is not None
            assert blocks.allocate(entry.table, entry.hashes, entry.num_computed + num_new) == ok
            if ok:
                next_output = computed(entry, entry.num_computed + num_new, next_output)
            else:  # preempted
                manager.free(request)
                blocks.free(entry.table)
                live.remove(entry)
        else:  # finish one
            entry = live.pop(rng.randrange(len(live)))
            manager.free(entry.request)
            blocks.free(entry.table)
        check_same(manager, blocks, live, seen)
    # The run exercised hits, refusals and eviction.
    assert num_hits > 10 and num_refused > 0
    assert len(seen) > NUM_BLOCKS
