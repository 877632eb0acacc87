"""The worked examples of the prefix-caching design document, block id by block id."""

from __future__ import annotations

from kvswitch.cache_index.events import BlockRemoved, BlockStored, replay
from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request
from tests.worker.driver import admit, decode

HASHER = BlockHasher("seed-model", block_size=4)


def cached_ids(manager: KVCacheManager) -> list[int]:
    return sorted(b.block_id for b in manager.pool.blocks if b.block_hash is not None)


def free_ids(manager: KVCacheManager) -> list[int]:
    return manager.pool.free_queue.block_ids()


def test_duplicated_blocks() -> None:
    """Block size 4, prompt ABCDEF decoding GHI, sent twice: E-H ends up cached twice."""
    A, B, C, D, E, F, G, H, I = range(100, 109)  # noqa: E741 (the document's letters)
    manager = KVCacheManager(num_blocks=10, block_size=4)

    r1 = Request("r1", [A, B, C, D, E, F], HASHER)
    assert admit(manager, r1) == []
    decode(manager, r1, G)  # Time 0
    assert manager.get_block_ids("r1") == [0, 1]
    assert cached_ids(manager) == [0]
    decode(manager, r1, H)  # Time 1
    assert manager.get_block_ids("r1") == [0, 1]
    assert cached_ids(manager) == [0, 1]
    decode(manager, r1, I)  # Time 2
    assert manager.get_block_ids("r1") == [0, 1, 2]
    assert cached_ids(manager) == [0, 1]

    r2 = Request("r2", [A, B, C, D, E, F], HASHER)
    assert admit(manager, r2) == [0]  # EF is a partial block: only ABCD hits
    decode(manager, r2, G)  # Time 0
    assert manager.get_block_ids("r2") == [0, 3]
    assert cached_ids(manager) == [0, 1]
    decode(manager, r2, H)  # Time 1: block 3 now duplicates block 1
    assert manager.get_block_ids("r2") == [0, 3]
    assert cached_ids(manager) == [0, 1, 3]
    blocks = manager.pool.blocks
    assert blocks[3].block_hash == blocks[1].block_hash == r1.block_hashes[1]
    manager.check_integrity()

    # Only the first copy of E-H was announced: the set of cached hashes did not change.
    events = manager.take_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == r1.block_hashes[:2]
    assert replay(events) == set(manager.pool.cached_block_hashes())

    # The duplication ends when the blocks are freed and evicted: no hash is lost early.
    manager.free(r1)
    manager.free(r2)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 2, 1, 3, 0]

    def removed(events: list) -> list[bytes]:
        return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]

    admit(manager, Request("filler", list(range(500, 528)), HASHER))  # takes 4..9 and 2
    assert removed(manager.take_events()) == []
    admit(manager, Request("a", [600, 601, 602, 603], HASHER))  # takes block 1, a copy of E-H
    assert removed(manager.take_events()) == []
    assert manager.pool.get_cached_block(r1.block_hashes[1]) is blocks[3]
    admit(manager, Request("b", [700, 701, 702, 703], HASHER))  # takes block 3, the last copy
    assert removed(manager.take_events()) == [r1.block_hashes[1]]
    assert manager.pool.get_cached_block(r1.block_hashes[1]) is None
    manager.check_integrity()


def test_ten_block_example() -> None:
    """The ten-block example, Time 1 to Time 7, block size 4."""
    manager = KVCacheManager(num_blocks=10, block_size=4)
    prompt0 = list(range(1000, 1014))  # 14 tokens

    # Time 1: a new request takes 4 blocks; 3 are full and cached, the 4th holds 2 tokens.
    r0 = Request("r0", prompt0, HASHER)
    admit(manager, r0)
    assert manager.get_block_ids("r0") == [0, 1, 2, 3]
    assert cached_ids(manager) == [0, 1, 2]

    # Time 2: one decoded token; block 3 holds 3 tokens.
    decode(manager, r0, 2000)
    assert manager.get_block_ids("r0") == [0, 1, 2, 3]
    assert cached_ids(manager) == [0, 1, 2]

    # Time 3: block 3 becomes full and is cached; the next token needs block 4.
    decode(manager, r0, 2001)
    assert cached_ids(manager) == [0, 1, 2, 3]
    decode(manager, r0, 2002)
    assert manager.get_block_ids("r0") == [0, 1, 2, 3, 4]
    assert cached_ids(manager) == [0, 1, 2, 3]

    # Time 4: 14 prompt tokens, the first 11 shared with request 0: only 2 blocks hit.
    r1 = Request("r1", [*prompt0[:11], 3000, 3001, 3002], HASHER)
    assert admit(manager, r1) == [0, 1]
    assert manager.get_block_ids("r1") == [0, 1, 5, 6]
    assert cached_ids(manager) == [0, 1, 2, 3, 5]
    assert free_ids(manager) == [7, 8, 9]

    # Time 5: request 0 is freed; 4, 3, 2 join the free queue (2 and 3 stay cached).
    manager.free(r0)
    assert free_ids(manager) == [7, 8, 9, 4, 3, 2]
    assert cached_ids(manager) == [0, 1, 2, 3, 5]

    # Time 6: request 1 is freed.
    manager.free(r1)
    assert free_ids(manager) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    manager.check_integrity()
    manager.take_events()

    # Time 7: the document's prose says "33 prompt tokens, the first 16 the same", but its
    # outcome (three hits, eight blocks, block 3 evicted) needs the shared prefix to end inside
    # block 3 and the prompt to fill eight blocks: request 0's 14 prompt tokens, then 18 new ones.
    r2 = Request("r2", [*prompt0, *range(4000, 4018)], HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0, 1, 2]
    assert num_hit_tokens == 12
    block3_hash = manager.pool.blocks[3].block_hash
    manager.allocate_slots(r2, r2.num_tokens - num_hit_tokens, hit)
    assert manager.get_block_ids("r2") == [0, 1, 2, 7, 8, 9, 4, 3]
    assert free_ids(manager) == [6, 5]
    assert manager.get_computed_blocks(Request("probe", r0.token_ids, HASHER))[1] == 12

    events = manager.take_events()
    assert events[0] == BlockRemoved((block3_hash,))
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert events[1].block_hashes == tuple(r2.block_hashes[3:8])
    manager.check_integrity()
