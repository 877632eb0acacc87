"""A request whose prompt's KV a transfer brings: the scheduler and KV cache manager hold its
blocks before the transfer writes them, never schedule it until they land, cache only what the
transfer filled, and free everything when it is aborted. Exact block ids and free-queue order."""

from __future__ import annotations

from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import PullSlots, Request, RequestStatus
from kvswitch.worker.scheduler import Scheduler, SchedulerConfig
from tests.worker.driver import admit

B = 4
HASHER = BlockHasher("pull-model", block_size=B)


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def scheduler_of(num_blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4), KVCacheManager(num_blocks, B))


def awaiting() -> tuple[Scheduler, KVCacheManager, Request]:
    """A scheduler over 10 blocks with one request of 4 full blocks and 2 tokens waiting for
    its KV: blocks 0-3 await it, block 4 is its tail's."""
    scheduler = scheduler_of(10)
    request = Request("r", toks(4 * B + 2), HASHER)
    scheduler.add_awaiting_kv(request)
    return scheduler, scheduler.kv_cache, request


def fill(manager: KVCacheManager, hashes: list[bytes]) -> list[int]:
    """What a transfer's writes do: the ids of the blocks that took the hashes' KV."""
    targets = manager.pull_targets(hashes)
    manager.fill(targets.values())
    return [block.block_id for block in targets.values()]


def test_a_pull_holds_the_whole_prompt_and_lands_as_a_prefix_hit() -> None:
    scheduler = scheduler_of(10)
    manager = scheduler.kv_cache
    request = Request("r", toks(4 * B + 2), HASHER)  # 4 full blocks and 2 tokens

    assert scheduler.add_awaiting_kv(request) == PullSlots(0, [0, 1, 2, 3])
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert manager.get_block_ids("r") == [0, 1, 2, 3, 4]  # the tail's block too
    assert manager.pool.free_queue.block_ids() == [5, 6, 7, 8, 9]
    assert not scheduler.schedule().requests  # nothing to run until its KV lands
    assert scheduler.num_waiting == 1
    manager.check_integrity()

    assert fill(manager, request.block_hashes) == [0, 1, 2, 3]
    assert not manager.pool.cached_block_hashes()  # written, not cached before it lands
    assert scheduler.kv_landed("r") == 4
    assert [b.block_hash for b in manager.pool.blocks[:4]] == request.block_hashes
    out = scheduler.schedule()
    assert (out.requests, out.start_pos, out.num_new_tokens) == ([request], [4 * B], [2])
    assert request.num_cached_tokens == 4 * B
    assert manager.get_block_ids("r") == [0, 1, 2, 3, 4]
    assert scheduler.kv_landed("r") == 0  # landed once only
    manager.check_integrity()


def test_held_blocks_are_never_evicted_and_a_pull_without_room_is_refused() -> None:
    scheduler = scheduler_of(12)
    manager = scheduler.kv_cache
    first = Request("first", toks(4 * B + 1), HASHER)
    assert scheduler.add_awaiting_kv(first) == PullSlots(0, [0, 1, 2, 3])

    # Another request's prompt takes every free block, evicting nothing held for the pull.
    other = Request("other", toks(7 * B, start=5000), HASHER)
    admit(manager, other)
    assert manager.get_block_ids("other") == [5, 6, 7, 8, 9, 10, 11]
    assert manager.num_free_blocks == 0

    third = Request("third", toks(2 * B + 1, start=9000), HASHER)
    slots = scheduler.add_awaiting_kv(third)
    assert slots.refused == "no room: the prompt needs 3 free blocks, 0 are"
    assert (slots.num_cached_blocks, slots.block_ids) == (0, [])
    assert third.status is RequestStatus.WAITING_FOR_REMOTE_KV  # until told, then it computes
    assert manager.get_block_ids("first") == [0, 1, 2, 3, 4]
    assert scheduler.kv_landed("third") == 0
    assert (third.status, list(scheduler.waiting)) == (RequestStatus.WAITING, [third])
    manager.check_integrity()


