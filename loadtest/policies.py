"""Other routers' rules, for comparison: the simulator (``kvswitch sim``) and the routing study
(``kvswitch bench routing``) run them beside the router's own policies, on equal terms.

Each follows its project's published rule and defaults, read onto what this router sees: the
index's matched blocks, the workers' load reports and the router's in-flight counts. They are no
choice for serving: ``kvswitch router`` offers ``router/policy.py``'s ``POLICIES`` only.

Pure logic, no I/O, like the router's own (``router/policy.py``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvswitch.router.policy import (
    POLICIES,
    Decision,
    Policy,
    RankedPolicy,
    RouteRequest,
    WorkerState,
    check_weights,
    make_policy,
)


class SGLangLike(RankedPolicy):
    """SGLang's cache-aware router: while the fleet is balanced, the longest match if it covers
    more than ``cache_threshold`` of the prompt, else the worker with the most free cache; once the
    fleet is imbalanced (busiest minus idlest > ``balance_abs_threshold`` requests and busiest >
    ``balance_rel_threshold`` x idlest), the one with the fewest requests."""

    name = "sglang_like"
    weight_names = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.0001,
    ) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        loads = [w.num_requests for w in workers]
        busiest, idlest = max(loads), min(loads)
        if (
            busiest - idlest > self.balance_abs_threshold
            and busiest > self.balance_rel_threshold * idlest
        ):
            worker = self._pick([((w.num_requests,), w) for w in workers])
            reason = "imbalanced: fewest requests"
        else:
            best = max(w.num_matched_blocks for w in workers)
            matched = min(best * request.block_size, request.num_prompt_tokens)
            if matched / request.num_prompt_tokens > self.cache_threshold:
                worker = self._pick([((-w.num_matched_blocks,), w) for w in workers])
                reason = "match above the cache threshold"
            else:
                worker = self._pick([((-w.num_free_blocks,), w) for w in workers])
                reason = "match below the cache threshold: most free cache"
        return Decision(
            worker.worker_id, self.name, reason, worker.num_matched_blocks, worker.num_requests
        )


class DynamoLike(RankedPolicy):
    """Dynamo's KV router: the lowest ``overlap_score_weight`` x prefill blocks (the prompt's
    uncached blocks plus those queued there) + decode blocks (the blocks running requests hold
    there, plus the prompt's), in blocks."""

    name = "dynamo_like"
    weight_names = ("overlap_score_weight",)

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        super().__init__()
        self.overlap_score_weight = overlap_score_weight

    def logit(self, request: RouteRequest, worker: WorkerState) -> float:
        block_size = request.block_size
        prefill = request.num_uncached_tokens(worker.num_matched_blocks) + worker.num_prefill_tokens
        active = worker.num_total_blocks - worker.num_free_blocks
        decode = active + -(-request.num_prompt_tokens // block_size)
        return self.overlap_score_weight * prefill / block_size + decode

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        worker = self._pick([((self.logit(request, w),), w) for w in workers])
        return Decision(
            worker.worker_id,
            self.name,
            "lowest prefill + decode blocks",
            worker.num_matched_blocks,
            self.logit(request, worker),
        )


class LlmdLike(RankedPolicy):
    """llm-d's inference scheduler: the highest weighted sum of scores in [0, 1]: the prefix
    cached there as a fraction of the prompt's blocks (``prefix_weight``), the queue, min-max
    scaled over the candidates so that the shortest scores 1 (``queue_weight``), and the free
    fraction of the KV cache (``kv_cache_weight``)."""

    name = "llmd_like"
    weight_names = ("prefix_weight", "queue_weight", "kv_cache_weight")

    def __init__(
        self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_cache_weight: float = 2.0
    ) -> None:
        super().__init__()
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_cache_weight = kv_cache_weight

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        num_blocks = max(-(-request.num_prompt_tokens // request.block_size), 1)
        queues = [w.num_requests for w in workers]
        shortest, longest = min(queues), max(queues)

        def score(w: WorkerState) -> float:
            prefix = min(w.num_matched_blocks / num_blocks, 1.0)
            queue = (longest - w.num_requests) / (longest - shortest) if longest > shortest else 1
            free = w.num_free_blocks / w.num_total_blocks if w.num_total_blocks else 1.0
            return (
                self.prefix_weight * prefix
                + self.queue_weight * queue
                + self.kv_cache_weight * free
            )

        worker = self._pick([((-score(w),), w) for w in workers])
        return Decision(
            worker.worker_id,
            self.name,
            "highest prefix + queue + free-cache score",
            worker.num_matched_blocks,
            score(worker),
        )


_COMPARISON: dict[str, type[SGLangLike | DynamoLike | LlmdLike]] = {
    "sglang_like": SGLangLike,
    "dynamo_like": DynamoLike,
    "llmd_like": LlmdLike,
}
COMPARISON_POLICIES = tuple(_COMPARISON)
# Every policy the simulator replays: the router's own, then the others'.
ALL_POLICIES = POLICIES + COMPARISON_POLICIES


def make_any_policy(
    name: str, weights: Mapping[str, float] | None = None, *, rng: random.Random | None = None
) -> Policy:
    """The policy called ``name``, one of ``ALL_POLICIES``: the router's own by
    ``router.policy.make_policy``, another router's with its published knobs as ``weights``
    (``weight_names``). ValueError says what is wrong."""
    comparison = _COMPARISON.get(name)
    if comparison is None:
        if name not in POLICIES:
            raise ValueError(
                f"unknown routing policy {name!r}; choose from {', '.join(ALL_POLICIES)}"
            )
        return make_policy(name, weights, rng=rng)
    weights = dict(weights or {})
    check_weights(name, weights, comparison.weight_names)
    return comparison(**weights)
