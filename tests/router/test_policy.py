"""Routing policies on hand-made fleets: who wins, why, and how misses spread."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvswitch.router.policy import (
    CostPolicy,
    LeastLoaded,
    LoraResidence,
    PrefixPolicy,
    RandomPolicy,
    RoundRobin,
    RouteRequest,
    WorkerState,
    fetch_costs,
    make_policy,
)

REQUEST = RouteRequest(num_prompt_tokens=4096, block_size=16)


def fleet(*specs: tuple[int, int]) -> list[WorkerState]:
    """Workers w0, w1, ... with (matched blocks, outstanding prompt tokens to prefill) and equal
    free space."""
    return [WorkerState(f"w{i}", m, o, 100, 100, 0, o) for i, (m, o) in enumerate(specs)]


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


def test_cost_weighs_output_still_to_decode_by_decode_weight() -> None:
    # w1 holds the whole prompt but has 1,000 output tokens to decode: 6,000 at the default.
    workers = [WorkerState("w0", 0, 0, 100, 100), WorkerState("w1", 256, 1000, 100, 100)]
    decision = CostPolicy().choose(REQUEST, workers)
    assert (decision.worker_id, decision.score) == ("w0", 4096)
    decision = CostPolicy(decode_weight=1).choose(REQUEST, workers)
    assert (decision.worker_id, decision.score) == ("w1", 1 + 1000)


def test_cost_values_a_conversations_own_history_above_a_shared_prefix() -> None:
    # 160 tokens: a 64-token shared system prompt (4 blocks), then the request's own tokens.
    request = RouteRequest(num_prompt_tokens=160, block_size=16, num_shared_blocks=4)
    # w0 holds the conversation so far (8 blocks) and has 300 tokens queued; w1 the system prompt.
    # w0: 32 private tokens x 5 + 300; w1: 96 private tokens x 5.
    decision = CostPolicy().choose(request, fleet((8, 300), (4, 0)))
    assert (decision.worker_id, decision.score) == ("w0", 32 * 5 + 300)
    # Valued like a shared prefix, the history would move: 32 + 300 against 96.
    assert CostPolicy(private_weight=1).choose(request, fleet((8, 300), (4, 0))).worker_id == "w1"
    # A new conversation: the shared prompt alone is worth no more than a prefill, so it is
    # copied to the idle worker (64 + 96 x 5 there, against 96 x 5 + 300 on its holder).
    decision = CostPolicy().choose(request, fleet((4, 300), (0, 0)))
    assert (decision.worker_id, decision.score) == ("w1", 64 + 96 * 5)
    unshared = RouteRequest(num_prompt_tokens=160, block_size=16, num_shared_blocks=0)
    assert CostPolicy().choose(unshared, fleet((4, 300), (0, 0))).worker_id == "w0"
    assert (request.num_private_tokens, unshared.num_private_tokens) == (96, 160)
    assert RouteRequest(num_prompt_tokens=160, block_size=16).num_private_tokens == 0


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


def test_cost_credits_the_adapters_affinity_on_top_of_the_prefix() -> None:
    """Loaded 1.0, a free slot 0.8, evicting 0 of ``lora_load_tokens``; a cached prefix still
    outweighs an adapter load, and a request without an adapter pays nothing."""
    residences = [LoraResidence.EVICT, LoraResidence.FREE_SLOT, LoraResidence.LOADED]
    workers = [WorkerState(f"w{i}", 0, 0, 100, 100, lora=r) for i, r in enumerate(residences)]
    policy = CostPolicy(lora_load_tokens=1000)
    costs = [policy.cost(REQUEST, w) for w in workers]
    assert [c - 4096 for c in costs] == pytest.approx([1000, 200, 0])
    assert policy.choose(REQUEST, workers).worker_id == "w2"
    assert policy.choose(REQUEST, workers[:2]).worker_id == "w1"
    # A worker that holds the prompt's prefix but must evict wins over a loaded empty one.
    holder = WorkerState("w0", 200, 0, 100, 100, lora=LoraResidence.EVICT)
    assert policy.choose(REQUEST, [holder, workers[2]]).worker_id == "w0"
    # The weights tune the affinity; without an adapter a worker pays none of it.
    flat = CostPolicy(lora_load_tokens=1000, lora_free_slot_weight=0.0, lora_loaded_weight=0.5)
    assert [flat.cost(REQUEST, w) - 4096 for w in workers] == pytest.approx([1000, 1000, 500])
    assert policy.cost(REQUEST, WorkerState("w3", 0, 0, 100, 100)) == 4096
    with pytest.raises(ValueError, match="lora_free_slot_weight must be between 0 and 1"):
        CostPolicy(lora_free_slot_weight=1.5)


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


def test_make_policy_checks_each_policys_weights() -> None:
    assert isinstance(make_policy("cost", {"prefill_weight": 2}), CostPolicy)
    with pytest.raises(ValueError, match="the round_robin policy takes no weights"):
        make_policy("round_robin", {"x": 1})


def test_the_serving_router_offers_its_own_policies_only() -> None:
    # Other routers' rules are the simulator's (loadtest/policies.py), no choice for serving.
    with pytest.raises(ValueError, match="unknown routing policy 'llmd_like'; choose from cost,"):
        make_policy("llmd_like")


def test_a_short_shared_prefix_does_not_pull_new_documents_onto_one_worker() -> None:
    # Six new documents of 2,000 tokens after a 96-token system prompt that only w0 holds so far
    # (each document is asked one after another: nothing is queued anywhere).
    request = RouteRequest(num_prompt_tokens=2000, block_size=16)
    policy = CostPolicy()
    picks = [policy.choose(request, fleet((6, 0), (0, 0))).worker_id for _ in range(6)]
    assert sorted(Counter(picks).values()) == [3, 3]
    # A follow-up question that matches its whole document stays with it.
    assert policy.choose(request, fleet((6, 0), (120, 0))).worker_id == "w1"
    # Without the threshold the 96-token hit wins every time.
    herding = CostPolicy(min_match=0)
    assert {herding.choose(request, fleet((6, 0), (0, 0))).worker_id for _ in range(6)} == {"w0"}


# -- peer block fetch ---------------------------------------------------------------------------


def holder_and_idle(queue_tokens: int) -> list[WorkerState]:
    """w0 holds 240 of the prompt's 256 blocks (the index says so) behind ``queue_tokens`` of
    prefill; w1 holds nothing and is idle."""
    return [
        WorkerState("w0", 240, queue_tokens, 100, 100, 1, queue_tokens, num_fetchable_blocks=240),
        WorkerState("w1", 0, 0, 100, 100, 0, 0),
    ]


def test_an_idle_worker_takes_the_prefix_from_an_overloaded_holder() -> None:
    policy = CostPolicy(fetch_token_cost=0.1, fetch_latency_tokens=50)
    decision = policy.choose(REQUEST, holder_and_idle(queue_tokens=2000))
    assert (decision.worker_id, decision.fetch_from) == ("w1", "w0")
    assert (decision.num_matched_blocks, decision.num_fetched_blocks) == (240, 240)
    # 256 uncached tokens left, plus 50 + 0.1 x 3,840 to move the prefix.
    assert decision.score == pytest.approx(256 + 50 + 384)
    assert decision.reason == "lowest cost, its prefix taken from a peer"


def test_the_holder_serves_when_moving_the_prefix_costs_more_than_its_queue() -> None:
    policy = CostPolicy(fetch_token_cost=0.1, fetch_latency_tokens=50)
    decision = policy.choose(REQUEST, holder_and_idle(queue_tokens=400))
    assert (decision.worker_id, decision.fetch_from, decision.score) == ("w0", "", 256 + 400)
    # Without peer fetch the idle worker computes the whole prompt: 4,096 > 256 + 2,000.
    plain = CostPolicy().choose(REQUEST, holder_and_idle(queue_tokens=2000))
    assert (plain.worker_id, plain.fetch_from) == ("w0", "")


def test_only_blocks_the_index_confirms_are_fetched() -> None:
    guessed = [  # w0's 240 blocks are a guess: still being prefilled, nothing to take yet
        WorkerState("w0", 240, 2000, 100, 100, 1, 2000),
        WorkerState("w1", 0, 0, 100, 100, 0, 0),
    ]
    decision = CostPolicy(fetch_token_cost=0.1).choose(REQUEST, guessed)
    assert (decision.worker_id, decision.fetch_from) == ("w0", "")


def test_fetch_weights_come_from_measured_speeds() -> None:
    weights = fetch_costs(200_000, 0.002, 20_000)
    assert weights == {"fetch_token_cost": 0.1, "fetch_latency_tokens": 40.0}
    assert make_policy("cost", weights).fetch_cost(1000) == pytest.approx(140.0)
    with pytest.raises(ValueError, match="fetch_token_cost must be a finite number >= 0"):
        CostPolicy(fetch_token_cost=-1)


def test_a_conversations_own_history_costs_more_to_move() -> None:
    """Past the shared prefix (120 blocks) the prompt is one conversation's history: moved, it
    serves nobody else, so each such token moved costs private_weight times as much."""
    request = RouteRequest(num_prompt_tokens=4096, block_size=16, num_shared_blocks=120)
    policy = CostPolicy(fetch_token_cost=0.1, fetch_latency_tokens=50)
    decision = policy.choose(request, holder_and_idle(queue_tokens=2000))
    assert (decision.worker_id, decision.fetch_from) == ("w1", "w0")
    # 256 private tokens to compute (x 5), 50 + 0.1 x 3,840 to move, 1,920 of them private.
    assert decision.score == pytest.approx(256 * 5 + 50 + 384 + 1920 * 0.1 * 4)
    decision = policy.choose(request, holder_and_idle(queue_tokens=1100))
    assert (decision.worker_id, decision.fetch_from) == ("w0", "")
