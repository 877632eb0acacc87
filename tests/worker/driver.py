"""Drive the KV cache manager the way an engine's scheduler does, one whole step at a time."""

from __future__ import annotations

from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import Request


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """Schedule a new request's whole prompt; returns the ids of its prefix-hit blocks."""
    hit, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hit) is not None
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hit]


def decode(manager: KVCacheManager, request: Request, token_id: int) -> None:
    """Append a sampled token and schedule the step that computes its KV."""
    request.append_token_ids([token_id])
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens = request.num_tokens
