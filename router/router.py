"""Routing one request: tokenize, hash its blocks, ask the index who holds them, pick a worker.

The ``Router`` owns the request-path logic and nothing about gRPC servers: ``plan`` turns a
request into a ``RoutePlan`` (token ids and their block chain), ``choose`` turns a plan into a
``Decision`` and the worker to send it to. The servicer (``router/servicer.py``) and each
request's attempts (``router/attempt.py``) forward, stream and fail over.

Matches come from the index and from the router's own pending guesses (``router/pending.py``);
scores from the policy (``router/policy.py``), the default or one a request names.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvswitch.cache_index.hashing import BlockHasher, TokenIds
from kvswitch.cache_index.index import BlockIndex
from kvswitch.logs import Throttled
from kvswitch.router.disagg import DisaggConfig, prefill_locally
from kvswitch.router.heat import PrefixHeat
from kvswitch.router.pending import PendingBlocks
from kvswitch.router.policy import Decision, Policy, RouteRequest, WorkerState, make_policy
from kvswitch.router.workers import PREFILL_ROLES, WorkerDirectory, WorkerHandle
from kvswitch.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvswitch.router.replicas import ReplicaSync

logger = logging.getLogger(__name__)

MAX_CACHED_POLICIES = 64  # per-request overrides build policies; keep their rotations alive


class NoTokenizerError(Exception):
    """A text prompt reached a router whose model has no tokenizer."""


class NoWorkerError(Exception):
    """No live worker can take the request (none registered, or every one failed)."""


class UnknownAdapterError(LookupError):
    """No live worker serves the LoRA adapter a request names."""


class FleetFullError(Exception):
    """Every worker that could take the request refused one lately at its queue limit."""


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """A request as the router routes it."""

    # uint32, from ``plan``; the simulator passes a range (the router reads only its length).
    token_ids: TokenIds
    namespace: str
    block_size: int
    block_hashes: list[bytes]  # one per full block of token_ids
    lora: str | None = None
    cache_salt: str | None = None
    # The longest context (prompt plus output) a worker of the model takes; 0 = unknown.
    max_model_len: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: the worker that streams its output (``decision``, ``handle``); when
    another worker prefills its prompt first, that one; when it takes the prompt's cached prefix
    from a peer first (``decision.fetch_from``), that peer."""

    decision: Decision
    handle: WorkerHandle
    prefill_decision: Decision | None = None
    prefill_handle: WorkerHandle | None = None
    fetch_handle: WorkerHandle | None = None  # where ``handle`` takes the prefix from first


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What a matched block counts for, by the tier that holds it: one a worker's or an
    OpenAI-API engine's device (GPU) holds, ``gpu``; one only a lower tier holds (a worker's
    host tier, vLLM's CPU offloading), ``cpu``."""

    gpu: float = 1.0
    cpu: float = 0.8

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name}_block_weight must be a finite number >= 0")

    def weigh(self, matches: dict[str, int], gpu_tiers: Mapping[str, str]) -> dict[str, int]:
        """``matches`` (leading blocks held, by worker or engine) with each tiered engine's
        weighed: its GPU's leading run (its GPU-tier entry's) at ``gpu``, the rest of its run
        (held by a lower tier) at ``cpu``, rounded down; the GPU-tier entries dropped."""
        if not gpu_tiers:
            return matches
        weighed = dict(matches)
        for engine, tier in gpu_tiers.items():
            num_on_gpu = weighed.pop(tier, 0)
            num_held = weighed.get(engine, 0)
            if num_held:
                num_on_gpu = min(num_on_gpu, num_held)
                weighed[engine] = int(self.gpu * num_on_gpu + self.cpu * (num_held - num_on_gpu))
        return weighed