def test_only_the_filled_leading_run_is_cached_the_rest_is_computed() -> None:
    scheduler, manager, request = awaiting()
    # Blocks 0 and 2 arrived; block 1 never did (the transfer failed after a gap).
    fill(manager, [request.block_hashes[0], request.block_hashes[2]])

    assert scheduler.kv_landed("r") == 1
    assert manager.pool.cached_block_hashes() == request.block_hashes[:1]
    assert [b.block_hash for b in manager.pool.blocks[1:4]] == [None, None, None]
    manager.check_integrity()
    out = scheduler.schedule()
    assert (out.start_pos, out.num_new_tokens) == ([B], [3 * B + 2])  # computes blocks 1..4
    assert request.num_cached_tokens == B


def test_a_transport_that_wrote_by_block_id_says_how_many() -> None:
    scheduler, manager, request = awaiting()
    assert scheduler.kv_landed("r", num_written_blocks=3) == 3
    assert manager.pool.cached_block_hashes() == request.block_hashes[:3]
    manager.check_integrity()


def test_a_cached_prefix_is_held_and_only_the_rest_awaited() -> None:
    scheduler = scheduler_of(10)
    manager = scheduler.kv_cache
    admit(manager, Request("warm", toks(2 * B + 1), HASHER))
    manager.free(Request("warm", toks(1), HASHER))
    assert manager.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    request = Request("r", toks(4 * B + 2), HASHER)
    assert scheduler.add_awaiting_kv(request) == PullSlots(2, [3, 4])
    assert manager.get_block_ids("r") == [0, 1, 3, 4, 5]
    assert manager.pool.free_queue.block_ids() == [6, 7, 8, 9, 2]
    manager.check_integrity()


def test_an_aborted_request_waiting_for_kv_frees_its_blocks() -> None:
    scheduler, manager, request = awaiting()
    fill(manager, request.block_hashes[:2])

    scheduler.remove(request)
    assert manager.num_free_blocks == 10
    assert not manager.pool.cached_block_hashes()  # what was written was never cached
    assert manager.pull_targets(request.block_hashes) == {}
    assert scheduler.num_waiting == 0
    assert scheduler.kv_landed("r") == 0
    manager.check_integrity()


def test_blocks_a_transfer_is_writing_stay_held_past_their_request_and_land_once() -> None:
    """A transfer that writes while steps go on (a NIXL read) holds its blocks from
    ``begin_landing`` to ``end_landing``: no other transfer targets them meanwhile; written,
    they are filled and land; and if their request is aborted meanwhile they leave the free
    queue only when the transfer ends, and fill nothing."""
    scheduler, manager, request = awaiting()
    targets = manager.pull_targets(request.block_hashes)
    manager.begin_landing("read-1", targets, request.block_hashes)
    assert manager.pull_targets(request.block_hashes) == {}  # not twice
    assert [manager.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 2, 2, 1]
    manager.check_integrity()
    assert manager.end_landing("read-1", written=True) == 4
    assert scheduler.kv_landed("r") == 4
    assert manager.pool.cached_block_hashes() == request.block_hashes[:4]
    manager.check_integrity()

    scheduler, manager, request = awaiting()
    manager.begin_landing(
        "read-2", manager.pull_targets(request.block_hashes), request.block_hashes
    )
    scheduler.remove(request)  # aborted while the read runs
    assert manager.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 4]  # the tail's only
    manager.check_integrity()
    assert manager.end_landing("read-2", written=True) == 0  # its request is gone
    assert manager.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 4, 3, 2, 1, 0]
    assert not manager.pool.cached_block_hashes()
    assert manager.num_landing == 0
    manager.check_integrity()


def test_a_failed_transfer_lands_nothing_and_its_request_computes() -> None:
    scheduler, manager, request = awaiting()
    manager.begin_landing("read", manager.pull_targets(request.block_hashes), request.block_hashes)
    assert manager.end_landing("read", written=False) == 0
    assert scheduler.kv_landed("r") == 0
    assert not manager.pool.cached_block_hashes()
    assert manager.get_block_ids("r") == [0, 1, 2, 3, 4]
    manager.check_integrity()
