"""Other routers' rules, for comparison (loadtest/policies.py), on hand-made fleets."""

from __future__ import annotations

import pytest

from kvswitch.loadtest.policies import ALL_POLICIES, make_any_policy
from kvswitch.router.policy import POLICIES, CostPolicy, RouteRequest, WorkerState

REQUEST = RouteRequest(num_prompt_tokens=4096, block_size=16)


def _state(worker_id, matched=0, *, requests=0, free=100, total=100, prefill=0):
    return WorkerState(worker_id, matched, prefill, free, total, requests, prefill)


def test_sglang_like_threshold_free_cache_and_imbalance() -> None:
    policy = make_any_policy("sglang_like")
    # 160 of 256 blocks is above half the prompt: the match wins.
    fleet_ = [_state("w0", 160, requests=5), _state("w1", 0, free=90)]
    decision = policy.choose(REQUEST, fleet_)
    assert (decision.worker_id, decision.reason) == ("w0", "match above the cache threshold")
    # 100 blocks is below half: the most free cache wins, however long the match.
    fleet_ = [_state("w0", 100, free=10), _state("w1", 0, free=90), _state("w2", 0, free=50)]
    assert policy.choose(REQUEST, fleet_).worker_id == "w1"
    # 40 requests apart (> 32) and busier: the fewest requests win over the match.
    fleet_ = [_state("w0", 250, requests=41), _state("w1", 0, requests=1)]
    decision = policy.choose(REQUEST, fleet_)
    assert (decision.worker_id, decision.reason) == ("w1", "imbalanced: fewest requests")
    assert (
        make_any_policy("sglang_like", {"balance_abs_threshold": 64})
        .choose(REQUEST, fleet_)
        .worker_id
        == "w0"
    )


def test_dynamo_like_weighs_prefill_and_decode_blocks() -> None:
    policy = make_any_policy("dynamo_like")
    # w0: 16 uncached blocks + 256 prompt blocks + 100 active = 372; w1: 256 + 256 + 0 = 512.
    fleet_ = [_state("w0", 240, free=0), _state("w1", 0, free=100)]
    decision = policy.choose(REQUEST, fleet_)
    assert (decision.worker_id, decision.score) == ("w0", 16 + 256 + 100)
    # Queued prefill counts as prefill blocks: 4,096 tokens queued at w0 tip it to w1.
    fleet_ = [_state("w0", 240, free=0, prefill=4096), _state("w1", 0)]
    assert policy.choose(REQUEST, fleet_).worker_id == "w1"
    # Overlap weighted 0: load alone.
    assert (
        make_any_policy("dynamo_like", {"overlap_score_weight": 0})
        .choose(REQUEST, [_state("w0", 240, free=0), _state("w1", 0)])
        .worker_id
        == "w1"
    )


def test_llmd_like_sums_prefix_queue_and_free_cache_scores() -> None:
    policy = make_any_policy("llmd_like")
    # w0: prefix 1.0 x 3, queue 0 x 2, free 0.5 x 2 = 4; w1: 0 + 2 + 2 = 4; w2: 0.5 x 3 + 1 + 2.
    fleet_ = [
        _state("w0", 256, requests=10, free=50),
        _state("w1", 0, requests=0, free=100),
        _state("w2", 128, requests=5, free=100),
    ]
    decision = policy.choose(REQUEST, fleet_)
    assert (decision.worker_id, decision.score) == ("w2", 4.5)
    heavy_prefix = make_any_policy("llmd_like", {"prefix_weight": 10})
    assert heavy_prefix.choose(REQUEST, fleet_).worker_id == "w0"


def test_make_any_policy_checks_each_policys_weights() -> None:
    assert isinstance(make_any_policy("cost", {"prefill_weight": 2}), CostPolicy)
    with pytest.raises(ValueError, match=r"unknown llmd_like weights \['cache'\]; known: prefix"):
        make_any_policy("llmd_like", {"cache": 1})
    with pytest.raises(ValueError, match="the round_robin policy takes no weights"):
        make_any_policy("round_robin", {"x": 1})
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest'; choose .*llmd_like"):
        make_any_policy("fastest")
    assert (*POLICIES, "sglang_like", "dynamo_like", "llmd_like") == ALL_POLICIES
