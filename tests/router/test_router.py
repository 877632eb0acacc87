"""The router's own choices around the policy: the guesses it keeps, the weights a request may
override."""

from __future__ import annotations

from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.router.pending import PendingBlocks
from kvswitch.router.router import Router
from kvswitch.router.workers import WorkerDirectory
from tests.router.test_pending import Clock


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
    assert router._policy("prefix", {}).name == "prefix"  # the router's weights are cost's


class _Fleet(WorkerDirectory):
    """Workers that are always routable and never dialled."""

    def __init__(self, index: MemoryIndex, handles: list) -> None:
        super().__init__(index)
        self._fleet = handles

    def routable(self, exclude=frozenset(), *, engines=False):
        return [h for h in self._fleet if h.worker_id not in exclude]


def test_the_router_spreads_a_prefix_that_has_long_been_hot() -> None:
    import asyncio
    import math

    from kvswitch.cache_index.hashing import BlockHasher
    from kvswitch.cache_index.index import WorkerInfo
    from kvswitch.router.heat import PrefixHeat
    from kvswitch.router.router import RoutePlan
    from kvswitch.router.workers import WorkerHandle

    clock = Clock()
    index = MemoryIndex(clock)
    hasher = BlockHasher("m", 16)
    system = list(range(1, 1025))  # 64 blocks every request opens with

    def plan(user: int) -> RoutePlan:
        tokens = system + [200 + user] * 32
        return RoutePlan(tokens, "m", 16, hasher.hash_blocks(tokens))

    async def go() -> list[str]:
        handles = []
        for k in range(4):
            info = WorkerInfo(f"w{k}", f"x:{k}", "m", 16, num_blocks=1000)
            await index.register(info, ttl_s=math.inf)
            handles.append(WorkerHandle(info, channel=None, stub=None))
        router = Router(index, _Fleet(index, handles), None, heat=PrefixHeat(clock=clock))
        picks = []
        for user in range(12):
            clock.now_s = 2.0 * user  # one request every 2 s: hot after 10 s
            decision, handle = await router.choose(plan(user))
            router.routed(plan(user), decision)
            handle.num_prefill_tokens += 300  # each request leaves work queued where it went
            picks.append(decision.worker_id)
        return picks

    picks = asyncio.run(go())
    # The first requests follow the prefix to w0 (1,024 tokens of prefill outweigh its queue);
    # once it has been asked for over 10 s it counts as held everywhere, and it spreads until
    # three of the four workers hold it (all of the traffic, against 1.5 x 3/4 of the workers).
    # Without the heat, w0 takes seven and one other worker the rest.
    assert picks[:5] == ["w0"] * 5
    assert len(set(picks)) == 3 and max(picks.count(w) for w in set(picks)) <= 5, picks


def test_a_conversation_stays_with_its_history_while_its_shared_prompt_spreads() -> None:
    import asyncio
    import math

    from kvswitch.cache_index.hashing import BlockHasher
    from kvswitch.cache_index.index import WorkerInfo
    from kvswitch.router.heat import PrefixHeat
    from kvswitch.router.router import RoutePlan
    from kvswitch.router.workers import WorkerHandle

    hasher = BlockHasher("m", 16)
    system = list(range(1, 65))  # 4 blocks every conversation opens with

    def plan(*parts: list[int]) -> RoutePlan:
        tokens = system + [t for part in parts for t in part]
        return RoutePlan(tokens, "m", 16, hasher.hash_blocks(tokens))

    a_1 = [100] * 192  # 12 blocks of conversation A
    a_2 = [101] * 64
    requests = [plan(a_1), plan([200] * 64), plan([300] * 64), plan(a_1, a_2)]

    async def go(weights: dict[str, float]) -> list[tuple[str, float]]:
        clock = Clock()
        index = MemoryIndex(clock)
        handles = []
        for k in range(2):
            info = WorkerInfo(f"w{k}", f"x:{k}", "m", 16, num_blocks=1000)
            await index.register(info, ttl_s=math.inf)
            handles.append(WorkerHandle(info, channel=None, stub=None))
        fleet = _Fleet(index, handles)
        router = Router(index, fleet, None, weights=weights, heat=PrefixHeat(clock=clock))
        picks = []
        for k, routed in enumerate(requests):
            if k == 2:
                handles[0].num_output_tokens = 100  # w0 is decoding A's and B's answers
            decision, _ = await router.choose(routed)
            router.routed(routed, decision)
            picks.append((decision.worker_id, decision.score))
        return picks

    # A and then B (while the system prompt is still one line) go to w0. Then C, a third
    # conversation on the now shared system prompt, is copied to the idle w1: 64 + 64 x 5 there,
    # against 64 x 5 + 100 x 6 on w0. A's next turn stays with its history on w0: 64 x 5 + 600
    # there, against 256 x 5 on w1.
    assert asyncio.run(go({})) == [("w0", 1280), ("w0", 320), ("w1", 384), ("w0", 920)]
    # Valued like a shared prefix, A's history moves: 64 + 600 against 256.
    picks = asyncio.run(go({"private_weight": 1}))
    assert [worker_id for worker_id, _ in picks] == ["w0", "w0", "w1", "w1"]


def test_a_worker_that_leaves_during_the_index_lookup_is_not_chosen() -> None:
    """A Redis that comes back empty lists no worker until each registers again: the router's
    refresh drops them all, and closes their channels, while a lookup may be under way."""
    import asyncio
    import math

    import pytest

    from kvswitch.cache_index.hashing import BlockHasher
    from kvswitch.cache_index.index import WorkerInfo
    from kvswitch.router.router import NoWorkerError, RoutePlan
    from kvswitch.router.workers import WorkerHandle

    hasher = BlockHasher("m", 16)
    tokens = list(range(1, 65))
    plan = RoutePlan(tokens, "m", 16, hasher.hash_blocks(tokens))

    class LeavingDuringLookup(MemoryIndex):
        def __init__(self, leaving: list[WorkerHandle]) -> None:
            super().__init__()
            self.leaving = leaving

        async def match(self, namespace, chain):
            for handle in self.leaving:
                handle.removed = True  # as WorkerDirectory.refresh does, then closes its channel
            return await super().match(namespace, chain)

    async def go(num_leaving: int) -> str:
        handles = [
            WorkerHandle(WorkerInfo(f"w{k}", f"x:{k}", "m", 16, num_blocks=1000), None, None)
            for k in range(2)
        ]
        handles[1].num_output_tokens = 1000  # w0 would be chosen: it is idle
        index = LeavingDuringLookup(handles[:num_leaving])
        for handle in handles:
            await index.register(handle.info, ttl_s=math.inf)
        router = Router(index, _Fleet(index, handles), None)
        decision, handle = await router.choose(plan)
        assert handle.worker_id == decision.worker_id
        return decision.worker_id

    assert asyncio.run(go(0)) == "w0"
    assert asyncio.run(go(1)) == "w1"
    with pytest.raises(NoWorkerError, match="left the index"):
        asyncio.run(go(2))
