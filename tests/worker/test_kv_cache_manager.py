"""KV cache manager tests: prefix hits, allocation failure, caching while decoding, extra keys."""

from __future__ import annotations

import pytest

from kvswitch.cache_index.events import BlockRemoved, BlockStored, replay
from kvswitch.cache_index.hashing import BlockHasher, MMItem
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request
from tests.worker.driver import admit, decode

B = 4
HASHER = BlockHasher("mgr-model", block_size=B)


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def state(manager: KVCacheManager, *requests: Request) -> tuple:
    """Everything allocate_slots must leave alone when it fails."""
    pool = manager.pool
    return (
        [manager.get_block_ids(r.request_id) for r in requests],
        pool.free_queue.block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted(pool.cached_block_hashes()),
    )


def stored(events: list) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


# -- construction -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -4])
def test_rejects_non_positive_block_size(block_size: int) -> None:
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=block_size)


def test_rejects_non_positive_num_blocks() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=B)


# -- the hit cap --------------------------------------------------------------------------------


def test_prompt_of_exactly_two_blocks_hits_only_one() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    r1 = Request("r1", toks(2 * B), HASHER)
    admit(manager, r1)
    assert manager.get_block_ids("r1") == [0, 1]
    assert [b.block_hash for b in manager.pool.blocks[:2]] == r1.block_hashes
    manager.take_events()

    r2 = Request("r2", toks(2 * B), HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0]
    assert num_hit_tokens == B
    assert manager.allocate_slots(r2, B, hit) is not None
    # The last block is computed again and becomes a duplicate: no event, same cached set.
    assert manager.get_block_ids("r2") == [0, 2]
    assert manager.pool.blocks[2].block_hash == r1.block_hashes[1]
    assert manager.take_events() == []
    assert set(manager.pool.cached_block_hashes()) == set(r1.block_hashes)
    manager.check_integrity()


def test_prompt_one_token_past_two_blocks_hits_both() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    admit(manager, Request("r1", toks(2 * B), HASHER))
    r2 = Request("r2", toks(2 * B + 1), HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0, 1]
    assert num_hit_tokens == 2 * B
    assert manager.allocate_slots(r2, 1, hit) is not None
    assert manager.get_block_ids("r2") == [0, 1, 2]
    manager.check_integrity()


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1])
def test_short_prompts_never_hit_fully(n: int) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    admit(manager, Request("r1", toks(n), HASHER))
    _, num_hit_tokens = manager.get_computed_blocks(Request("r2", toks(n), HASHER))
    assert num_hit_tokens == (n - 1) // B * B
    assert num_hit_tokens < n


def test_hit_stops_at_first_miss() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    admit(manager, Request("r1", toks(3 * B), HASHER))
    prompt = toks(3 * B + 1)
    prompt[B + 1] = 7  # block 1 differs, so block 2 (same tokens, other parent) misses too
    hit, num_hit_tokens = manager.get_computed_blocks(Request("r2", prompt, HASHER))
    assert [b.block_id for b in hit] == [0]
    assert num_hit_tokens == B


def test_get_computed_blocks_does_not_modify_the_pool() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)
    manager.free(r1)
    manager.take_events()
    before = state(manager, r1)
    hit, _ = manager.get_computed_blocks(Request("r2", toks(3 * B), HASHER))
    assert [b.block_id for b in hit] == [0, 1]
    assert state(manager, r1) == before
    assert manager.take_events() == []


# -- allocation failure -------------------------------------------------------------------------


def test_allocate_none_changes_nothing_for_new_request() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)  # 3 blocks, 2 cached
    admit(manager, r1)
    manager.take_events()
    r2 = Request("r2", toks(2 * B, start=5000), HASHER)  # needs 2, only 1 free
    before = state(manager, r1, r2)
    assert manager.can_allocate(r2, r2.num_tokens) is False
    assert manager.allocate_slots(r2, r2.num_tokens) is None
    assert state(manager, r1, r2) == before
    assert manager.take_events() == []
    manager.check_integrity()
    # It still fits with a smaller chunk.
    assert manager.can_allocate(r2, B) is True
    assert [b.block_id for b in manager.allocate_slots(r2, B)] == [3]
    manager.check_integrity()


