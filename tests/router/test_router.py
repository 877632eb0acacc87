"""The router's own choices around the policy: the guesses it keeps, the weights a request may
override."""

from __future__ import annotations

from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.router.pending import PendingBlocks
from kvswitch.router.router import Router
from kvswitch.router.workers import WorkerDirectory


def test_the_router_keeps_the_guesses_it_is_given_even_while_they_are_empty() -> None:
    index = MemoryIndex()
    pending = PendingBlocks(ttl_s=7.5)  # empty, so falsy: it must not be swapped for a default
    router = Router(index, WorkerDirectory(index), None, pending=pending)
    assert router.pending is pending and router.pending.ttl_s == 7.5


def test_a_requests_weights_keep_the_routers_own_for_the_rest() -> None:
    index = MemoryIndex()
    router = Router(
        index, WorkerDirectory(index), None, weights={"prefill_weight": 3.0, "decode_weight": 2}
    )
    policy = router._policy("", {"temperature": 5.0})
    assert (policy.prefill_weight, policy.decode_weight, policy.temperature) == (3.0, 2, 5.0)
    assert router._policy("cost", {"prefill_weight": 1.0}).prefill_weight == 1.0
    assert router._policy("llmd_like", {"queue_weight": 1.0}).prefix_weight == 3.0  # its own