class Router:
    def __init__(
        self,
        index: BlockIndex,
        directory: WorkerDirectory,
        tokenizer: Tokenizer | None,
        *,
        no_tokenizer_reason: str = "this router's model has no tokenizer",
        policy: str = "cost",
        weights: Mapping[str, float] | None = None,
        namespace: str = "",
        pending: PendingBlocks | None = None,
        heat: PrefixHeat | None = None,
        tier_weights: TierWeights | None = None,
    ) -> None:
        self.index = index
        self.directory = directory
        self.tokenizer = tokenizer  # None: the model has none, and prompts come as token ids
        self.no_tokenizer_reason = no_tokenizer_reason
        self.namespace = namespace  # empty: the one namespace the live workers serve
        self.pending = pending if pending is not None else PendingBlocks()
        self.heat = heat if heat is not None else PrefixHeat()
        self.tier_weights = tier_weights or TierWeights()
        self.default_policy = make_policy(policy, weights)
        self._default_weights = dict(weights or {})  # what a request's weights are laid over
        self._policies: dict[tuple, Policy] = {}
        self.last_lookup_s = 0.0  # how long the last index match took
        self.num_lookup_errors = 0  # lookups the index failed; those requests routed on load
        self._lookup_warning = Throttled(logger)
        # The other router replicas, told of every routed request (router/replicas.py); None
        # for a router alone.
        self.replicas: ReplicaSync | None = None
        self.num_routed = 0  # requests routed, by this router and (told) its replicas
        # Break ties by ``num_routed``, as the replicas do, not by the policy's own count.
        self.shared_rotation = False

    # -- planning ------------------------------------------------------------------------------

    def plan(
        self,
        *,
        text: str | None = None,
        token_ids: TokenIds | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> RoutePlan:
        """Tokenize (when given text) and hash the prompt; ValueError for a bad prompt,
        NoTokenizerError for text without a tokenizer, NoWorkerError when no worker is live to
        say which model is served."""
        if (text is None) == (token_ids is None):
            raise ValueError("give the prompt as text or as token ids, not both or neither")
        # NOTE: an array, so that hashing reads its bytes at once and the worker's request
        # takes them in one copy; a list would be packed id by id, twice.
        ids = np.asarray(self.tokenize(text) if text is not None else token_ids, np.uint32)
        if not len(ids):
            raise ValueError("the prompt is empty")
        namespace, block_size, max_model_len = self._served_model()
        if max_model_len and len(ids) >= max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the model's context length is "
                f"{max_model_len} tokens, prompt and output together"
            )
        hasher = BlockHasher(
            namespace, block_size, lora=lora, cache_salt=cache_salt, naming=self.directory.naming
        )
        block_hashes = hasher.hash_blocks(ids)
        return RoutePlan(ids, namespace, block_size, block_hashes, lora, cache_salt, max_model_len)

    def tokenize(self, text: str) -> np.ndarray:
        """The prompt's token ids (uint32); NoTokenizerError when the model has no tokenizer."""
        if self.tokenizer is None:
            raise NoTokenizerError(f"{self.no_tokenizer_reason}: send the prompt as token ids")
        return self.tokenizer.encode_array(text)

    def inline_chars(self) -> int:
        """The longest text ``tokenize`` is called with on the event loop (longer on a
        thread): the tokenizer's ``inline_chars``."""
        if self.tokenizer is None:
            return sys.maxsize  # NOTE: nothing to encode: NoTokenizerError at once
        return self.tokenizer.inline_chars

    def extend(self, plan: RoutePlan, token_ids: Sequence[int]) -> RoutePlan:
        """The plan of the same request with ``token_ids`` appended to its prompt (resuming a
        stream on another worker)."""
        if not token_ids:
            return plan
        ids = np.concatenate((plan.token_ids, np.asarray(token_ids, np.uint32)))
        hasher = BlockHasher(
            plan.namespace,
            plan.block_size,
            lora=plan.lora,
            cache_salt=plan.cache_salt,
            naming=self.directory.naming,
        )
        hashes = plan.block_hashes + hasher.hash_blocks(ids, plan.block_hashes)
        return dataclasses.replace(plan, token_ids=ids, block_hashes=hashes)

    # -- choosing ------------------------------------------------------------------------------

    async def choose(
        self,
        plan: RoutePlan,
        *,
        policy: str = "",
        weights: Mapping[str, float] | None = None,
        exclude: set[str] | frozenset[str] = frozenset(),
    ) -> tuple[Decision, WorkerHandle]:
        """The worker to send ``plan`` to, and why. ValueError for an unknown policy or weight;
        NoWorkerError when no routable worker is left outside ``exclude``."""
        route = await self.route(plan, policy=policy, weights=weights, exclude=exclude)
        return route.decision, route.handle

    async def route(
        self,
        plan: RoutePlan,
        *,
        policy: str = "",
        weights: Mapping[str, float] | None = None,
        exclude: set[str] | frozenset[str] = frozenset(),
        disagg: DisaggConfig | None = None,
        engines: bool = False,
    ) -> Route:
        """``choose``, and with ``disagg``, whether a prefill worker computes the prompt first
        (``router/disagg.py``). One index lookup serves both choices. With ``engines``, the
        OpenAI-API engines are candidates too (``router/engines.py``), and no worker takes a
        prefix from a peer: an engine neither gives one nor takes one."""
        chosen_policy = self._policy(policy, weights)
        handles = self._serving(plan, self.directory.routable(exclude, engines=engines))
        if handles and plan.lora is not None:
            handles = await self._serving_lora(plan.lora, handles)
        if not handles:
            raise NoWorkerError(
                f"no live worker serves {plan.namespace!r}"
                + (f" apart from {', '.join(sorted(exclude))}, which failed" if exclude else "")
            )
        # NOTE: refused here, without a call: a full fleet answers at once, and an overloaded
        # router spends nothing on requests it cannot place.
        handles = {worker_id: h for worker_id, h in handles.items() if not h.full}
        if not handles:
            raise FleetFullError(
                f"every worker that serves {plan.namespace!r} is at its queue limit"
            )
        started_s = time.perf_counter()
        try:
            index_matches = await self.index.match(plan.namespace, plan.block_hashes)
        except self.index.unavailable_errors as e:  # Redis restarting, a network blip
            self.num_lookup_errors += 1
            self._lookup_warning.warning("the index cannot answer (%s); routing on load alone", e)
            index_matches = {}
        self.last_lookup_s = time.perf_counter() - started_s
        # NOTE: an engine's or a worker's blocks in a lower tier (vLLM's CPU offloading, a
        # worker's --offload-gb) count for less than those on its device.
        index_matches = self.tier_weights.weigh(index_matches, self.directory.gpu_tiers)
        # NOTE: workers may have left while the lookup ran (a Redis that came back empty lists
        # none until they register again), and a gone worker's channel is closed: a call on it
        # would raise, not fail over.
        handles = {worker_id: h for worker_id, h in handles.items() if not h.removed}
        if not handles:
            raise NoWorkerError(f"the workers serving {plan.namespace!r} left the index")
        matches = self.pending.match(plan.block_hashes, index_matches)
        request = RouteRequest(
            len(plan.token_ids),
            plan.block_size,
            num_hot_blocks=self.heat.hot_blocks(plan.block_hashes, matches, len(handles)),
            num_shared_blocks=self.heat.shared_blocks(plan.block_hashes),
            rotation=self.num_routed if self.shared_rotation else None,
        )

        def states(candidates: dict[str, WorkerHandle]) -> list[WorkerState]:
            # NOTE: blocks matched by a guess alone are still being prefilled there for an
            # earlier request; that prefill is in the worker's outstanding work and serves this
            # one too.
            return [
                h.state(
                    matches.get(worker_id, 0),
                    num_shared_prefill_tokens=plan.block_size
                    * max(matches.get(worker_id, 0) - index_matches.get(worker_id, 0), 0),
                    num_fetchable_blocks=0 if engines else index_matches.get(worker_id, 0),
                    lora=plan.lora,
                )
                for worker_id, h in candidates.items()
            ]

        decision = chosen_policy.choose(request, states(handles))
        fetch_handle = handles[decision.fetch_from] if decision.fetch_from else None
        route = Route(decision, handles[decision.worker_id], fetch_handle=fetch_handle)
        if disagg is None:
            return route
        prefill_handles = self._serving(plan, self.directory.routable(exclude, PREFILL_ROLES))
        if plan.lora is not None:
            prefill_handles = {
                worker_id: h for worker_id, h in prefill_handles.items() if h.serves(plan.lora)
            }
        prefill_decision = prefill_state = None
        if prefill_handles:
            prefill_states = states(prefill_handles)
            prefill_decision = chosen_policy.choose(request, prefill_states)
            prefill_state = next(
                s for s in prefill_states if s.worker_id == prefill_decision.worker_id
            )
        num_uncached = request.num_uncached_tokens(decision.num_matched_blocks)
        why_local = prefill_locally(num_uncached, prefill_state, disagg)
        if why_local is not None or prefill_decision is None:
            return route
        return dataclasses.replace(
            route,
            prefill_decision=prefill_decision,
            prefill_handle=prefill_handles[prefill_decision.worker_id],
        )

    def routed(self, plan: RoutePlan, decision: Decision) -> None:
        """The request went to ``decision.worker_id``: guess that its blocks will be there."""
        guessed = not decision.fetch_from
        if guessed:
            # NOTE: not while its prefix is on its way from a peer: a request that followed the
            # guess there would find nothing yet and compute it all; unguessed, it is routed by
            # what the index knows, and takes the prefix from its holder too.
            self.pending.add(decision.worker_id, plan.block_hashes)
        self.heat.record(plan.block_hashes)
        self.num_routed += 1
        if self.replicas is not None:
            self.replicas.routed(decision.worker_id, plan.block_hashes, guessed)

    def withdrawn(self, plan: RoutePlan, decision: Decision | None) -> None:
        """The request ``routed`` by ``decision`` will not run there after all (the worker
        refused it, or it never reached the worker): take back the guess ``routed`` made."""
        if decision is not None and not decision.fetch_from:
            self.pending.discard(decision.worker_id, plan.block_hashes)
            if self.replicas is not None:
                self.replicas.withdrawn(decision.worker_id, plan.block_hashes)

    def num_uncached_tokens(self, plan: RoutePlan, decision: Decision) -> int:
        request = RouteRequest(len(plan.token_ids), plan.block_size)
        return request.num_uncached_tokens(decision.num_matched_blocks)

    def _policy(self, name: str, weights: Mapping[str, float] | None) -> Policy:
        if not name and not weights:
            return self.default_policy
        name = name or self.default_policy.name
        if name == self.default_policy.name:
            # A request's weights override the router's own one by one; the rest keep its.
            weights = {**self._default_weights, **(weights or {})}
        key = (name, tuple(sorted((weights or {}).items())))
        found = self._policies.get(key)
        if found is None:
            found = make_policy(key[0], dict(key[1]))
            if len(self._policies) >= MAX_CACHED_POLICIES:
                self._policies.pop(next(iter(self._policies)))
            self._policies[key] = found
        return found

    async def _serving_lora(
        self, lora: str, handles: dict[str, WorkerHandle]
    ) -> dict[str, WorkerHandle]:
        """Those of ``handles`` that serve the adapter ``lora``, as their load reports say;
        UnknownAdapterError when none does."""
        if not any(h.serves(lora) for h in handles.values()) and any(
            h.load is None for h in handles.values()
        ):
            # NOTE: a worker that joined a moment ago has not reported what it serves yet.
            await self.directory.poll_loads()
        serving = {worker_id: h for worker_id, h in handles.items() if h.serves(lora)}
        if not serving:
            served = sorted({name for h in handles.values() for name in h.loras})
            raise UnknownAdapterError(
                f"lora: no live worker serves the adapter {lora!r}; "
                + (f"adapters served: {', '.join(served)}" if served else "none serves one")
            )
        return serving

    @staticmethod
    def _serving(plan: RoutePlan, handles: list[WorkerHandle]) -> dict[str, WorkerHandle]:
        """The workers among ``handles`` that serve the plan's model with its block size, and
        whose context holds its prompt and a token more."""
        num_tokens = len(plan.token_ids)
        return {
            h.worker_id: h
            for h in handles
            if h.info.namespace == plan.namespace
            and h.info.block_size == plan.block_size
            and not 0 < h.info.max_model_len <= num_tokens
        }

    def _served_model(self) -> tuple[str, int, int]:
        """The namespace and block size to hash with: the configured namespace, else the one
        that every live worker serves; and the longest context a worker of it takes, 0 if one
        does not say (an older worker), so that nothing is refused or capped on a guess."""
        handles = self.directory.handles()
        if self.namespace:
            handles = [h for h in handles if h.info.namespace == self.namespace]
            if not handles:
                raise NoWorkerError(f"no live worker serves {self.namespace!r}")
        served = {(h.info.namespace, h.info.block_size) for h in handles}
        if not served and self.directory.refused:
            raise NoWorkerError(
                "no worker is routable: " + "; ".join(sorted(self.directory.refused.values()))
            )
        if not served:
            raise NoWorkerError("no worker is live: none has registered with the index")
        if len(served) > 1:
            # NOTE: a fleet may mix models only if the router is told which one it routes.
            raise NoWorkerError(
                "the live workers serve several models or block sizes "
                f"({', '.join(f'{n} / {b}' for n, b in sorted(served))}); "
                "start the router with --namespace"
            )
        contexts = [h.info.max_model_len for h in handles]
        return (*served.pop(), 0 if 0 in contexts else max(contexts))
