"""The fleet simulator on small traces: exact prefill times, the cache the worker would have, the
router's guesses and accounting, repeatable runs, and the rate search."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from kvswitch.loadtest.cache_bounds import global_cache_hit_rate, infinite_cache_hit_rate
from kvswitch.loadtest.policies import ALL_POLICIES
from kvswitch.loadtest.profiles import CPU
from kvswitch.loadtest.rate_search import find_rate_scale
from kvswitch.loadtest.sim import SimConfig, check_capacity, prepare, simulate
from kvswitch.loadtest.trace import TraceRequest, load_trace
from tests.loadtest.helpers import B, chat_trace, config, sim_requests, spaced


def hit_rate(run) -> float:
    return run.num_cached_tokens / run.num_prompt_tokens


def test_a_request_on_an_idle_worker_waits_exactly_its_prefill() -> None:
    first = TraceRequest(0.0, 5000, 4, tuple(range(10)))  # three chunks of the 2,048 budget
    again = TraceRequest(1000.0, 5000, 4, (*range(9), 99))  # its 9 full blocks are cached
    run = simulate(sim_requests(first, again), config(workers=1), "round_robin", 1.0)
    assert run.ttfts_s[0] == CPU.prefill_time_s(5000)
    assert run.ttfts_s[1] == pytest.approx(CPU.prefill_time_s(5000, 9 * B), rel=1e-12)
    assert run.ttfts_s[1] < run.ttfts_s[0] / 5
    assert run.num_cached_tokens == 9 * B
    assert run.worker_prefill_tokens == [5000 + 5000 - 9 * B]


def test_round_robin_on_one_worker_holds_what_one_global_cache_holds() -> None:
    requests = prepare(spaced(chat_trace(200), gap_s=100.0), B)
    run = simulate(requests, config(workers=1, capacity_blocks=40), "round_robin", 1.0)
    global_rate = global_cache_hit_rate(requests, B, 40)
    assert hit_rate(run) == global_rate
    assert 0 < global_rate < infinite_cache_hit_rate(requests, B)


def test_cache_aware_policies_find_more_of_the_prompt_cached() -> None:
    requests = prepare(chat_trace(400), B)
    runs = {p: simulate(requests, config(), p, 1.0) for p in ("cost", "prefix", "round_robin")}
    infinite = infinite_cache_hit_rate(requests, B)
    assert hit_rate(runs["round_robin"]) + 0.1 < hit_rate(runs["cost"]) <= infinite
    assert hit_rate(runs["round_robin"]) + 0.1 < hit_rate(runs["prefix"]) <= infinite


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_the_books_balance_at_every_arrival_through_preemptions(policy: str) -> None:
    requests = prepare(chat_trace(150, requests_per_s=200.0), B)
    run = simulate(requests, config(capacity_blocks=24), policy, 1.0, check=True)
    assert run.num_preempted > 0
    assert all(0 < ttft < math.inf for ttft in run.ttfts_s)
    assert 0 < run.utilization <= 1


def test_a_run_repeats_and_follows_its_seed() -> None:
    requests = prepare(chat_trace(200), B)
    a, b = (simulate(requests, config(), "random", 1.0) for _ in range(2))
    assert (a.worker_ids, a.ttfts_s) == (b.worker_ids, b.ttfts_s)
    assert simulate(requests, config(seed=1), "random", 1.0).worker_ids != a.worker_ids


def burst(num_requests: int) -> list[TraceRequest]:
    """Questions on one 16-block document, a millisecond apart."""
    return [
        TraceRequest(i / 1000, 16 * B + 100, 8, (*range(16), 100 + i)) for i in range(num_requests)
    ]


@pytest.mark.parametrize("policy", ["cost", "prefix"])
def test_a_burst_on_one_document_follows_the_routers_guess(policy: str) -> None:
    requests = sim_requests(*burst(8))
    guessed = simulate(requests, config(), policy, 1.0)
    assert len(set(guessed.worker_ids)) == 1
    assert hit_rate(guessed) > 0.8  # one prefill of the document serves all eight
    # Guesses that lapse at once: the index learns the blocks only as the first chunk ends.
    unguessed = simulate(requests, config(pending_ttl_s=1e-6), policy, 1.0)
    assert len(set(unguessed.worker_ids)) == 4


def test_router_replicas_that_hear_each_other_at_once_route_as_one_router() -> None:
    """Four replicas, each request to the next: told every route (guesses, heat, tie rotation)
    and every confirmation as it happens, they choose what one router chooses, request by
    request; told nothing, a burst on one document spreads over the replicas' first choices."""
    # Documents on many small workers: guesses confirmed, then evicted, and prefixes turning hot.
    requests = prepare(load_trace("generated:docs,num_requests=1200", B), B)
    fleet = config(workers=64, capacity_blocks=17, profile="gpu")
    one = simulate(requests, fleet, "cost", 1.0)
    replicas = simulate(
        requests, replace(fleet, router_replicas=4, replica_delay_ms=0), "cost", 1.0
    )
    assert replicas.worker_ids == one.worker_ids
    documents = sim_requests(*burst(8))
    alone = simulate(documents, config(router_replicas=4, replica_delay_ms=-1), "cost", 1.0)
    together = simulate(documents, config(router_replicas=4, replica_delay_ms=0), "cost", 1.0)
    assert len(set(together.worker_ids)) == 1
    assert len(set(alone.worker_ids)) > 1


