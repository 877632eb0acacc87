"""``kvswitch bench pool``: block operations per second through the KV cache manager.

The workload is a fleet-like mix: prompts share long document prefixes, so admitting a request
touches cached blocks, takes new ones from the free queue (evicting cached ones once the pool has
filled) and caches them; a window of requests stays running and the oldest is freed as each new
one arrives. Every block that enters or leaves a block table is one op. Hashing is done up front
and excluded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from kvswitch.benchmarks.timing import machine_info, rate_per_s
from kvswitch.cache_index.events import BlockStored, CacheEvent
from kvswitch.cache_index.grpc_index import event_to_proto
from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request


@dataclass(frozen=True)
class PoolBenchConfig:
    num_blocks: int = 4096
    block_size: int = 16
    num_documents: int = 32
    document_blocks: int = 64
    question_blocks: int = 8
    num_requests: int = 1024
    num_running: int = 16
    duration_s: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        blocks_per_request = self.document_blocks + self.question_blocks
        if self.num_running * blocks_per_request > self.num_blocks:
            raise ValueError(
                f"{self.num_running} running requests of {blocks_per_request} blocks do not fit "
                f"in {self.num_blocks} blocks"
            )
        if self.num_running >= self.num_requests:
            raise ValueError("num_requests must exceed num_running")


def make_requests(config: PoolBenchConfig) -> list[Request]:
    rng = np.random.default_rng(config.seed)
    hasher = BlockHasher("bench-model", config.block_size)
    documents = [
        rng.integers(0, 32_000, config.document_blocks * config.block_size).tolist()
        for _ in range(config.num_documents)
    ]
    requests = []
    for i in range(config.num_requests):
        document = documents[int(rng.integers(config.num_documents))]
        # One token fewer than whole blocks, so the last block stays partial and the prompt's
        # last token is computed even on a full document hit.
        question = rng.integers(0, 32_000, config.question_blocks * config.block_size - 1).tolist()
        requests.append(Request(f"req-{i}", document + question, hasher))
    return requests


def run(config: PoolBenchConfig) -> dict[str, float | int]:
    manager = KVCacheManager(config.num_blocks, config.block_size)
    requests = make_requests(config)
    running: deque[Request] = deque()
    counts = {"hit_blocks": 0, "new_blocks": 0}

    def admit(request: Request) -> int:
        hit, num_hit_tokens = manager.get_computed_blocks(request)
        new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hit)
        if new is None:
            raise RuntimeError("benchmark pool too small for its running window")
        manager.commit()  # as the engine does after each forward pass
        request.num_computed_tokens = request.num_tokens
        counts["hit_blocks"] += len(hit)
        counts["new_blocks"] += len(new)
        return len(hit) + len(new)

    def retire() -> int:
        request = running.popleft()
        num_blocks = len(manager.get_block_ids(request.request_id))
        manager.free(request)
        request.num_computed_tokens = 0
        return num_blocks

    def one_pass() -> int:
        num_ops = 0
        for request in requests:
            if len(running) == config.num_running:
                num_ops += retire()
            num_ops += admit(request)
            running.append(request)
        # An idle publisher would drain them about this often; the latest batch that cached
        # something is kept, to be weighed after the timing.
        events = manager.take_events()
        if any(isinstance(e, BlockStored) for e in events):
            drained[:] = events
        return num_ops

    drained: list[CacheEvent] = []
    one_pass()  # warm up: fill the cache so that later passes evict
    counts.update(hit_blocks=0, new_blocks=0)
    rate = rate_per_s(one_pass, duration_s=config.duration_s, label="block ops")
    while running:
        retire()
    manager.check_integrity()
    num_taken = counts["hit_blocks"] + counts["new_blocks"]
    # What one pass's events weigh on the wire to the index (gRPC), per block they cache.
    stored = [event_to_proto(e) for e in drained if isinstance(e, BlockStored)]
    num_stored_blocks = sum(len(e.stored.block_hashes) for e in stored)
    return {
        "block_ops_per_s": rate["median_per_s"],
        "best_block_ops_per_s": rate["best_per_s"],
        "hit_block_fraction": counts["hit_blocks"] / num_taken,
        "event_bytes_per_stored_block": sum(e.ByteSize() for e in stored) / num_stored_blocks,
        "num_blocks": config.num_blocks,
        "machine": machine_info(),
        "block_size": config.block_size,
    }
