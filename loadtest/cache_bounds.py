"""What routing could reach at best: the token hit rate of one cache serving the whole trace.

- ``infinite_cache_hit_rate``: a cache that never evicts; the trace's own bound.
- ``global_cache_hit_rate``: one block pool with the whole fleet's capacity, every request
  admitted and freed in arrival order (its full footprint, prompt and output, held meanwhile).
  No routing can share more than one cache would, short of holding fewer blocks per request.

Both count hits as a worker does: leading full blocks, never the prompt's last token.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswitch.loadtest.kv_blocks import BlockTable, KVBlocks
from kvswitch.loadtest.sim import SimRequest


def infinite_cache_hit_rate(requests: Sequence[SimRequest], block_tokens: int) -> float:
    num_tokens = sum(r.request.num_prompt_tokens for r in requests)
    return sum(infinite_cache_hits(requests, block_tokens)) / num_tokens


def infinite_cache_hits(requests: Sequence[SimRequest], block_tokens: int) -> list[int]:
    """Each request's prompt tokens that a cache holding every earlier request's blocks serves."""
    seen: set[bytes] = set()
    hits = []
    for sim_request in requests:
        num_prompt = sim_request.request.num_prompt_tokens
        num_blocks = 0
        for block_hash in sim_request.block_hashes[: (num_prompt - 1) // block_tokens]:
            if block_hash not in seen:
                break
            num_blocks += 1
        hits.append(num_blocks * block_tokens)
        seen.update(sim_request.block_hashes)
    return hits


def global_cache_hit_rate(
    requests: Sequence[SimRequest], block_tokens: int, num_blocks: int
) -> float:
    cache = KVBlocks(num_blocks, block_tokens)
    num_hit = num_tokens = 0
    for sim_request in requests:
        request = sim_request.request
        hashes = sim_request.block_hashes
        hit = cache.lookup(hashes, request.num_prompt_tokens)
        table = BlockTable()
        # The last output token's KV is never computed.
        num_held = request.num_prompt_tokens + request.num_output_tokens - 1
        if not cache.allocate(table, hashes, num_held, hit):
            raise ValueError(f"{num_blocks} blocks cannot hold a request of {num_held} tokens")
        cache.free(table)
        num_hit += len(hit) * block_tokens
        num_tokens += request.num_prompt_tokens
        cache.pool.take_events()  # nobody reads them
    return num_hit / num_tokens
