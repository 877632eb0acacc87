"""Routing policies: given what the index and the load reports say about each worker, pick one.

Pure logic, no I/O, so that it is tested directly and any caller can run it. Every policy returns a
``Decision`` that says why, so that the reason can travel back to the client.

The default, ``cost``, estimates the work a request adds to each worker and the work already
waiting there, in prefill-token units, and picks the cheapest::

    cost(worker) = uncached tokens of a shared prefix x prefill_weight   (past the worker's
                 + uncached tokens past it x private_weight               cached prefix)
                 + prompt tokens queued there to prefill
                 + output tokens still to decode there x decode_weight

A decode token costs a device several prefill tokens' time (it reads the whole context to make
one token), and a worker's decodes stay for as long as its conversations do: ``decode_weight`` 6
is what the fleet simulator found to keep hot prefixes from piling onto one worker while giving
up the fewest hits (docs/ROUTING.md). A match shorter than ``min_match`` of the prompt counts as
none: a short shared system prompt must not pull every new document onto the one worker that
happens to hold it, leaving the others' caches empty. A prefix the router finds hot (for a while
now a larger share of the traffic than of the workers holding it, router/heat.py) counts as held
by every worker, so that it spreads to more workers instead of queueing on its holders.

A prompt splits where the router has seen requests go different ways (router/heat.py)::

    prompt  | system prompt, document | this conversation's own history | new message |
            |<-- shared prefix ------>|<-- private: one line of requests so far ------>|

A shared prefix is worth copying to another worker, which then serves its other conversations
too; a conversation's own history moved elsewhere serves nobody else, and its next turns lose
their worker. ``private_weight`` 5 values those tokens above a shared prefix's (docs/ROUTING.md).
Tokens that no worker holds count the same everywhere, so only held ones sway the choice.

When nobody holds any of the prompt, every worker pays the same prefill, so the choice falls to
load, then free cache space, then a rotation: misses spread instead of piling onto one worker.

A request naming a LoRA adapter goes only to workers that serve it, and the cost adds what
loading the adapter would take there, less its affinity (docs/LORA.md)::

    + lora_load_tokens x (1 - affinity)    affinity: lora_loaded_weight where it is in a device
                                           slot, lora_free_slot_weight where a slot is free,
                                           0 where it must evict another adapter

Peer block fetch (off unless ``fetch_token_cost`` is set): a worker may take the longest cached
prefix from the worker that holds it, paying its transfer instead of its prefill::

    cost(worker, taking the prefix) = cost(worker, as if it held the prefix)
                                    + fetch_latency_tokens + fetch_token_cost x tokens moved
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class LoraResidence(enum.Enum):
    """Where a request's LoRA adapter is on a worker."""

    NONE = "none"  # the request names no adapter
    LOADED = "loaded"  # in a device slot: it runs at once
    FREE_SLOT = "free_slot"  # a slot is free: it loads there, evicting nothing
    EVICT = "evict"  # every slot is taken: another adapter makes way


@dataclass(slots=True)
class WorkerState:
    """One candidate worker, as the router sees it at decision time (not to be changed).

    NOTE: not frozen: one is built for every candidate of every request, and a frozen
    dataclass sets each field through ``object.__setattr__`` (the 64 states of a route at 64
    workers took 167 us, 104 now with ``WorkerHandle.state``'s fewer lookups: ``kvswitch bench
    lookup``'s ``candidate_states_us``)."""

    worker_id: str
    num_matched_blocks: int  # leading prompt blocks the index says it holds
    num_outstanding_tokens: int  # work already queued there, in tokens (reports + in flight)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_requests: int = 0  # requests running or queued there (reports + in flight)
    num_prefill_tokens: int = 0  # the part of the outstanding work that is prompt to prefill
    # Leading prompt blocks the index says it holds now (no guesses): what a peer could take.
    num_fetchable_blocks: int = 0
    lora: LoraResidence = LoraResidence.NONE


