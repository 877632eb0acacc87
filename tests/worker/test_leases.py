"""A prefill worker's lease on a finished request's blocks: it holds exactly the blocks it names
to the peer that copies them, for as long as the peer asked."""

from __future__ import annotations

import time

from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request, SamplingParams
from kvswitch.worker.server import WorkerConfig
from tests.worker.background import BackgroundWorker
from tests.worker.driver import admit

B = 4
HASHER = BlockHasher("lease-model", block_size=B)


def test_a_lease_held_again_keeps_its_later_end_and_holds_only_the_new_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=B)
    r1 = Request("r1", list(range(2 * B + 1)), HASHER)  # blocks 0, 1 full; 2 partial
    admit(manager, r1)
    manager.hold(r1, "t", now_s=10.0, hold_s=50.0)
    manager.free(r1)
    block_0 = manager.pool.blocks[0]
    manager.hold_blocks([block_0], "t", now_s=12.0, hold_s=5.0)
    assert manager.next_lease_end_s == 60.0  # not cut short to 17
    manager.hold_blocks([block_0], "t", now_s=58.0, hold_s=30.0)
    assert manager.next_lease_end_s == 88.0  # the asked length, not the request's 50 s
    assert [b.ref_cnt for b in manager.pool.blocks[:2]] == [1, 0]  # block 1 let go
    assert manager.pool.free_queue.block_ids()[-1] == 1
    manager.check_integrity()


def test_a_mapped_fetch_names_the_blocks_its_lease_holds_for_the_asked_time() -> None:
    """The request computed its later blocks as duplicates of blocks a pull cached meanwhile:
    its lease holds its own copies, the cache names the others. The ids a mapped fetch answers
    must be held, for the fetch's time, not the request's shorter lease."""
    engine = LLMEngine(EngineConfig(kv_cache_bytes=16 * (32 << 10), max_num_batched_tokens=16))
    prompt = [256, *range(64)]  # 65 tokens: 4 full blocks and one token
    request = engine.make_request("r", prompt, SamplingParams(max_tokens=1), hold_s=5.0)
    engine.add(request)
    engine.step()  # the first block
    hashes = request.block_hashes[:4]
    size = engine.kv_layout.bytes_per_block
    assert engine.write_cached_blocks(hashes[1:], bytes(3 * size)) == 3
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.num_leases == 1

    block_ids = engine.hold_cached_blocks(hashes, "r", 60.0)
    pool = engine.kv_cache.pool
    assert [pool.get_cached_block(h).block_id for h in hashes] == block_ids
    assert all(pool.blocks[i].ref_cnt == 1 for i in block_ids)  # held by the lease, not free
    assert engine.kv_cache.num_leases == 1
    assert engine.kv_cache.next_lease_end_s > time.monotonic() + 30  # 60 s asked, not 5
    engine.kv_cache.check_integrity()
    assert engine.release_lease("r")
    assert pool.num_free_blocks == pool.num_blocks
    engine.close()


def test_requests_run_on_while_a_lease_is_held() -> None:
    """A worker holding a finished request's blocks for a peer (a minute) runs its other
    requests step after step, not one step per command that happens to arrive: they finish
    while the lease is still held. (The core's loop once waited for the lease's end between
    steps whenever requests were running.)"""
    worker = BackgroundWorker(WorkerConfig(port=0, kv_cache_bytes=256 * (32 << 10)))
    try:
        worker.generate([256, *range(40)], request_id="held", max_tokens=1, hold_blocks_ms=60_000)
        for i in range(3):  # one after another: no command arrives while one runs
            tokens, _, _ = worker.generate([256, i, *range(30)], max_tokens=64, timeout=30)
            assert len(tokens) == 64
        load = worker.load()
        assert load.num_free_blocks < load.num_total_blocks  # the lease still holds its blocks
    finally:
        worker.close()
