"""Unit tests of the free queue and the block pool: exact orders, ref counts and events."""

from __future__ import annotations

import pytest

from kvswitch.cache_index.events import AllBlocksCleared, BlockRemoved, BlockStored, replay
from kvswitch.worker.block_pool import BlockPool, FreeBlockQueue, KVBlock


def h(n: int) -> bytes:
    """A made-up 16-byte block hash."""
    return bytes([n]) * 16


def snapshot(pool: BlockPool) -> tuple:
    return (
        pool.free_queue.block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted(pool.cached_block_hashes()),
        pool.num_free_blocks,
    )


def cache_one(pool: BlockPool, block: KVBlock, block_hash: bytes) -> None:
    pool.cache_full_blocks([block], [block_hash])


# -- FreeBlockQueue ------------------------------------------------------------------------------


def make_queue(n: int) -> tuple[list[KVBlock], FreeBlockQueue]:
    blocks = [KVBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_queue_initial_order() -> None:
    blocks, queue = make_queue(5)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert len(queue) == queue.num_free_blocks == 5
    assert list(queue) == blocks


def test_queue_empty() -> None:
    _, queue = make_queue(0)
    assert queue.block_ids() == []
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_queue_popleft_remove_append_order() -> None:
    blocks, queue = make_queue(5)
    assert queue.popleft() is blocks[0]
    assert queue.block_ids() == [1, 2, 3, 4]
    assert blocks[0].prev_free is None and blocks[0].next_free is None

    queue.remove(blocks[2])  # from the middle
    assert queue.block_ids() == [1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]

    queue.append(blocks[0])
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 0, 2]
    assert len(queue) == 5

    queue.remove(blocks[2])  # the tail
    queue.remove(blocks[1])  # the head
    assert queue.block_ids() == [3, 4, 0]
    assert [queue.popleft().block_id for _ in range(3)] == [3, 4, 0]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_queue_pop_until_empty_then_refill() -> None:
    blocks, queue = make_queue(3)
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 2]
    with pytest.raises(IndexError):
        queue.popleft()
    for i in (2, 0, 1):
        queue.append(blocks[i])
    assert queue.block_ids() == [2, 0, 1]


def test_queue_double_append_raises_and_changes_nothing() -> None:
    blocks, queue = make_queue(3)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    with pytest.raises(ValueError):
        queue.append(blocks[2])  # the last member
    assert queue.block_ids() == [0, 1, 2]
    assert len(queue) == 3


def test_queue_remove_non_member_raises_and_changes_nothing() -> None:
    blocks, queue = make_queue(3)
    queue.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    with pytest.raises(ValueError):
        queue.remove(KVBlock(99))
    assert queue.block_ids() == [0, 2]
    assert len(queue) == 2


# -- BlockPool: construction and allocation -----------------------------------------------------


@pytest.mark.parametrize("num_blocks", [0, -1, -10])
def test_pool_rejects_non_positive_size(num_blocks: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks)


def test_pool_initial_state() -> None:
    pool = BlockPool(4)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3]
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    assert pool.cached_block_hashes() == []
    assert pool.take_events() == []
    pool.check_integrity()


def test_get_new_blocks_from_head_with_ref_one() -> None:
    pool = BlockPool(5)
    first = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [0, 1]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert pool.free_queue.block_ids() == [2, 3, 4]
    assert pool.usage == pytest.approx(0.4)
    assert pool.get_new_blocks(0) == []
    second = pool.get_new_blocks(3)
    assert [b.block_id for b in second] == [2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    pool.check_integrity()


def test_get_new_blocks_respects_queue_order_not_ids() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 0, 3]
    pool.check_integrity()


def test_get_new_blocks_over_asking_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.get_new_blocks(2)
    cache_one(pool, held[0], h(1))
    pool.free_blocks([held[0]])  # cached and free: taking it would evict it
    pool.take_events()
    before = snapshot(pool)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4)
    assert snapshot(pool) == before
    assert pool.take_events() == []
    assert pool.get_cached_block(h(1)) is held[0]
    pool.check_integrity()