def test_allocate_none_counts_free_hit_blocks() -> None:
    """The free prefix-hit blocks leave the free queue when touched: they must be counted."""
    manager = KVCacheManager(num_blocks=4, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)  # blocks 0, 1 cached; block 2 partial
    manager.free(r1)
    assert manager.pool.free_queue.block_ids() == [3, 2, 1, 0]
    filler = Request("filler", [1], HASHER)
    admit(manager, filler)  # takes block 3
    manager.take_events()

    # 2 hit blocks (both free) + 2 new blocks: 4 blocks leave a queue of 3.
    r2 = Request("r2", [*toks(2 * B), *toks(5, start=9000)], HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0, 1]
    assert all(b.ref_cnt == 0 for b in hit)
    before = state(manager, r1, filler, r2)
    assert manager.can_allocate(r2, r2.num_tokens - num_hit_tokens, hit) is False
    assert manager.allocate_slots(r2, r2.num_tokens - num_hit_tokens, hit) is None
    assert state(manager, r1, filler, r2) == before
    assert all(b.ref_cnt == 0 for b in hit)
    assert manager.take_events() == []
    manager.check_integrity()

    # 2 hit blocks + 1 new block: exactly the 3 free blocks.
    r3 = Request("r3", toks(2 * B + 1), HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r3)
    assert manager.can_allocate(r3, 1, hit) is True
    assert manager.allocate_slots(r3, 1, hit) is not None
    assert manager.get_block_ids("r3") == [0, 1, 2]
    assert manager.num_free_blocks == 0
    assert manager.take_events() == []  # block 2 held no hash: nothing evicted
    manager.check_integrity()


def test_hit_blocks_in_use_need_no_free_slot() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)  # holds 0, 1, 2; block 3 free
    r2 = Request("r2", [*toks(2 * B), 1, 2], HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0, 1]
    assert manager.can_allocate(r2, r2.num_tokens - num_hit_tokens, hit) is True
    assert manager.allocate_slots(r2, r2.num_tokens - num_hit_tokens, hit) is not None
    assert manager.get_block_ids("r2") == [0, 1, 3]
    assert [b.ref_cnt for b in manager.pool.blocks] == [2, 2, 1, 1]
    manager.check_integrity()


def test_allocate_none_for_running_request_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=B)
    r1 = Request("r1", toks(2 * B), HASHER)
    admit(manager, r1)
    manager.take_events()
    r1.append_token_ids([1])
    before = state(manager, r1)
    assert manager.can_allocate(r1, 1) is False
    assert manager.allocate_slots(r1, 1) is None
    assert state(manager, r1) == before
    assert manager.take_events() == []
    manager.check_integrity()


