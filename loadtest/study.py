"""``kvswitch bench routing``: every policy on the fleet simulator, over fleets of several sizes,
held to the goals a cache-aware policy should meet (docs/ROUTING.md).

Each fleet of N workers replays a generated trace (``TraceShape`` with 4 N shared prefixes, seed
N) and, with ``--trace``, a given one on ``--trace-workers`` workers. A worker holds
``capacity_fraction`` of the trace's distinct full blocks over N (so the fleet's caches together
hold that fraction: a cache-aware policy must choose what to keep), and arrivals are scaled so
that ``round_robin`` keeps the workers ``target_utilization`` busy. The goals, per policy:

- ``hit``: token hit rate at least ``hit_goal`` of the global cache's (one LRU cache of the whole
  fleet's capacity: the most routing can reach);
- ``balance``: load imbalance (busiest worker's prefill tokens over the mean) at most
  ``imbalance_goal``;
- ``ttft``: mean TTFT at least ``ttft_goal`` times lower than ``round_robin``'s.

``ttft_floor_s`` is the mean TTFT with no queueing and every block of the trace cached after its
first use (``infinite_cache``): no policy can beat it, so it bounds the TTFT ratio reachable.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvswitch.loadtest.cache_bounds import infinite_cache_hits
from kvswitch.loadtest.profiles import get_profile
from kvswitch.loadtest.sim import SimConfig, derive_capacity, parse_cost_weights, prepare
from kvswitch.loadtest.sim_report import run as run_sim
from kvswitch.loadtest.trace import (
    DEFAULT_BLOCK_TOKENS,
    TraceRequest,
    TraceShape,
    distinct_blocks,
    generate_trace,
    read_trace,
    write_trace,
)
from kvswitch.router.policy import make_policy

BLOCK = DEFAULT_BLOCK_TOKENS  # one trace block id stands for this many tokens


@dataclass(frozen=True)
class RoutingStudyConfig:
    fleet_sizes: str = "4,8,16"  # comma-separated worker counts for the generated traces
    num_requests: int = 3000  # per generated trace
    trace: str = ""  # also replay this trace (Mooncake format); empty: none
    trace_workers: int = 16
    capacity_fraction: float = 0.5
    target_utilization: float = 0.8
    profile: str = "gpu"
    cost_weights: str = ""  # "key=value,..." for the cost policy; empty: its defaults
    hit_goal: float = 0.95
    imbalance_goal: float = 1.3
    ttft_goal: float = 5.0
    plots: str = ""  # a folder for one PNG per fleet; empty: none

    def __post_init__(self) -> None:
        if not self.sizes():
            raise ValueError("fleet_sizes must name at least one worker count")
        if not 0 < self.capacity_fraction <= 1:
            raise ValueError(f"capacity_fraction must be in (0, 1], got {self.capacity_fraction}")
        make_policy("cost", parse_cost_weights(self.cost_weights))  # refuses bad weights now
        if self.num_requests < 1 or self.trace_workers < 1:
            raise ValueError("num_requests and trace_workers must be at least 1")

    def sizes(self) -> list[int]:
        try:
            sizes = [int(part) for part in self.fleet_sizes.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"fleet_sizes must be integers, got {self.fleet_sizes!r}") from None
        if any(size < 1 for size in sizes):
            raise ValueError(f"fleet_sizes must be positive, got {self.fleet_sizes!r}")
        return sizes


def run(config: RoutingStudyConfig) -> dict[str, Any]:
    fleets = []
    with tempfile.TemporaryDirectory(prefix="kvswitch-study-") as tmp:
        cases: list[tuple[str, Path, int]] = []
        for size in config.sizes():
            shape = TraceShape(num_requests=config.num_requests, num_prefixes=4 * size, seed=size)
            path = Path(tmp) / f"generated-{size}.jsonl"
            write_trace(path, generate_trace(shape))
            cases.append((f"generated, {size} workers", path, size))
        if config.trace:
            cases.append(
                (
                    f"{Path(config.trace).name}, {config.trace_workers} workers",
                    Path(config.trace),
                    config.trace_workers,
                )
            )
        for name, path, workers in cases:
            print(f"  {name} ...", file=sys.stderr)
            fleets.append(_fleet(config, name, path, workers))
    result = {"config": asdict(config), "fleets": fleets}
    if config.plots:
        from kvswitch.loadtest.study_plots import write_study_plots

        paths = write_study_plots(
            Path(config.plots), fleets, config.hit_goal, config.imbalance_goal
        )
        result["plots"] = [str(p) for p in paths]
    return result


def _fleet(config: RoutingStudyConfig, name: str, path: Path, workers: int) -> dict[str, Any]:
    trace = read_trace(path)
    unique = distinct_blocks(trace, BLOCK)
    capacity = derive_capacity(trace, workers, BLOCK, config.capacity_fraction).num_blocks
    sim = SimConfig(
        trace=str(path),
        workers=workers,
        capacity_blocks=capacity,
        target_utilization=config.target_utilization,
        profile=config.profile,
        cost_weights=config.cost_weights,
    )
    result = run_sim(sim, quiet=True)
    global_hit = result["global_cache"]["token_hit_rate"]
    rr_ttft = result["policies"]["round_robin"]["ttft_mean_s"]
    policies = {}
    for policy, figures in result["policies"].items():
        hit_of_global = figures["token_hit_rate"] / global_hit if global_hit else 1.0
        ttft_ratio = rr_ttft / figures["ttft_mean_s"]
        policies[policy] = figures | {
            "hit_of_global": hit_of_global,
            "ttft_vs_round_robin": ttft_ratio,
            "goals": {
                "hit": hit_of_global >= config.hit_goal,
                "balance": figures["load_imbalance"] <= config.imbalance_goal,
                "ttft": ttft_ratio >= config.ttft_goal,
            },
        }
    floor_s = ttft_floor_s(trace, config.profile)
    return {
        "name": name,
        "workers": workers,
        "num_requests": len(trace),
        "distinct_blocks": unique,
        "capacity_blocks": capacity,
        "rate_scale": result["rate_scale"],
        "global_cache": result["global_cache"],
        "infinite_cache": result["infinite_cache"],
        "ttft_floor_s": floor_s,
        "best_ttft_vs_round_robin": rr_ttft / floor_s,
        "policies": policies,
    }


def ttft_floor_s(trace: list[TraceRequest], profile_name: str) -> float:
    """Mean TTFT of the trace's requests each alone on an idle worker that holds every block
    seen before: no queueing, every possible hit."""
    profile = get_profile(profile_name)
    hits = infinite_cache_hits(prepare(trace, BLOCK), BLOCK)
    return statistics.fmean(
        profile.prefill_time_s(r.num_prompt_tokens, hit) for r, hit in zip(trace, hits, strict=True)
    )