# -- touch --------------------------------------------------------------------------------------


def test_touch_revives_free_cached_block_at_its_exact_position() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    cache_one(pool, blocks[2], h(7))
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4]

    cached = pool.get_cached_block(h(7))
    assert cached is blocks[2]
    pool.touch([cached])
    assert cached.ref_cnt == 1
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    assert cached.block_hash == h(7)  # still cached, nothing evicted
    assert pool.take_events()[-1] == BlockStored((h(7),))
    assert pool.take_events() == []

    # Touching a block in use only adds a reference.
    pool.touch([cached])
    assert cached.ref_cnt == 2
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    pool.check_integrity()

    # It returns to the queue only when the last reference goes, and then at the tail.
    pool.free_blocks([cached])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    pool.free_blocks([cached])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4, 2]
    pool.check_integrity()


def test_touch_several_blocks_from_head_middle_and_tail() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(6)
    pool.free_blocks(blocks)
    pool.touch([blocks[0], blocks[3], blocks[5]])
    assert pool.free_queue.block_ids() == [1, 2, 4]
    assert [b.ref_cnt for b in blocks] == [1, 0, 0, 1, 0, 1]
    pool.check_integrity()


# -- free_blocks --------------------------------------------------------------------------------


def test_free_blocks_joins_tail_in_given_order() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)
    assert pool.free_queue.block_ids() == [4, 5]
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    pool.check_integrity()


def test_free_blocks_shared_block_waits_for_last_reference() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.touch([b])  # shared by two requests
    pool.free_blocks([c, b, a])
    assert pool.free_queue.block_ids() == [3, 2, 0]
    assert b.ref_cnt == 1
    pool.free_blocks([b])
    assert pool.free_queue.block_ids() == [3, 2, 0, 1]
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([block])
    assert snapshot(pool) == before
    with pytest.raises(ValueError):
        pool.free_blocks([pool.blocks[2]])  # never taken
    assert snapshot(pool) == before
    pool.check_integrity()


# -- eviction -----------------------------------------------------------------------------------


def test_taking_cached_head_block_evicts_it() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    cache_one(pool, blocks[0], h(1))
    cache_one(pool, blocks[1], h(2))
    pool.free_blocks(blocks)  # queue: 0 (h1), 1 (h2), 2
    assert pool.take_events() == [
        BlockStored((h(1),)),
        BlockStored((h(2),)),
    ]

    (taken,) = pool.get_new_blocks(1)
    assert taken is blocks[0]
    assert taken.ref_cnt == 1
    assert taken.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is blocks[1]
    assert pool.take_events() == [BlockRemoved((h(1),))]
    assert pool.cached_block_hashes() == [h(2)]
    pool.check_integrity()

    # Taking an uncached block emits nothing.
    pool.free_blocks([taken])  # queue: 1 (h2), 2, 0
    pool.touch([blocks[1]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]
    assert pool.take_events() == []
    pool.check_integrity()


def test_duplicate_keeps_hash_until_last_copy_is_evicted() -> None:
    pool = BlockPool(3)
    first, second, other = pool.get_new_blocks(3)
    cache_one(pool, first, h(5))
    cache_one(pool, second, h(5))  # an identical block computed by another request
    assert second.block_hash == h(5)
    assert pool.cached_block_hashes() == [h(5)]
    assert pool.take_events() == [BlockStored((h(5),))]
    pool.check_integrity()

    pool.free_blocks([first, second, other])  # queue: first, second, other
    (taken,) = pool.get_new_blocks(1)
    assert taken is first
    assert pool.take_events() == []  # the copy still holds the tokens
    assert pool.get_cached_block(h(5)) is second
    pool.check_integrity()

    (taken,) = pool.get_new_blocks(1)
    assert taken is second
    assert pool.take_events() == [BlockRemoved((h(5),))]
    assert pool.get_cached_block(h(5)) is None
    pool.check_integrity()


def test_duplicate_evicted_before_the_original() -> None:
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    cache_one(pool, first, h(5))
    cache_one(pool, second, h(5))
    pool.take_events()
    pool.free_blocks([second, first])  # queue: 2, second, first
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert pool.take_events() == []
    assert pool.get_cached_block(h(5)) is first
    pool.check_integrity()
    assert [b.block_id for b in pool.get_new_blocks(1)] == [0]
    assert pool.take_events() == [BlockRemoved((h(5),))]
    pool.check_integrity()


# -- cache_full_blocks --------------------------------------------------------------------------


def test_cache_run_of_new_hashes_is_one_event() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)])
    assert [b.block_hash for b in blocks] == [h(1), h(2), h(3)]
    assert pool.take_events() == [BlockStored((h(1), h(2), h(3)))]
    assert sorted(pool.cached_block_hashes()) == [h(1), h(2), h(3)]
    pool.check_integrity()