@dataclass(frozen=True, slots=True)
class RouteRequest:
    num_prompt_tokens: int
    block_size: int
    # Leading blocks whose prefix has long carried so much of the traffic that the router wants
    # it on more workers (router/heat.py): a policy may count them as cached on every worker.
    num_hot_blocks: int = 0
    # Leading blocks after which routed requests have gone different ways (router/heat.py); the
    # tokens past them are private to one line of requests. None: not known, every one is shared.
    num_shared_blocks: int | None = None
    # Where a rotation over tied workers stands: the requests routed so far by every router
    # replica (router/replicas.py), so that replicas break ties alike. None: the policy's own.
    rotation: int | None = None

    @property
    def num_private_tokens(self) -> int:
        """Prompt tokens past the shared prefix."""
        if self.num_shared_blocks is None:
            return 0
        return max(self.num_prompt_tokens - self.num_shared_blocks * self.block_size, 0)

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
    num_matched_blocks: int  # leading blocks cached there (once taken from ``fetch_from``)
    score: float  # the policy's own measure of the chosen worker (cost: lower is better)
    # Peer block fetch: the worker to take the prompt's cached prefix from first; empty: none.
    fetch_from: str = ""
    num_fetched_blocks: int = 0


class Policy(ABC):
    """Picks a worker. Implementations may keep state across calls (a rotation), nothing else."""

    name: str
    weight_names: tuple[str, ...] = ()  # what ``make_policy``'s weights may set

    @abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        """``workers`` is non-empty; the result names one of them."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        turn = next(self._counter) if request.rotation is None else request.rotation
        worker = ordered[turn % len(ordered)]
        return Decision(worker.worker_id, self.name, "next in turn", worker.num_matched_blocks, 0.0)


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        worker = self._rng.choice(sorted(workers, key=lambda w: w.worker_id))
        return Decision(worker.worker_id, self.name, "random", worker.num_matched_blocks, 0.0)


class RankedPolicy(Policy):
    """Lowest key wins; ties go by free cache space, then a rotation over the tied workers."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def _pick(
        self, keyed: list[tuple[tuple, WorkerState]], rotation: int | None = None
    ) -> WorkerState:
        """``rotation``: where the rotation over tied workers stands; None: the policy's own
        count of picks."""
        best = min(key for key, _ in keyed)
        tied = [w for key, w in keyed if key == best]
        most_free = max(w.num_free_blocks for w in tied)
        tied = sorted(
            (w for w in tied if w.num_free_blocks == most_free), key=lambda w: w.worker_id
        )
        return tied[(next(self._counter) if rotation is None else rotation) % len(tied)]


class LeastLoaded(RankedPolicy):
    name = "least_loaded"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        worker = self._pick([((w.num_outstanding_tokens,), w) for w in workers], request.rotation)
        return Decision(
            worker.worker_id,
            self.name,
            "least outstanding work",
            worker.num_matched_blocks,
            float(worker.num_outstanding_tokens),
        )


class PrefixPolicy(RankedPolicy):
    """Longest cached prefix, then least loaded."""

    name = "prefix"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        keyed = [((-w.num_matched_blocks, w.num_outstanding_tokens), w) for w in workers]
        worker = self._pick(keyed, request.rotation)
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