@pytest.mark.parametrize("free_r1", [True, False])
@pytest.mark.parametrize("filler_tokens", [0, 1, B, 2 * B, 3 * B, 4 * B + 1])
@pytest.mark.parametrize("extra", [1, B - 1, 2 * B, 3 * B + 1])
def test_can_allocate_agrees_with_allocate_slots(
    free_r1: bool, filler_tokens: int, extra: int
) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=B)
    r1 = Request("r1", toks(3 * B + 1), HASHER)
    admit(manager, r1)
    if free_r1:
        manager.free(r1)
    if filler_tokens:
        filler = Request("filler", toks(filler_tokens, start=7000), HASHER)
        if manager.can_allocate(filler, filler_tokens):
            assert manager.allocate_slots(filler, filler_tokens) is not None
    r2 = Request("r2", [*toks(3 * B), *toks(extra, start=8000)], HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    expected = manager.can_allocate(r2, r2.num_tokens - num_hit_tokens, hit)
    # Direct count: blocks needed beyond the hit, plus the free hit blocks revived.
    num_required = -(-r2.num_tokens // B) - len(hit)
    num_revived = sum(b.ref_cnt == 0 for b in hit)
    assert expected == (num_required + num_revived <= manager.num_free_blocks)
    before = state(manager, r2)
    result = manager.allocate_slots(r2, r2.num_tokens - num_hit_tokens, hit)
    assert (result is not None) == expected
    if result is None:
        assert state(manager, r2) == before
    manager.check_integrity()


# -- caching while decoding and in chunks ------------------------------------------------------


def test_block_is_cached_on_the_step_that_fills_it() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    prompt = toks(B + 2)
    r1 = Request("r1", prompt, HASHER)
    admit(manager, r1)
    (event,) = manager.take_events()
    assert event == BlockStored((r1.block_hashes[0],))

    decode(manager, r1, 501)  # B + 3 tokens
    assert manager.take_events() == []
    assert manager.pool.blocks[1].block_hash is None

    decode(manager, r1, 502)  # B + 4 tokens: block 1 is full
    assert len(r1.block_hashes) == 2
    assert manager.pool.blocks[1].block_hash == r1.block_hashes[1]
    (event,) = manager.take_events()
    assert event == BlockStored((r1.block_hashes[1],))
    assert manager.get_block_ids("r1") == [0, 1]

    decode(manager, r1, 503)  # needs a new block, nothing cached
    assert manager.get_block_ids("r1") == [0, 1, 2]
    assert manager.take_events() == []
    manager.check_integrity()

    # A request with the generated tokens in its prompt now hits the decoded block.
    r2 = Request("r2", [*prompt, 501, 502, 503], HASHER)
    assert manager.get_computed_blocks(r2)[1] == 2 * B


def test_chunked_prefill_caches_blocks_as_chunks_complete() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    prompt = toks(3 * B + 1)
    r1 = Request("r1", prompt, HASHER)
    assert manager.allocate_slots(r1, B - 1) is not None
    assert manager.get_block_ids("r1") == [0]
    assert manager.take_events() == []
    r1.num_computed_tokens = B - 1

    assert manager.allocate_slots(r1, B + 2) is not None  # computed: 2B + 1
    assert manager.get_block_ids("r1") == [0, 1, 2]
    (event,) = manager.take_events()
    assert event.block_hashes == tuple(r1.block_hashes[:2])
    r1.num_computed_tokens = 2 * B + 1

    assert manager.allocate_slots(r1, B) is not None
    (event,) = manager.take_events()
    assert event.block_hashes == (r1.block_hashes[2],)
    assert manager.get_block_ids("r1") == [0, 1, 2, 3]
    manager.check_integrity()


def test_identical_requests_in_the_same_step_duplicate_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    r2 = Request("r2", toks(2 * B + 1), HASHER)
    # Both are looked up before either is allocated: neither hits.
    hit1, _ = manager.get_computed_blocks(r1)
    hit2, _ = manager.get_computed_blocks(r2)
    assert hit1 == hit2 == []
    manager.allocate_slots(r1, r1.num_tokens)
    manager.allocate_slots(r2, r2.num_tokens)
    assert manager.get_block_ids("r2") == [3, 4, 5]
    events = manager.take_events()
    assert len(stored(events)) == 1
    assert replay(events) == set(r1.block_hashes)
    manager.check_integrity()


def test_duplicate_then_new_block_in_one_step_splits_the_event() -> None:
    """Two requests prefill the same prompt in chunks, one ahead of the other."""
    manager = KVCacheManager(num_blocks=10, block_size=B)
    prompt = toks(3 * B + 1)
    r1 = Request("r1", prompt, HASHER)
    r2 = Request("r2", prompt, HASHER)
    assert manager.allocate_slots(r1, B) is not None  # r1: block 0
    r1.num_computed_tokens = B
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    assert [b.block_id for b in hit] == [0]
    assert manager.allocate_slots(r2, B, hit) is not None  # r2: block 1, ahead of r1
    r2.num_computed_tokens = num_hit_tokens + B
    manager.take_events()

    # r1 computes blocks 1 and 2: block 1 duplicates r2's, block 2 is new.
    assert manager.allocate_slots(r1, 2 * B) is not None
    (event,) = manager.take_events()
    assert event.block_hashes == (r1.block_hashes[2],)
    assert manager.get_block_ids("r1") == [0, 2, 3]
    assert manager.get_block_ids("r2") == [0, 1]
    assert manager.pool.blocks[2].block_hash == manager.pool.blocks[1].block_hash
    manager.check_integrity()


# -- LoRA, cache salt, multimodal ---------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        BlockHasher("mgr-model", B, lora="adapter-a"),
        BlockHasher("mgr-model", B, lora="adapter-b"),
        BlockHasher("mgr-model", B, cache_salt="salt-1"),
        BlockHasher("mgr-model", B, lora="adapter-a", cache_salt="salt-1"),
        BlockHasher("other-model", B),
    ],
)
def test_same_tokens_with_other_extras_miss(other: BlockHasher) -> None:
    base = BlockHasher("mgr-model", B, lora="adapter-a", cache_salt="salt-2")
    manager = KVCacheManager(num_blocks=12, block_size=B)
    prompt = toks(2 * B + 1)
    admit(manager, Request("r1", prompt, base))
    assert manager.get_computed_blocks(Request("r2", prompt, other))[1] == 0
    assert manager.get_computed_blocks(Request("r3", prompt, HASHER))[1] == 0
    assert manager.get_computed_blocks(Request("r4", prompt, base))[1] == 2 * B


