"""The host-memory tier: blocks the device evicts are kept there and loaded back instead of
computed, with the same tokens; copies that the device overtakes are dropped, never waited
for; a full tier drops its least recently used block and says so; and the events, replayed
without reading their medium, give every hash the worker holds in either tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvswitch.cache_index.events import HOST, BlockRemoved, BlockStored, CacheEvent, replay
from kvswitch.worker.block_pool import KVBlock
from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.offload import HostTier
from kvswitch.worker.request import SamplingParams

BLOCK = 16
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4  # the built-in model: K and V, 2 layers, 2x64, fp32


def engine(num_blocks: int, num_host_blocks: int = 0) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            kv_cache_bytes=num_blocks * BLOCK_BYTES,
            offload_gb=num_host_blocks * BLOCK_BYTES / 2**30,
            check_integrity=True,
        )
    )


def run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    """The request's output tokens and its number of cached prompt tokens."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
    tokens, num_cached = [], None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
                if output.ttft_s is not None:
                    num_cached = output.num_cached_tokens
    engine.kv_cache.check_integrity()
    return tokens, num_cached


def prompt(seed: int, num_blocks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, num_blocks * BLOCK + 1).tolist()


def test_evicted_blocks_are_loaded_back_with_the_same_tokens() -> None:
    assert engine(12).kv_cache.pool.num_blocks == 12  # the block size this test assumes
    tiered, events = engine(12, num_host_blocks=64), []
    first, other = prompt(1, 5), prompt(2, 10)
    want, _ = run(engine(64), "ref", first, 8)  # computed, on a device with room

    tokens, num_cached = run(tiered, "a", first, 8)
    assert (tokens, num_cached) == (want, 0)
    assert tiered.offload.flush(timeout_s=60)  # its freed blocks are copied out
    run(tiered, "b", other, 1)  # evicts four of the first prompt's five full blocks
    events += tiered.take_events()
    hashes = tiered.hasher().hash_blocks(np.array(first))
    offloaded = [e for e in events if getattr(e, "medium", None) == HOST]
    assert [(type(e), set(e.block_hashes)) for e in offloaded] == [(BlockStored, set(hashes[1:5]))]
    assert tiered.offload.cached_hashes() == set(hashes[1:5])

    tokens, num_cached = run(tiered, "again", first, 8)
    # One block was still on the device, four came back from host memory: nothing computed.
    assert num_cached == 5 * BLOCK
    assert tokens == want
    assert tiered.offload.stats.num_loaded == 4
    events += tiered.take_events()
    device_cached = set(tiered.kv_cache.pool.cached_block_hashes())
    host_cached = tiered.offload.cached_hashes()
    assert not device_cached & host_cached and set(hashes[:5]) <= device_cached
    # Replayed without reading the medium, the events give what either tier caches.
    assert replay(events) == device_cached | host_cached


def test_a_prompt_past_its_loaded_blocks_computes_the_rest() -> None:
    tiered = engine(12, num_host_blocks=64)
    first = prompt(5, 5)
    run(tiered, "a", first, 1)
    tiered.offload.flush(timeout_s=60)
    run(tiered, "b", prompt(6, 10), 1)  # evicts four of the first prompt's blocks
    # The same five blocks, then three new ones and a token: only the five are cached.
    longer = first[: 5 * BLOCK] + prompt(7, 3)
    want, _ = run(engine(64), "ref", longer, 6)
    tokens, num_cached = run(tiered, "longer", longer, 6)
    assert num_cached == 5 * BLOCK
    assert tokens == want


def test_blocks_loaded_back_leave_host_memory_as_the_device_caches_them() -> None:
    tiered = engine(12, num_host_blocks=64)
    first = prompt(3, 5)
    run(tiered, "a", first, 1)
    tiered.offload.flush(timeout_s=60)
    run(tiered, "b", prompt(4, 10), 1)
    tiered.take_events()
    run(tiered, "again", first, 1)
    events = tiered.take_events()
    hashes = tiered.hasher().hash_blocks(np.array(first))
    moved = [
        (type(e).__name__, e.medium)
        for e in events
        if set(getattr(e, "block_hashes", ())) & set(hashes[1:5])
    ]
    # Removed from host memory first, then stored on the device.
    assert moved[:2] == [("BlockRemoved", HOST), ("BlockStored", None)]