class CostPolicy(RankedPolicy):
    """The module docstring's cost; ``temperature`` > 0 samples near-ties instead.

    With ``fetch_token_cost`` > 0, a worker may also take the prompt's cached prefix from the
    worker that holds the longest one (peer block fetch) and compute only the rest: its cost is
    then the cost with that prefix held, plus ``fetch_latency_tokens`` + ``fetch_token_cost`` x
    the tokens moved (what moving a token's KV costs, in prefill tokens: prefill speed over
    transfer speed, both measured). It is chosen where that is cheaper, for example when the
    holder is overloaded and another worker is idle."""

    name = "cost"
    weight_names = (
        "prefill_weight",
        "temperature",
        "decode_weight",
        "min_match",
        "private_weight",
        "fetch_token_cost",
        "fetch_latency_tokens",
        "lora_load_tokens",
        "lora_loaded_weight",
        "lora_free_slot_weight",
    )

    def __init__(
        self,
        prefill_weight: float = 1.0,
        temperature: float = 0.0,
        decode_weight: float = 6.0,
        min_match: float = 0.1,
        private_weight: float = 5.0,
        fetch_token_cost: float = 0.0,
        fetch_latency_tokens: float = 0.0,
        lora_load_tokens: float = 256.0,
        lora_loaded_weight: float = 1.0,
        lora_free_slot_weight: float = 0.8,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("prefill_weight", prefill_weight),
            ("temperature", temperature),
            ("decode_weight", decode_weight),
            ("min_match", min_match),
            ("private_weight", private_weight),
            ("fetch_token_cost", fetch_token_cost),
            ("fetch_latency_tokens", fetch_latency_tokens),
            ("lora_load_tokens", lora_load_tokens),
        ):
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name, value in (
            ("lora_loaded_weight", lora_loaded_weight),
            ("lora_free_slot_weight", lora_free_slot_weight),
        ):
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        self.prefill_weight = prefill_weight
        self.temperature = temperature
        self.decode_weight = decode_weight
        self.min_match = min_match
        self.private_weight = private_weight
        self.fetch_token_cost = fetch_token_cost  # 0: no peer block fetch
        self.fetch_latency_tokens = fetch_latency_tokens
        self.lora_load_tokens = lora_load_tokens
        self._lora_affinity = {
            LoraResidence.NONE: 1.0,
            LoraResidence.LOADED: lora_loaded_weight,
            LoraResidence.FREE_SLOT: lora_free_slot_weight,
            LoraResidence.EVICT: 0.0,
        }
        self._rng = rng or random.Random()

    def cost(self, request: RouteRequest, worker: WorkerState) -> float:
        # NOTE: a hot prefix counts as held everywhere: a worker without it pays its prefill once
        # and holds it from then on, while the holders' queues no longer decide alone.
        matched = max(worker.num_matched_blocks, request.num_hot_blocks)
        if matched * request.block_size < self.min_match * request.num_prompt_tokens:
            matched = 0
        uncached = request.num_uncached_tokens(matched)
        num_private = min(uncached, request.num_private_tokens)
        num_output_tokens = worker.num_outstanding_tokens - worker.num_prefill_tokens
        return (
            (uncached - num_private) * self.prefill_weight
            + num_private * self.private_weight
            + worker.num_prefill_tokens
            + num_output_tokens * self.decode_weight
            + self.lora_load_tokens * (1.0 - self._lora_affinity[worker.lora])
        )

    def fetch_cost(self, num_tokens: int) -> float:
        """What taking ``num_tokens`` tokens' KV from a peer costs, in prefill tokens."""
        return self.fetch_latency_tokens + self.fetch_token_cost * num_tokens

    def choose(self, request: RouteRequest, workers: Sequence[WorkerState]) -> Decision:
        costs, fetches = self._costs(request, workers)
        if self.temperature > 0:
            # Softmax over -cost / temperature (costs in tokens): near-ties share the traffic.
            lowest = min(c for c, _ in costs)
            weights = [math.exp(-(c - lowest) / self.temperature) for c, _ in costs]
            cost, worker = self._rng.choices(costs, weights=weights)[0]
            reason = "sampled by cost"
        else:
            worker = self._pick([((c,), w) for c, w in costs], request.rotation)
            cost = next(c for c, w in costs if w is worker)
            reason = "lowest cost" if worker.num_matched_blocks else "no cached prefix: lowest load"
        holder = fetches.get(worker.worker_id)
        if holder is None:
            return Decision(worker.worker_id, self.name, reason, worker.num_matched_blocks, cost)
        num_fetched = worker.num_matched_blocks - holder[1]
        return Decision(
            worker.worker_id,
            self.name,
            f"{reason}, its prefix taken from a peer",
            worker.num_matched_blocks,
            cost,
            fetch_from=holder[0],
            num_fetched_blocks=num_fetched,
        )

    def _costs(
        self, request: RouteRequest, workers: Sequence[WorkerState]
    ) -> tuple[list[tuple[float, WorkerState]], dict[str, tuple[str, int]]]:
        """Each worker's cost, as it is or, where cheaper, with the longest fetchable prefix
        taken from its holder (then the state says so: its matched blocks include the taken
        ones); and for those, (holder, blocks it held before)."""
        costs = [(self.cost(request, w), w) for w in workers]
        fetches: dict[str, tuple[str, int]] = {}
        if not self.fetch_token_cost:
            return costs, fetches
        holder = max(workers, key=lambda w: (w.num_fetchable_blocks, w.worker_id))
        num_held = holder.num_fetchable_blocks
        for i, (cost, worker) in enumerate(costs):
            if worker is holder or worker.num_matched_blocks >= num_held:
                continue
            taker = dataclasses.replace(worker, num_matched_blocks=num_held)
            num_tokens = (num_held - worker.num_matched_blocks) * request.block_size
            # NOTE: a conversation's own history weighs private_weight here too: moved, it
            # serves nobody else, and its next turns lose their worker.
            num_private = max(
                num_held * request.block_size
                - (request.num_prompt_tokens - request.num_private_tokens),
                0,
            )
            num_private = min(num_private, num_tokens)
            fetched_cost = (
                self.cost(request, taker)
                + self.fetch_cost(num_tokens)
                + num_private * self.fetch_token_cost * (self.private_weight - 1)
            )
            if fetched_cost < cost:
                costs[i] = (fetched_cost, taker)
                fetches[worker.worker_id] = (holder.worker_id, worker.num_matched_blocks)
        return costs, fetches


