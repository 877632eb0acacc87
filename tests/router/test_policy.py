"""Routing policies on hand-made fleets: who wins, why, and how misses spread."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvswitch.router.policy import (
    CostPolicy,
    LeastLoaded,
    PrefixPolicy,
    RandomPolicy,
    RoundRobin,
    RouteRequest,
    WorkerState,
    make_policy,
)

REQUEST = RouteRequest(num_prompt_tokens=4096, block_size=16)


def fleet(*specs: tuple[int, int]) -> list[WorkerState]:
    """Workers w0, w1, ... with (matched blocks, outstanding tokens) and equal free space."""
    return [WorkerState(f"w{i}", m, o, 100, 100) for i, (m, o) in enumerate(specs)]


def test_cost_prefers_the_cached_worker_until_its_queue_outweighs_the_hit() -> None:
    policy = CostPolicy()
    # w1 holds 240 of 256 blocks: 3,840 cached tokens saved, against 1,000 tokens of queue.
    decision = policy.choose(REQUEST, fleet((0, 0), (240, 1000)))
    assert (decision.worker_id, decision.num_matched_blocks) == ("w1", 240)
    assert decision.score == (4096 - 3840) + 1000
    assert decision.reason == "lowest cost"
    # With 5,000 tokens queued there, recomputing elsewhere is cheaper.
    assert policy.choose(REQUEST, fleet((0, 0), (240, 5000))).worker_id == "w0"
    # A lower prefill weight values the hit less.
    assert (
        CostPolicy(prefill_weight=0.1).choose(REQUEST, fleet((0, 0), (240, 1000))).worker_id == "w0"
    )


def test_a_full_hit_still_computes_the_last_token() -> None:
    request = RouteRequest(num_prompt_tokens=64, block_size=16)
    decision = CostPolicy().choose(request, fleet((4, 0)))
    assert decision.score == 1  # 64 tokens, 63 cached at most


def test_misses_spread_by_load_then_free_space_then_in_turn() -> None:
    policy = CostPolicy()
    idle = fleet((0, 0), (0, 0), (0, 0))
    picks = [policy.choose(REQUEST, idle).worker_id for _ in range(6)]
    assert sorted(Counter(picks).values()) == [2, 2, 2]
    # More free cache space wins a tie on load.
    roomy = [*idle[:2], WorkerState("w2", 0, 0, 500, 500)]
    assert {policy.choose(REQUEST, roomy).worker_id for _ in range(4)} == {"w2"}
    # Less load wins first.
    busy = [WorkerState("w0", 0, 10, 900, 1000), WorkerState("w1", 0, 0, 10, 1000)]
    assert policy.choose(REQUEST, busy).worker_id == "w1"
    assert policy.choose(REQUEST, busy).reason == "no cached prefix: lowest load"


def test_cost_temperature_samples_near_ties() -> None:
    policy = CostPolicy(temperature=500.0, rng=random.Random(0))
    workers = fleet((0, 0), (0, 100), (0, 100_000))
    picks = Counter(policy.choose(REQUEST, workers).worker_id for _ in range(2000))
    assert picks["w2"] == 0  # 100k tokens worse: never
    assert picks["w0"] > picks["w1"] > 500  # 100 tokens apart: both used, the cheaper more


def test_prefix_least_loaded_round_robin_random() -> None:
    workers = fleet((10, 5000), (20, 9000), (0, 0))
    assert PrefixPolicy().choose(REQUEST, workers).worker_id == "w1"
    assert LeastLoaded().choose(REQUEST, workers).worker_id == "w2"
    rr = RoundRobin()
    assert [rr.choose(REQUEST, workers).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    rnd = RandomPolicy(random.Random(1))
    assert {rnd.choose(REQUEST, workers).worker_id for _ in range(50)} == {"w0", "w1", "w2"}
    assert PrefixPolicy().choose(REQUEST, fleet((0, 3), (0, 1))).reason.startswith("no cached")


def test_make_policy_and_overrides() -> None:
    assert make_policy("cost").name == "cost"
    tuned = make_policy("cost", {"prefill_weight": 0.5, "temperature": 2.0})
    assert (tuned.prefill_weight, tuned.temperature) == (0.5, 2.0)
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="unknown cost weights"):
        make_policy("cost", {"speed": 1.0})
    with pytest.raises(ValueError, match="takes no weights"):
        make_policy("prefix", {"prefill_weight": 1.0})
    with pytest.raises(ValueError, match="prefill_weight"):
        CostPolicy(prefill_weight=-1)