def _tier(num_blocks: int, events: list[CacheEvent]) -> tuple[HostTier, list]:
    device = [(torch.randn(4, BLOCK, 1, 3), torch.randn(4, BLOCK, 1, 3))]
    return HostTier(device, num_blocks, emit=events.append, start=False), device


def _blocks(*names: bytes) -> list[KVBlock]:
    blocks = [KVBlock(i) for i in range(len(names))]
    for block, name in zip(blocks, names, strict=True):
        block.block_hash = name
    return blocks


def test_a_copy_the_device_overtakes_is_dropped_not_waited_for() -> None:
    events: list[CacheEvent] = []
    tier, device = _tier(2, events)
    b0, b1 = _blocks(b"h0", b"h1")
    tier.stage([b0, b1])  # queued; the thread has not started
    tier.evicted([(0, b"h0", True)])  # block 0 is about to be overwritten: its copy goes
    assert tier.stats.num_dropped == 1
    tier.start()
    assert tier.flush(timeout_s=60)
    tier.evicted([(1, b"h1", True)])  # done before the device took the block: kept
    assert events == [BlockStored((b"h1",), medium=HOST)]
    assert tier.num_cached_blocks == 1 and tier.num_leading_cached([b"h1", b"h0"]) == 1
    slot = tier._entries[b"h1"].slot
    assert torch.equal(tier.caches[0][0][slot], device[0][0][1])
    assert torch.equal(tier.caches[0][1][slot], device[0][1][1])
    tier.close()


def test_a_full_tier_drops_its_least_recently_used_block_and_says_so() -> None:
    events: list[CacheEvent] = []
    tier, _ = _tier(2, events)
    tier.start()
    b0, b1, b2 = _blocks(b"h0", b"h1", b"h2")
    tier.stage([b0, b1])
    tier.flush(timeout_s=60)
    tier.evicted([(0, b"h0", True), (1, b"h1", True)])
    tier.stage([b2])  # no free slot: h0, the least recently used, goes
    tier.flush(timeout_s=60)
    assert events == [
        BlockStored((b"h0", b"h1"), medium=HOST),
        BlockRemoved((b"h0",), medium=HOST),
    ]
    assert tier.stats.num_evicted == 1 and tier.num_leading_cached([b"h1"]) == 1
    tier.close()


def test_a_load_copies_the_rows_in_and_the_device_caching_them_ends_them_here() -> None:
    events: list[CacheEvent] = []
    tier, device = _tier(2, events)
    tier.start()
    (b0,) = _blocks(b"h0")
    tier.stage([b0])
    tier.flush(timeout_s=60)
    tier.evicted([(0, b"h0", True)])
    saved = device[0][0][0].clone()
    device[0][0][3].zero_()
    assert tier.load("t", "r", {b"h0": 3}) == 1
    tier.flush(timeout_s=60)
    assert tier.take_landed() == [("t", "r")]
    assert torch.equal(device[0][0][3], saved)
    tier.cached([b"h0"])  # the device cached it
    tier.finish_load("t")
    assert events[-1] == BlockRemoved((b"h0",), medium=HOST)
    assert tier.num_cached_blocks == 0 and tier.stats.num_loaded == 1
    tier.close()


def test_the_tier_is_refused_without_prefix_caching_or_room() -> None:
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(offload_gb=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="offload_gb"):
        EngineConfig(offload_gb=-1.0)
    with pytest.raises(ValueError, match="holds no block"):
        engine(12, num_host_blocks=0.5)


def test_events_say_their_tier_across_the_core_pipe_and_not_in_vllms_format() -> None:
    from kvswitch.cache_index.vllm_events import to_engine_events
    from kvswitch.worker import core_protocol as wire

    events = [
        BlockRemoved((b"a" * 16,)),
        BlockStored((b"a" * 16,), medium=HOST),
        BlockRemoved((b"a" * 16,), medium=HOST),
        BlockStored((b"a" * 16,), (1, 2), None, None, None),
    ]
    assert wire.events_from_wire(wire.events_to_wire(events)) == events
    # vLLM's format describes the device's blocks only (the host tier's carry no tokens).
    assert [type(e).__name__ for e in to_engine_events(events, 2)] == [
        "EngineBlockRemoved",
        "EngineBlockStored",
    ]
