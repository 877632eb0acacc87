"""A host tier under each simulated worker's cache (``--offload-capacity-blocks``): blocks the
device evicts move there, least recently used dropped for room, and load back instead of being
computed, each load costing its step ``reload_tokens_per_s``; the events it sends the index say
so in the worker's order."""

from __future__ import annotations

import pytest

from kvswitch.cache_index.events import HOST, BlockRemoved, BlockStored, replay
from kvswitch.loadtest.kv_blocks import BlockTable, KVBlocks
from kvswitch.loadtest.sim import SimConfig, prepare, simulate
from kvswitch.loadtest.sim_report import policy_figures
from kvswitch.loadtest.trace import TraceRequest
from tests.loadtest.helpers import B, chat_trace, config, sim_requests, spaced


def _hashes(*names: int) -> list[bytes]:
    return [bytes([n]) * 16 for n in names]


def _run(blocks: KVBlocks, hashes: list[bytes]) -> int:
    """Admit a prompt of ``hashes`` and a token, free it; the tokens it found cached."""
    hit = blocks.lookup(hashes, len(hashes) * 4 + 1)
    num_host = blocks.num_in_host(hashes, len(hit), len(hashes) * 4 + 1)
    table = BlockTable()
    assert blocks.allocate(table, hashes, len(hashes) * 4 + 1, hit)
    blocks.free(table)
    return (len(hit) + num_host) * 4


def test_evicted_blocks_move_to_the_host_tier_and_back() -> None:
    blocks = KVBlocks(4, 4, num_host_blocks=2)
    first, other = _hashes(1, 2), _hashes(7, 8, 9)
    _run(blocks, first)
    _run(blocks, other)  # takes every free block: the first prompt's two go to the host tier
    assert set(blocks.host) == set(first)
    assert _run(blocks, first) == 8  # both loaded back...
    assert not set(blocks.host) & set(first)  # ...so the host tier lets go of them
    events = blocks.pool.take_events()
    moved = [
        (type(e), set(e.block_hashes))
        for e in events
        if getattr(e, "medium", None) == HOST and set(e.block_hashes) & set(first)
    ]
    assert moved == [(BlockStored, set(first)), (BlockRemoved, set(first))]
    # Replayed without their medium, the events give every hash either tier holds.
    assert replay(events) == set(blocks.pool.cached_block_hashes()) | set(blocks.host)


def test_a_full_host_tier_drops_its_least_recently_used_block() -> None:
    blocks = KVBlocks(3, 4, num_host_blocks=1)
    _run(blocks, _hashes(1))
    _run(blocks, _hashes(2, 3))  # evicts 1 to the host tier
    assert list(blocks.host) == _hashes(1)
    # Evicts 3, then 2 (a chain's end first): each pushes out the one before.
    _run(blocks, _hashes(4, 5))
    assert list(blocks.host) == _hashes(2)
    events = blocks.pool.take_events()
    assert replay(events) == set(blocks.pool.cached_block_hashes()) | set(blocks.host)


def test_a_load_back_costs_its_step_and_counts_as_a_hit() -> None:
    """One worker of room for one prompt: a prompt, another that evicts it, the first again. With
    a host tier the third finds its four blocks there, each costing a load."""
    first, other = (4, 5, 6, 7), (10, 11, 12, 13)
    trace = spaced(
        [
            TraceRequest(0.0, 4 * B + 1, 1, first),
            TraceRequest(0.0, 4 * B + 1, 1, other),
            TraceRequest(0.0, 4 * B + 1, 1, first),
        ],
        gap_s=100.0,
    )
    fleet = config(workers=1, capacity_blocks=5)
    runs = {
        name: simulate(sim_requests(*trace), fleet_config, "cost", 1.0)
        for name, fleet_config in {
            "none": fleet,
            "fast": SimConfig(**{**vars(fleet), "offload_capacity_blocks": 8}),
            "slow": SimConfig(
                **{**vars(fleet), "offload_capacity_blocks": 8, "reload_tokens_per_s": B}
            ),
        }.items()
    }
    assert runs["none"].num_reloaded_tokens == 0
    assert runs["fast"].num_reloaded_tokens == runs["slow"].num_reloaded_tokens == 4 * B
    figures = policy_figures(runs["fast"])
    assert figures["offload_hit_rate"] == pytest.approx(4 * B / (3 * (4 * B + 1)))
    assert figures["token_hit_rate"] == figures["offload_hit_rate"]
    # Four blocks at one block a second: the third request's first token, 4 s later.
    extra = runs["slow"].ttfts_s[2] - runs["fast"].ttfts_s[2]
    assert extra == pytest.approx(4.0 - 4 * B / 200_000.0)
    assert runs["fast"].ttfts_s[2] < runs["none"].ttfts_s[2]  # loading beats computing


def test_a_fleet_with_host_tiers_hits_more_and_its_books_balance() -> None:
    requests = prepare(chat_trace(400, requests_per_s=50.0), B)
    fleet = config(workers=4, capacity_blocks=24)
    without = simulate(requests, fleet, "cost", 1.0, check=True)
    tiered = SimConfig(**{**vars(fleet), "offload_capacity_blocks": 96})
    with_host = simulate(requests, tiered, "cost", 1.0, check=True)
    assert with_host.num_reloaded_tokens > 0
    assert with_host.num_cached_tokens > without.num_cached_tokens


def test_the_host_tier_s_numbers_are_checked() -> None:
    with pytest.raises(ValueError, match="offload_capacity_blocks must be >= 0"):
        config(offload_capacity_blocks=-1)
    with pytest.raises(ValueError, match="reload_tokens_per_s must be a positive number"):
        config(reload_tokens_per_s=0)


def test_the_router_weighs_host_blocks_in_the_simulator_too() -> None:
    """The simulated index keeps each worker's device tier in an entry of its own, as a live
    worker's does: a host block counted for nothing draws fewer requests to where it is."""
    requests = prepare(chat_trace(400, requests_per_s=50.0), B)
    fleet = config(workers=4, capacity_blocks=24, offload_capacity_blocks=96)
    loaded = {
        weight: simulate(
            requests, SimConfig(**{**vars(fleet), "cpu_block_weight": weight}), "cost", 1.0
        ).num_reloaded_tokens
        for weight in (0.0, 1.0)
    }
    assert loaded[0.0] < loaded[1.0]
