"""``kvswitch bench routing``: policies on simulated fleets, held to the goals."""

from __future__ import annotations

import pytest

from kvswitch.loadtest.study import RoutingStudyConfig, run


def test_the_study_scores_every_policy_against_its_goals_and_the_floor(tmp_path) -> None:
    config = RoutingStudyConfig(fleet_sizes="2,3", num_requests=150, plots=str(tmp_path))
    result = run(config)
    assert [f["workers"] for f in result["fleets"]] == [2, 3]
    for fleet in result["fleets"]:
        # The fleet's caches hold half the distinct blocks (or the largest request).
        assert fleet["capacity_blocks"] >= fleet["distinct_blocks"] // 2 // fleet["workers"]
        rr = fleet["policies"]["round_robin"]
        assert rr["ttft_vs_round_robin"] == 1.0 and rr["utilization"] == pytest.approx(
            0.8, abs=0.03
        )
        for policy, figures in fleet["policies"].items():
            # No policy beats no queueing with every possible hit.
            assert figures["ttft_mean_s"] >= fleet["ttft_floor_s"] * 0.999, policy
            assert figures["token_hit_rate"] <= fleet["infinite_cache"]["token_hit_rate"] + 1e-9
            goals = figures["goals"]
            assert goals["balance"] == (figures["load_imbalance"] <= 1.3)
            assert goals["hit"] == (figures["hit_of_global"] >= 0.95)
            assert goals["ttft"] == (figures["ttft_vs_round_robin"] >= 5.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "generated_2_workers.png",
        "generated_3_workers.png",
    ]


def test_the_study_refuses_bad_fleets() -> None:
    with pytest.raises(ValueError, match="fleet_sizes must be integers"):
        RoutingStudyConfig(fleet_sizes="four")
    with pytest.raises(ValueError, match="capacity_fraction must be in"):
        RoutingStudyConfig(capacity_fraction=0)


def test_the_cost_weights_reach_the_simulated_router() -> None:
    default, blind_run = (
        run(RoutingStudyConfig(fleet_sizes="3", num_requests=150, cost_weights=weights))
        for weights in ("", "prefill_weight=0,private_weight=0")
    )
    # A hit worth nothing: cost routes on load alone, and its hits fall to round robin's.
    cost, blind = default["fleets"][0]["policies"], blind_run["fleets"][0]["policies"]
    assert cost["cost"]["token_hit_rate"] > 1.1 * blind["cost"]["token_hit_rate"]
    assert blind["cost"]["token_hit_rate"] < 1.1 * blind["round_robin"]["token_hit_rate"]
    with pytest.raises(ValueError, match="unknown cost weights"):
        RoutingStudyConfig(cost_weights="speed=1")
    with pytest.raises(ValueError, match="'prefill_weight' is not key=number"):
        RoutingStudyConfig(cost_weights="prefill_weight")