@pytest.mark.parametrize(
    "hasher",
    [
        BlockHasher("mgr-model", B, lora="adapter-a"),
        BlockHasher("mgr-model", B, cache_salt="salt-1"),
        BlockHasher("mgr-model", B, lora="adapter-a", cache_salt="salt-1"),
        BlockHasher("mgr-model", B, mm_items=(MMItem(b"img", offset=B + 1, length=B),)),
    ],
)
def test_stored_events_name_blocks_by_hashes_that_hold_the_extras(hasher: BlockHasher) -> None:
    manager = KVCacheManager(num_blocks=12, block_size=B)
    prompt = toks(2 * B + 2)
    r1 = Request("r1", prompt, hasher)
    admit(manager, r1)
    (event,) = manager.take_events()
    # The adapter, the salt and the media are in the hashes: the same tokens without them
    # name other blocks, so the event needs to carry nothing else.
    assert event == BlockStored(tuple(r1.block_hashes[:2]))
    assert event.block_hashes[-1] not in HASHER.hash_blocks(prompt)

    # A block filled by decoding, too.
    decode(manager, r1, 1)
    decode(manager, r1, 2)
    (event,) = manager.take_events()
    assert event == BlockStored((r1.block_hashes[2],))
    manager.check_integrity()

    # The same tokens and extras hit.
    r2 = Request("r2", [*prompt, 1, 2, 3], hasher)
    assert admit(manager, r2) == [0, 1, 2]


# -- errors -------------------------------------------------------------------------------------


def test_mismatched_block_size_raises() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    r1 = Request("r1", toks(10), BlockHasher("mgr-model", block_size=2 * B))
    with pytest.raises(ValueError, match="blocks of"):
        manager.allocate_slots(r1, 10)
    with pytest.raises(ValueError):
        manager.can_allocate(r1, 10)
    assert manager.get_block_ids("r1") == []
    assert manager.num_free_blocks == 6
    manager.check_integrity()


@pytest.mark.parametrize("num_new", [0, -1])
def test_non_positive_num_new_tokens_raises(num_new: int) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    r1 = Request("r1", toks(5), HASHER)
    with pytest.raises(ValueError, match="positive"):
        manager.allocate_slots(r1, num_new)
    with pytest.raises(ValueError):
        manager.can_allocate(r1, num_new)
    admit(manager, r1)
    before = state(manager, r1)
    with pytest.raises(ValueError):
        manager.allocate_slots(r1, num_new)
    assert state(manager, r1) == before


def test_tokens_beyond_the_known_ones_raise() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    with pytest.raises(ValueError, match="known"):
        manager.allocate_slots(r1, 2 * B + 2)
    assert manager.get_block_ids("r1") == []
    admit(manager, r1)
    manager.take_events()

    # With a prefix hit: hit tokens + new tokens past the prompt.
    r2 = Request("r2", toks(2 * B + 1), HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(r2)
    before = state(manager, r1, r2)
    with pytest.raises(ValueError):
        manager.allocate_slots(r2, r2.num_tokens - num_hit_tokens + 1, hit)
    assert state(manager, r1, r2) == before

    # While decoding: nothing was appended yet.
    with pytest.raises(ValueError):
        manager.allocate_slots(r1, 1)
    assert state(manager, r1, r2) == before
    assert manager.take_events() == []
    manager.check_integrity()


# -- free and preemption ------------------------------------------------------------------------


def test_free_of_unknown_request_is_a_noop() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)
    manager.take_events()
    before = state(manager, r1)
    manager.free(Request("ghost", toks(3), HASHER))
    assert state(manager, r1) == before
    manager.free(r1)
    after = state(manager, r1)
    manager.free(r1)  # a second free is a no-op too
    assert state(manager, r1) == after
    assert manager.take_events() == []
    manager.check_integrity()


