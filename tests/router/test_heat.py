"""Hot prefixes: a decayed share of the traffic, against the share of workers that hold them."""

from __future__ import annotations

import hashlib

import pytest

from kvswitch.router.heat import PrefixHeat
from kvswitch.router.policy import CostPolicy, RouteRequest, WorkerState
from tests.router.test_pending import Clock


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest()[:16] for i in range(n)]


def test_a_prefix_with_more_traffic_than_holders_is_hot_at_its_counted_depth() -> None:
    clock = Clock()
    heat = PrefixHeat(time_constant_s=1000, min_age_s=10, clock=clock)
    system = chain("system", 8)
    for i in range(9):  # nine requests open with the same 8-block system prompt
        heat.record(system + chain(f"user {i}", 4))
    heat.record(chain("other", 12))
    lookup = system + chain("user 99", 4)
    # A burst on a new prefix is not hot yet: it stays where its first request went.
    assert heat.hot_blocks(lookup, {"w0": 8, "w1": 0, "w2": 0, "w3": 0}, 4) == 0
    clock.now_s = 10
    # One of four workers holds the system prompt: 9 of 10 requests against 1 of 4 workers.
    assert heat.hot_blocks(lookup, {"w0": 8, "w1": 0, "w2": 0, "w3": 0}, 4) == 8
    # Held by three of four, 0.9 is under 1.5 x 0.75 of the traffic: no longer hot.
    assert heat.hot_blocks(lookup, {"w0": 8, "w1": 8, "w2": 8, "w3": 0}, 4) == 0
    # A deeper match counts down to the deepest counted prefix (8, the power of two under 10).
    assert heat.hot_blocks(lookup, {"w0": 10, "w1": 0}, 4) == 8
    # The rare prefix is not hot however few hold it.
    assert heat.hot_blocks(chain("other", 12), {"w0": 12}, 4) == 0
    assert heat.hot_blocks(lookup, {}, 4) == 0


def test_heat_fades_and_needs_a_few_requests() -> None:
    clock = Clock()
    heat = PrefixHeat(time_constant_s=10, min_age_s=0, clock=clock)
    hot = chain("doc", 4)
    heat.record(hot)
    heat.record(hot)
    assert heat.hot_blocks(hot, {"w0": 4}, 8) == 0  # 2 requests: under min_requests
    heat.record(hot)
    assert heat.hot_blocks(hot, {"w0": 4}, 8) == 4
    clock.now_s = 15  # 3 x e^-1.5 = 0.67 requests left
    assert heat.hot_blocks(hot, {"w0": 4}, 8) == 0


def test_the_counts_are_pruned_once_nobody_asks() -> None:
    clock = Clock()
    heat = PrefixHeat(time_constant_s=1, clock=clock)
    for i in range(5000):
        heat.record(chain(f"r{i}", 1))
        clock.now_s += 0.01
    assert len(heat) < 5000  # old one-off prefixes went at the 4,096th entry
    with pytest.raises(ValueError, match="time_constant_s must be positive"):
        PrefixHeat(time_constant_s=0)


def test_a_prefix_is_shared_once_routed_requests_go_different_ways_after_it() -> None:
    heat = PrefixHeat(clock=Clock())
    system = chain("system", 4)
    turn_1 = system + chain("a1", 4)  # 8 blocks
    turn_2 = turn_1 + chain("a2", 8)  # 16 blocks: each turn extends the last
    turn_3 = turn_2 + chain("a3", 4)
    for routed in (turn_1, turn_2, turn_2):  # one conversation, its last turn sent twice
        heat.record(routed)
    assert heat.shared_blocks(turn_3) == 0  # one line so far: every block its own
    heat.record(system + chain("b1", 4))  # another conversation on the same system prompt
    # Depths 1, 2 and 4 branched; 8 and 16 are still the first conversation's alone.
    assert heat.shared_blocks(turn_3) == 4
    assert heat.shared_blocks(system + chain("c1", 4)) == 4
    assert heat.shared_blocks(system[:3]) == 2  # the deepest counted depth in 3 blocks
    assert heat.shared_blocks(chain("new", 8)) == heat.shared_blocks([]) == 0
    # A chain shorter than the longest on its line (an earlier turn asked again) is a branch.
    heat.record(turn_1)
    assert heat.shared_blocks(turn_3) == 8


def test_cost_counts_a_hot_prefix_as_held_by_every_worker() -> None:
    workers = [
        WorkerState("w0", 8, 100, 100, 100, 1, 100),  # holds the 128-token prefix, has a queue
        WorkerState("w1", 0, 0, 100, 100, 0, 0),
    ]
    cold = RouteRequest(num_prompt_tokens=160, block_size=16)
    assert CostPolicy().choose(cold, workers).worker_id == "w0"  # 32 + 100 < 160
    hot = RouteRequest(num_prompt_tokens=160, block_size=16, num_hot_blocks=8)
    decision = CostPolicy().choose(hot, workers)
    assert (decision.worker_id, decision.score) == ("w1", 32)