def test_the_rate_search_finds_the_target_utilization() -> None:
    requests = prepare(chat_trace(300), B)
    run = find_rate_scale(requests, config(), 0.5, tolerance=0.01, quiet=True)
    assert run.policy == "round_robin"
    assert run.utilization == pytest.approx(0.5, abs=0.01)
    faster = simulate(requests, config(), "round_robin", run.rate_scale * 2)
    assert faster.utilization > run.utilization + 0.1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"capacity_blocks": -1}, "capacity_blocks must be >= 1"),
        ({"policy": "fastest"}, "policy must be all or one of cost, prefix"),
        ({"rate_scale": 2.0, "target_utilization": 0.8}, "not both"),
        ({"target_utilization": 1.0}, "target_utilization must be in (0, 1)"),
        ({"profile": "tpu"}, "profile must be one of cpu, gpu"),
        ({"trace": ""}, "give the trace to replay"),
    ],
)
def test_a_bad_config_says_what_is_wrong(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        SimConfig(**({"trace": "t.jsonl", "capacity_blocks": 10} | fields))
    assert message in str(error.value)


def test_a_capacity_that_cannot_hold_a_request_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot hold the trace's largest request .* 3 blocks"):
        check_capacity([TraceRequest(0.0, 1100, 30, (1, 2, 3))], 2, B)


def test_decode_steps_cost_what_the_profile_says_and_an_arrival_joins_the_next() -> None:
    """A lone request decodes its output in ``n - 1`` steps whose context grows a token a step;
    a second request arriving mid-decode waits for the step under way, then prefills beside it."""
    p1, n1, p2 = 700, 400, 900
    steps = [CPU.prefill_time_s(p1)]
    for produced in range(1, n1):  # step k computes the KV of the k-th output token
        steps.append(CPU.step_time_s(0, 0, 1, p1 + produced))
    alone = simulate(sim_requests(TraceRequest(0.0, p1, n1, (1, 2))), config(workers=1), "cost", 1)
    assert alone.worker_busy_s[0] == pytest.approx(sum(steps), rel=1e-12)
    assert alone.makespan_s == pytest.approx(sum(steps), rel=1e-12)

    arrival_s = steps[0] + 0.37 * sum(steps[1:])
    ends = [sum(steps[: k + 1]) for k in range(len(steps))]
    k = next(k for k, end in enumerate(ends) if end > arrival_s)  # the step under way
    produced = k + 1  # output tokens once it ends
    mixed = CPU.step_time_s(p2, p2 * (p2 + 1) / 2, 1, p1 + produced)
    second = TraceRequest(arrival_s, p2, 4, (7, 8))
    run = simulate(
        sim_requests(TraceRequest(0.0, p1, n1, (1, 2)), second), config(workers=1), "cost", 1
    )
    assert run.ttfts_s[1] == pytest.approx(ends[k] - arrival_s + mixed, rel=1e-9)


def test_peer_fetch_moves_a_busy_holders_prefix_to_idle_workers() -> None:
    """One document, computed once, then asked about in a burst with long answers: its holder
    soon has more work than moving the prefix costs, and the other workers take it from there
    instead of computing it (the books still balance at every arrival)."""
    first = TraceRequest(0.0, 16 * B + 100, 8, (*range(16), 99))
    burst = [
        TraceRequest(2.0 + i / 1000, 16 * B + 100, 256, (*range(16), 100 + i)) for i in range(24)
    ]
    requests = sim_requests(first, *burst)
    plain = simulate(requests, config(), "cost", 1.0, check=True)
    fetched = simulate(requests, config(fetch_tokens_per_s=2e6), "cost", 1.0, check=True)
    assert plain.num_fetched_blocks == 0
    assert plain.worker_prefill_tokens == [16 * B + 25 * 100, 0, 0, 0]  # all on the holder
    assert fetched.num_fetched_blocks >= 16 * 3  # every other worker took the document
    # ... and computed only its questions: the document was computed once in the fleet.
    assert fetched.worker_prefill_tokens[0] >= 16 * B
    assert all(0 < n < 16 * B for n in fetched.worker_prefill_tokens[1:])
    assert sum(fetched.worker_prefill_tokens) == 16 * B + 25 * 100
    assert hit_rate(fetched) == hit_rate(plain)
    assert statistics.fmean(fetched.ttfts_s) < statistics.fmean(plain.ttfts_s) / 2