def test_free_returns_blocks_end_of_chain_first() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=B)
    r1 = Request("r1", toks(3 * B + 1), HASHER)
    admit(manager, r1)
    r2 = Request("r2", [*toks(2 * B), *toks(B + 1, start=4000)], HASHER)
    assert admit(manager, r2) == [0, 1]
    assert manager.get_block_ids("r2") == [0, 1, 4, 5]
    manager.free(r2)
    assert manager.pool.free_queue.block_ids() == [6, 7, 5, 4]  # 0 and 1 still held by r1
    manager.free(r1)
    assert manager.pool.free_queue.block_ids() == [6, 7, 5, 4, 3, 2, 1, 0]
    manager.check_integrity()


def test_preempted_request_hits_its_own_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)
    for t in (1, 2, 3):
        decode(manager, r1, t)  # 2B + 4 tokens: three full blocks
    assert manager.get_block_ids("r1") == [0, 1, 2]
    manager.take_events()

    manager.free(r1)
    r1.num_computed_tokens = 0
    assert manager.get_block_ids("r1") == []
    hit, num_hit_tokens = manager.get_computed_blocks(r1)
    # The last block is full but holds the last token: it is computed again.
    assert [b.block_id for b in hit] == [0, 1]
    assert num_hit_tokens == 2 * B
    assert manager.allocate_slots(r1, r1.num_tokens - num_hit_tokens, hit) is not None
    r1.num_computed_tokens = r1.num_tokens
    assert manager.get_block_ids("r1")[:2] == [0, 1]
    assert manager.take_events() == []  # the recomputed block duplicates block 2
    manager.check_integrity()

    decode(manager, r1, 4)
    assert len(manager.get_block_ids("r1")) == 4
    manager.check_integrity()


def test_preempted_request_after_eviction_recomputes() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)
    manager.free(r1)
    r1.num_computed_tokens = 0
    other = Request("other", toks(2 * B + 1, start=6000), HASHER)
    admit(manager, other)  # takes 2, 1, 0: r1's blocks are evicted
    events = manager.take_events()
    removed = {x for e in events if isinstance(e, BlockRemoved) for x in e.block_hashes}
    assert removed == set(r1.block_hashes)
    manager.free(other)
    assert manager.get_computed_blocks(r1) == ([], 0)
    assert admit(manager, r1) == []
    manager.check_integrity()


# -- reset and disabled caching -----------------------------------------------------------------


def test_reset_prefix_cache_through_the_manager() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)
    assert manager.reset_prefix_cache() is False
    manager.free(r1)
    assert manager.reset_prefix_cache() is True
    events = manager.take_events()
    assert replay(events) == set()
    assert manager.get_computed_blocks(Request("r2", toks(2 * B + 1), HASHER)) == ([], 0)
    manager.check_integrity()


def test_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B, enable_caching=False)
    r1 = Request("r1", toks(2 * B + 1), HASHER)
    admit(manager, r1)
    decode(manager, r1, 1)
    decode(manager, r1, 2)
    decode(manager, r1, 3)
    manager.free(r1)
    r2 = Request("r2", toks(2 * B + 1), HASHER)
    assert admit(manager, r2) == []
    assert manager.take_events() == []
    assert manager.pool.cached_block_hashes() == []
    manager.check_integrity()


# -- stats --------------------------------------------------------------------------------------