def test_duplicate_in_the_middle_splits_the_run() -> None:
    pool = BlockPool(6)
    (earlier,) = pool.get_new_blocks(1)
    cache_one(pool, earlier, h(2))
    pool.take_events()

    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3), h(4)])
    assert pool.take_events() == [BlockStored((h(1),)), BlockStored((h(3), h(4)))]
    assert all(b.block_hash is not None for b in blocks)
    assert pool.get_cached_block(h(2)) is earlier
    assert sorted(pool.cached_block_hashes()) == [h(1), h(2), h(3), h(4)]
    pool.check_integrity()


def test_duplicates_at_both_ends_emit_only_the_middle() -> None:
    pool = BlockPool(6)
    known = pool.get_new_blocks(2)
    cache_one(pool, known[0], h(1))
    cache_one(pool, known[1], h(3))
    pool.take_events()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)])
    assert pool.take_events() == [BlockStored((h(2),))]
    pool.check_integrity()


def test_all_duplicates_emit_nothing() -> None:
    pool = BlockPool(4)
    known = pool.get_new_blocks(2)
    pool.cache_full_blocks(known, [h(1), h(2)])
    pool.take_events()
    copies = pool.get_new_blocks(2)
    pool.cache_full_blocks(copies, [h(1), h(2)])
    assert pool.take_events() == []
    assert sorted(pool.cached_block_hashes()) == [h(1), h(2)]
    pool.check_integrity()


def test_caching_an_already_cached_block_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    cache_one(pool, block, h(1))
    with pytest.raises(ValueError, match="already cached"):
        cache_one(pool, block, h(2))
    assert block.block_hash == h(1)


# -- reset_prefix_cache -------------------------------------------------------------------------


def test_reset_refused_while_a_block_is_in_use() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    cache_one(pool, blocks[0], h(1))
    pool.free_blocks([blocks[0]])
    pool.take_events()
    before = snapshot(pool)
    assert pool.reset_prefix_cache() is False
    assert snapshot(pool) == before
    assert pool.take_events() == []
    assert pool.get_cached_block(h(1)) is blocks[0]


def test_reset_clears_everything_when_all_blocks_are_free() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks[:2], [h(1), h(2)])
    cache_one(pool, blocks[2], h(1))  # a duplicate, cleared as well
    pool.free_blocks(reversed(blocks))
    events = pool.take_events()
    order = pool.free_queue.block_ids()

    assert pool.reset_prefix_cache() is True
    cleared = pool.take_events()
    assert cleared == [AllBlocksCleared()]
    assert replay(events + cleared) == set() == set(pool.cached_block_hashes())
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(h(1)) is None
    assert pool.free_queue.block_ids() == order
    pool.check_integrity()

    # Taking the formerly cached blocks evicts nothing any more.
    pool.get_new_blocks(4)
    assert pool.take_events() == []
    pool.check_integrity()


