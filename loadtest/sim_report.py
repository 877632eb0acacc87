"""``kvswitch sim``: a trace through every policy, the bounds beside them, as JSON and a table.

The figures, per policy:

- ``token_hit_rate``: prompt tokens found in the chosen worker's cache on admission, over all
  prompt tokens (with peer block fetch, the blocks taken from a peer count: they were not
  computed);
- ``fetched_token_share``: prompt tokens taken from a peer's cache, over all prompt tokens;
- ``ttft_mean_s``, ``ttft_p50_s``, ``ttft_p99_s``: arrival to first token, queueing included;
- ``load_imbalance``: the busiest worker's prompt tokens computed over the mean worker's;
- ``utilization``: the mean over workers of time spent in steps over the makespan;
- ``lora_loads_per_minute``: LoRA adapters put in a worker's slot, a minute of the run (0 for a
  trace without adapters);
- ``offload_hit_rate``: prompt tokens loaded back from a worker's host tier
  (``offload_capacity_blocks``), over all prompt tokens; ``token_hit_rate`` counts them too.

``global_cache`` is the hit rate of one cache with the whole fleet's capacity serving every
request, ``infinite_cache`` that of a cache that never evicts (loadtest/cache_bounds.py); with
host tiers, ``global_cache_with_host`` that of one cache as large as the devices' and the host
tiers' blocks together.
``capacity`` is the KV blocks each worker had and how that number came about: given, or derived
from the trace when none was.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvswitch.loadtest.cache_bounds import global_cache_hit_rate, infinite_cache_hit_rate
from kvswitch.loadtest.figures import load_imbalance
from kvswitch.loadtest.rate_search import find_rate_scale
from kvswitch.loadtest.sim import (
    PolicyRun,
    SimConfig,
    check_capacity,
    fleet_capacity,
    prepare,
    simulate,
)
from kvswitch.loadtest.trace import load_trace


def policy_figures(run: PolicyRun) -> dict[str, float]:
    ttfts = np.asarray(run.ttfts_s)
    p50, p99 = np.percentile(ttfts, [50, 99])
    prefill = run.worker_prefill_tokens
    return {
        "token_hit_rate": run.num_cached_tokens / run.num_prompt_tokens,
        "offload_hit_rate": run.num_reloaded_tokens / run.num_prompt_tokens,
        "fetched_token_share": run.num_fetched_blocks * run.block_tokens / run.num_prompt_tokens,
        "ttft_mean_s": float(ttfts.mean()),
        "ttft_p50_s": float(p50),
        "ttft_p99_s": float(p99),
        "load_imbalance": load_imbalance(prefill),
        "utilization": run.utilization,
        "lora_loads_per_minute": run.lora_loads_per_minute,
    }


def run(config: SimConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Every figure of ``kvswitch sim``; progress and the table go to stderr unless ``quiet``."""

    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr)

    trace = load_trace(config.trace, config.block_tokens)
    capacity = fleet_capacity(trace, config)
    config = replace(config, capacity_blocks=capacity.num_blocks)
    check_capacity(trace, config.capacity_blocks, config.block_tokens)
    requests = prepare(trace, config.block_tokens)
    say(
        f"  {len(requests)} requests, {config.workers} workers of {capacity.num_blocks} blocks "
        f"({capacity.how})"
    )
    runs: dict[str, PolicyRun] = {}
    rate_scale = config.rate_scale
    if config.target_utilization:
        started_s = time.perf_counter()
        load_run = find_rate_scale(requests, config, config.target_utilization, quiet=quiet)
        rate_scale = load_run.rate_scale
        runs[load_run.policy] = load_run
        say(f"  rate scale {rate_scale:.4g} found in {time.perf_counter() - started_s:.1f} s")
    for policy in config.policies:
        if policy not in runs:
            started_s = time.perf_counter()
            runs[policy] = simulate(requests, config, policy, rate_scale)
            say(f"  {policy}: {time.perf_counter() - started_s:.1f} s")
    fleet_blocks = config.workers * config.capacity_blocks
    result = {
        "policies": {policy: policy_figures(runs[policy]) for policy in config.policies},
        "global_cache": {
            "token_hit_rate": global_cache_hit_rate(requests, config.block_tokens, fleet_blocks)
        },
        "infinite_cache": {
            "token_hit_rate": infinite_cache_hit_rate(requests, config.block_tokens)
        },
        **_global_cache_with_host(requests, config),
        "rate_scale": rate_scale,
        "capacity": {"blocks_per_worker": capacity.num_blocks, "how": capacity.how},
    }
    say(format_table(result, runs))
    return result


def _global_cache_with_host(requests: Any, config: SimConfig) -> dict[str, Any]:
    """With host tiers: one cache as large as every worker's device and host blocks together."""
    if not config.offload_capacity_blocks:
        return {}
    blocks = config.workers * (config.capacity_blocks + config.offload_capacity_blocks)
    return {
        "global_cache_with_host": {
            "token_hit_rate": global_cache_hit_rate(requests, config.block_tokens, blocks)
        }
    }


def format_table(result: dict[str, Any], runs: dict[str, PolicyRun]) -> str:
    header = (
        f"{'policy':<14}{'hit rate':>9}{'TTFT mean':>11}{'p50':>10}{'p99':>10}"
        f"{'imbalance':>11}{'util':>7}{'preempted':>11}"
    )
    with_loras = any(run.num_lora_loads for run in runs.values())
    if with_loras:
        header += f"{'lora loads/min':>16}"
    lines = [header]
    for policy, f in result["policies"].items():
        ttfts = "".join(
            f"{_seconds(f[key]):>{width}}"
            for key, width in (("ttft_mean_s", 11), ("ttft_p50_s", 10), ("ttft_p99_s", 10))
        )
        lines.append(
            f"{policy:<14}{f['token_hit_rate']:>9.1%}{ttfts}{f['load_imbalance']:>11.2f}"
            f"{f['utilization']:>7.2f}{runs[policy].num_preempted:>11}"
            + (f"{f['lora_loads_per_minute']:>16.1f}" if with_loras else "")
        )
    lines.append(f"{'global cache':<14}{result['global_cache']['token_hit_rate']:>9.1%}")
    lines.append(f"{'infinite cache':<14}{result['infinite_cache']['token_hit_rate']:>9.1%}")
    lines.append(f"rate scale {result['rate_scale']:.4g}")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 10 else f"{value:.4g} s" if value < 1e4 else f"{value:.0f} s"