def test_stats_hit_rate() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    assert manager.stats.hit_rate == 0.0
    admit(manager, Request("r1", toks(2 * B), HASHER))
    assert manager.stats.num_query_tokens == 2 * B
    assert manager.stats.num_hit_tokens == 0
    assert manager.stats.hit_rate == 0.0
    admit(manager, Request("r2", toks(2 * B + 1), HASHER))
    assert manager.stats.num_query_tokens == 4 * B + 1
    assert manager.stats.num_hit_tokens == 2 * B
    assert manager.stats.hit_rate == pytest.approx(2 * B / (4 * B + 1))
    admit(manager, Request("r3", toks(2 * B), HASHER))
    assert manager.stats.num_hit_tokens == 3 * B
    assert manager.stats.hit_rate == pytest.approx(3 * B / (6 * B + 1))


def test_stats_count_a_preempted_request_once() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=B)
    request = Request("r", toks(2 * B + 1), HASHER)
    admit(manager, request)
    assert (manager.stats.num_query_tokens, manager.stats.num_hit_tokens) == (2 * B + 1, 0)
    # Preempted as the scheduler does it, then admitted again: it hits its own two blocks.
    manager.free(request)
    request.num_computed_tokens, request.num_preemptions = 0, 1
    admit(manager, request)
    assert manager.get_block_ids("r")
    assert (manager.stats.num_query_tokens, manager.stats.num_hit_tokens) == (2 * B + 1, 0)


def test_stats_count_a_refused_request_once() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    big = Request("big", toks(4 * B + 1), HASHER)
    hit, num_hit = manager.get_computed_blocks(big)
    assert manager.allocate_slots(big, big.num_tokens - num_hit, hit) is None
    assert manager.get_computed_blocks(big) == ([], 0)  # looked up again on retry
    assert manager.stats.num_query_tokens == 0
    small = Request("small", toks(3 * B), HASHER)
    admit(manager, small)
    assert manager.stats.num_query_tokens == 3 * B
    # Decode steps of an admitted request are not new lookups.
    decode(manager, small, 7)
    assert manager.stats.num_query_tokens == 3 * B


def test_usage_follows_the_pool() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    assert manager.usage == 0.0
    r1 = Request("r1", toks(B + 1), HASHER)
    admit(manager, r1)
    assert manager.usage == pytest.approx(0.5)
    manager.free(r1)
    assert manager.usage == 0.0


# -- leases ---------------------------------------------------------------------------------------


def test_a_lease_keeps_a_finished_requests_full_blocks_from_eviction_until_released() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=B)
    r1 = Request("r1", toks(2 * B + 1), HASHER)  # 2 full blocks and a partial one
    admit(manager, r1)
    assert manager.hold(r1, "r1", now_s=10.0, hold_s=5.0) == 2
    manager.free(r1)
    manager.check_integrity()
    assert manager.pool.free_queue.block_ids() == [3, 4, 5, 2]  # the partial block is free
    assert manager.next_lease_end_s == 15.0

    r2 = Request("r2", toks(4 * B, start=5000), HASHER)  # takes every free block
    admit(manager, r2)
    assert manager.get_block_ids("r2") == [3, 4, 5, 2]
    assert [manager.pool.get_cached_block(h).block_id for h in r1.block_hashes] == [0, 1]
    assert manager.allocate_slots(Request("r3", toks(1, start=9000), HASHER), 1) is None
    manager.free(r2)

    assert manager.extend("r1", now_s=12.0) and manager.next_lease_end_s == 17.0
    assert manager.release_expired(now_s=16.9) == []
    assert manager.release_expired(now_s=17.0) == ["r1"]
    assert not manager.release("r1") and not manager.extend("r1", now_s=18.0)
    # Let go as a freed request's blocks are: still cached, the end of the chain evicted first.
    assert manager.pool.free_queue.block_ids()[-2:] == [1, 0]
    assert manager.pool.get_cached_block(r1.block_hashes[0]) is not None
    manager.check_integrity()


def test_integrity_counts_a_leases_references() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=B)
    r1 = Request("r1", toks(B + 1), HASHER)
    admit(manager, r1)
    manager.hold(r1, "r1", now_s=0.0, hold_s=1.0)
    manager.free(r1)
    manager.check_integrity()
    manager.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="in 1 tables, leases and transfers"):
        manager.check_integrity()
