"""Routing policies: given what the index and the load reports say about each worker, pick one.

Pure logic, no I/O, so that it is tested directly and any caller can run it. Every policy returns a
``Decision`` that says why, so that the reason can travel back to the client.

The default, ``cost``, estimates the work a request adds to each worker and the work already
waiting there, in tokens, and picks the cheapest::

    cost(worker) = uncached prompt tokens x prefill_weight + the worker's outstanding tokens
                   (prompt tokens past the worker's cached prefix)

When nobody holds any of the prompt, every worker pays the same prefill, so the choice falls to
load, then free cache space, then a rotation: misses spread instead of piling onto one worker.
"""

from __future__ import annotations

import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One candidate worker, as the router sees it at decision time."""

    worker_id: str
    num_matched_blocks: int  # leading prompt blocks the index says it holds
    num_outstanding_tokens: int  # work already queued there, in tokens (reports + in flight)
    num_free_blocks: int = 0
    num_total_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    num_prompt_tokens: int
    block_size: int

    def num_uncached_tokens(self, num_matched_blocks: int) -> int:
        """Prompt tokens a worker holding ``num_matched_blocks`` leading blocks must compute."""
        # The last prompt token is always computed: a hit never covers the whole prompt.
        num_cached = min(num_matched_blocks * self.block_size, self.num_prompt_tokens - 1)
        return self.num_prompt_tokens - num_cached


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str
    policy: str
    reason: str
    num_matched_blocks: int
    score: float  # the policy's own measure of the chosen worker (cost: lower is better)


class Policy(ABC):
    """Picks a worker. Implementations may keep state across calls (a rotation), nothing else."""

    name: str

    @abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        """``workers`` is non-empty; the result names one of them."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        worker = ordered[next(self._counter) % len(ordered)]
        return Decision(worker.worker_id, self.name, "next in turn", worker.num_matched_blocks, 0.0)


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        worker = self._rng.choice(sorted(workers, key=lambda w: w.worker_id))
        return Decision(worker.worker_id, self.name, "random", worker.num_matched_blocks, 0.0)


class _Ranked(Policy):
    """Lowest key wins; ties go by free cache space, then a rotation over the tied workers."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def _pick(self, keyed: list[tuple[tuple, WorkerState]]) -> WorkerState:
        best = min(key for key, _ in keyed)
        tied = [w for key, w in keyed if key == best]
        most_free = max(w.num_free_blocks for w in tied)
        tied = sorted(
            (w for w in tied if w.num_free_blocks == most_free), key=lambda w: w.worker_id
        )
        return tied[next(self._counter) % len(tied)]


class LeastLoaded(_Ranked):
    name = "least_loaded"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        worker = self._pick([((w.num_outstanding_tokens,), w) for w in workers])
        return Decision(
            worker.worker_id,
            self.name,
            "least outstanding work",
            worker.num_matched_blocks,
            float(worker.num_outstanding_tokens),
        )


class PrefixPolicy(_Ranked):
    """Longest cached prefix, then least loaded."""

    name = "prefix"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        keyed = [((-w.num_matched_blocks, w.num_outstanding_tokens), w) for w in workers]
        worker = self._pick(keyed)
        reason = (
            "longest cached prefix"
            if worker.num_matched_blocks
            else "no cached prefix: least loaded"
        )
        return Decision(
            worker.worker_id,
            self.name,
            reason,
            worker.num_matched_blocks,
            float(worker.num_matched_blocks),
        )


class CostPolicy(_Ranked):
    name = "cost"

    def __init__(
        self,
        prefill_weight: float = 1.0,
        temperature: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__()
        if not prefill_weight >= 0 or not math.isfinite(prefill_weight):
            raise ValueError(f"prefill_weight must be a finite number >= 0, got {prefill_weight}")
        if not temperature >= 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        self.prefill_weight = prefill_weight
        self.temperature = temperature
        self._rng = rng or random.Random()

    def cost(self, request: RouteRequest, worker: WorkerState) -> float:
        uncached = request.num_uncached_tokens(worker.num_matched_blocks)
        return uncached * self.prefill_weight + worker.num_outstanding_tokens

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        costs = [(self.cost(request, w), w) for w in workers]
        if self.temperature > 0:
            # Softmax over -cost / temperature (costs in tokens): near-ties share the traffic.
            lowest = min(c for c, _ in costs)
            weights = [math.exp(-(c - lowest) / self.temperature) for c, _ in costs]
            cost, worker = self._rng.choices(costs, weights=weights)[0]
            reason = "sampled by cost"
        else:
            worker = self._pick([((c,), w) for c, w in costs])
            cost = self.cost(request, worker)
            reason = "lowest cost" if worker.num_matched_blocks else "no cached prefix: lowest load"
        return Decision(worker.worker_id, self.name, reason, worker.num_matched_blocks, cost)


POLICIES = ("cost", "prefix", "least_loaded", "round_robin", "random")
COST_WEIGHTS = ("prefill_weight", "temperature")


def make_policy(name: str, weights: Mapping[str, float] | None = None) -> Policy:
    """The policy called ``name``; ``weights`` tunes ``cost`` (``prefill_weight``,
    ``temperature``) and is refused for the others. ValueError says what is wrong."""
    weights = dict(weights or {})
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    if name == "cost":
        unknown = sorted(set(weights) - set(COST_WEIGHTS))
        if unknown:
            raise ValueError(f"unknown cost weights {unknown}; known: {', '.join(COST_WEIGHTS)}")
        return CostPolicy(**weights)
    if weights:
        raise ValueError(f"the {name} policy takes no weights")
    return {
        "prefix": PrefixPolicy,
        "least_loaded": LeastLoaded,
        "round_robin": RoundRobin,
        "random": RandomPolicy,
    }[name]()