# -- enable_caching=False -----------------------------------------------------------------------


def test_caching_disabled_caches_nothing_and_emits_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)])
    assert all(b.block_hash is None for b in blocks)
    assert pool.cached_block_hashes() == []
    assert pool.get_cached_block(h(1)) is None
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert pool.take_events() == []
    pool.check_integrity()


# -- events and integrity -----------------------------------------------------------------------


def test_take_events_hands_over_once_in_order() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    cache_one(pool, a, h(1))
    cache_one(pool, b, h(2))
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert events[2] == BlockRemoved((h(1),))
    assert replay(events) == {h(2)} == set(pool.cached_block_hashes())
    assert pool.take_events() == []


def test_check_integrity_detects_ref_count_out_of_sync_with_queue() -> None:
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = 1  # in the queue but claimed in use
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_detects_stray_hash() -> None:
    pool = BlockPool(3)
    pool.blocks[0].block_hash = h(1)  # not in the hash map
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_detects_lost_free_block() -> None:
    pool = BlockPool(3)
    pool.free_queue.remove(pool.blocks[2])  # ref 0 but not in the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_queue_popleft_n_and_append_n_keep_order() -> None:
    blocks, queue = make_queue(6)
    taken = queue.popleft_n(4)
    assert [b.block_id for b in taken] == [0, 1, 2, 3]
    assert all(b.prev_free is None and b.next_free is None for b in taken)
    assert queue.block_ids() == [4, 5]
    queue.append_n([taken[3], taken[1]])
    assert queue.block_ids() == [4, 5, 3, 1]
    assert len(queue) == 4
    assert queue.popleft_n(0) == []
    with pytest.raises(IndexError):
        queue.popleft_n(5)
    assert queue.block_ids() == [4, 5, 3, 1]
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append_n([blocks[4]])
    assert queue.popleft_n(4) == [blocks[4], blocks[5], blocks[3], blocks[1]]
    assert len(queue) == 0
    queue.append_n([blocks[2]])
    assert queue.block_ids() == [2]


def test_evictions_of_one_allocation_are_one_event_in_queue_order() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        cache_one(pool, block, h(10 + i))
    pool.free_blocks(reversed(blocks))  # queue: 3, 2, 1, 0
    pool.take_events()
    pool.get_new_blocks(3)
    assert pool.take_events() == [BlockRemoved((h(13), h(12), h(11)))]
    assert pool.cached_block_hashes() == [h(10)]
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    pool.check_integrity()


def test_blocks_taken_from_a_peer_are_cached_as_a_freed_request_leaves_them() -> None:
    pool = BlockPool(5)
    pool.cache_full_blocks(pool.get_new_blocks(1), [b"h1"])  # block 0 holds h1 already
    pool.free_blocks(pool.blocks[:1])
    pool.take_events()
    written = []
    num_new = pool.take_cached_blocks(
        [b"h0", b"h1", b"h2"], lambda positions, blocks: written.append((positions, blocks))
    )
    assert num_new == 2
    assert [(p, [b.block_id for b in bs]) for p, bs in written] == [([0, 2], [1, 2])]
    assert pool.cached_prefix([b"h0", b"h1", b"h2", b"h3"]) == [
        pool.blocks[1],
        pool.blocks[0],
        pool.blocks[2],
    ]
    # Evictable, the end of the chain first; the held h1 went back behind them.
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert pool.take_events() == [BlockStored((b"h0", b"h2"))]
    pool.check_integrity()


def test_blocks_whose_write_failed_are_not_cached() -> None:
    pool = BlockPool(3)

    def fail(positions, blocks) -> None:
        raise RuntimeError("the copy broke")

    with pytest.raises(RuntimeError, match="the copy broke"):
        pool.take_cached_blocks([b"h0", b"h1"], fail)
    assert pool.cached_prefix([b"h0"]) == [] and pool.num_free_blocks == 3
    assert pool.take_events() == []
    pool.check_integrity()
