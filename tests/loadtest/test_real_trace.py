"""The Mooncake conversation trace beside the repository (../shared/traces), when it is there.

The project never reads it at run time and never ships it; this test only checks that the
simulator reads it whole and that its figures sit where the trace's own bound puts them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvswitch.loadtest.cache_bounds import global_cache_hit_rate, infinite_cache_hit_rate
from kvswitch.loadtest.sim import SimConfig, prepare, simulate
from kvswitch.loadtest.trace import read_trace

TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/traces/mooncake_conversation_trace.jsonl"
)

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"no trace at {TRACE}")


def test_the_real_trace_through_cost_and_round_robin() -> None:
    trace = read_trace(TRACE)
    assert len(trace) == 12_031
    assert 58 * 60 < trace[-1].arrival_s < 60 * 60
    requests = prepare(trace, 512)
    # Its README: a token-weighted prefix hit of about 37 % with an infinite cache.
    infinite = infinite_cache_hit_rate(requests, 512)
    assert infinite == pytest.approx(0.373, abs=0.001)
    config = SimConfig(trace=str(TRACE), workers=16, capacity_blocks=5000)
    fleet = global_cache_hit_rate(requests, 512, 16 * 5000)
    assert 0.3 < fleet <= infinite
    cost, round_robin = (simulate(requests, config, p, 1.0) for p in ("cost", "round_robin"))
    hit = {run.policy: run.num_cached_tokens / run.num_prompt_tokens for run in (cost, round_robin)}
    assert hit["round_robin"] < 0.15 < 0.3 < hit["cost"] < fleet
    assert sum(cost.ttfts_s) < sum(round_robin.ttfts_s)
