"""The hit-rate bounds: a cache that never evicts, and one cache the size of the fleet."""

from __future__ import annotations

import pytest

from kvswitch.loadtest.cache_bounds import global_cache_hit_rate, infinite_cache_hit_rate
from kvswitch.loadtest.sim import prepare
from kvswitch.loadtest.trace import TraceRequest
from tests.loadtest.helpers import chat_trace, sim_requests

B = 4
# Blocks of 4 tokens; ids chained. Hits count leading full blocks, never the last prompt token.
TINY = [
    TraceRequest(0.0, 10, 1, (1, 2, 3)),  # nothing cached yet: 0
    TraceRequest(1.0, 9, 1, (1, 2, 4)),  # 1, 2 cached: 8 tokens
    TraceRequest(2.0, 8, 1, (1, 2)),  # both cached, but the last token is computed: 4 tokens
    TraceRequest(3.0, 9, 1, (1, 2, 5)),  # 8 tokens
]


def test_the_infinite_cache_hit_rate_of_a_tiny_trace() -> None:
    requests = sim_requests(*TINY, block_tokens=B)
    assert infinite_cache_hit_rate(requests, B) == (0 + 8 + 4 + 8) / (10 + 9 + 8 + 9)


def test_a_small_global_cache_evicts_the_least_recently_freed_first() -> None:
    # Three blocks. Request 1 holds ids 1, 2 and frees them end first: 2 is evicted before 1.
    # Request 2 (ids 3, 4) takes the never-used block and then 2's block.
    trace = [
        TraceRequest(0.0, 8, 1, (1, 2)),
        TraceRequest(1.0, 8, 1, (3, 4)),
        TraceRequest(2.0, 9, 1, (1, 2, 5)),  # 1 still cached, 2 evicted: 4 tokens
    ]
    requests = sim_requests(*trace, block_tokens=B)
    assert global_cache_hit_rate(requests, B, num_blocks=3) == 4 / 25
    assert infinite_cache_hit_rate(requests, B) == 8 / 25


def test_a_global_cache_is_bounded_by_the_infinite_one_and_reaches_it_when_large() -> None:
    requests = prepare(chat_trace(400), 512)
    infinite = infinite_cache_hit_rate(requests, 512)
    rates = [global_cache_hit_rate(requests, 512, n) for n in (60, 200, 800, 100_000)]
    assert rates == sorted(rates)
    assert rates[0] < infinite
    assert rates[-1] == pytest.approx(infinite, abs=0)


def test_a_cache_too_small_for_a_request_says_so() -> None:
    with pytest.raises(ValueError, match="2 blocks cannot hold a request of 10 tokens"):
        global_cache_hit_rate(sim_requests(TINY[0], block_tokens=B), B, num_blocks=2)