# What the serving router offers (``kvswitch router --policy``, a request's ``routing.policy``).
# Other routers' rules, kept for comparison, live beside the simulator (loadtest/policies.py).
POLICIES = ("cost", "prefix", "least_loaded", "round_robin", "random")


def fetch_costs(
    fetch_tokens_per_s: float, fetch_latency_s: float, prefill_tokens_per_s: float
) -> dict[str, float]:
    """The cost policy's peer-fetch weights from measured speeds: moving a token's KV costs
    prefill speed / transfer speed prefill tokens, a transfer's latency that many more."""
    return {
        "fetch_token_cost": prefill_tokens_per_s / fetch_tokens_per_s,
        "fetch_latency_tokens": fetch_latency_s * prefill_tokens_per_s,
    }


def check_weights(name: str, weights: Mapping[str, float], known: Sequence[str]) -> None:
    """ValueError naming the weights that the policy ``name``, which takes ``known``, does not."""
    unknown = sorted(set(weights) - set(known))
    if not unknown:
        return
    if not known:
        raise ValueError(f"the {name} policy takes no weights")
    raise ValueError(f"unknown {name} weights {unknown}; known: {', '.join(known)}")


def make_policy(
    name: str, weights: Mapping[str, float] | None = None, *, rng: random.Random | None = None
) -> Policy:
    """The policy called ``name``, one of ``POLICIES``; ``weights`` tunes ``cost`` (its
    ``CostPolicy.weight_names``) and is refused for the others. ``rng`` is what a policy that
    samples draws from (a seeded one makes a simulation repeat); None: a fresh one. ValueError
    says what is wrong."""
    weights = dict(weights or {})
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    if name == "cost":
        check_weights(name, weights, CostPolicy.weight_names)
        return CostPolicy(**weights, rng=rng)
    check_weights(name, weights, ())
    if name == "random":
        return RandomPolicy(rng)
    return {"prefix": PrefixPolicy, "least_loaded": LeastLoaded, "round_robin": RoundRobin}[name]()
