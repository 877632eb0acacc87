"""The fleet simulator: a trace through the router's own code and simulated workers.

For each request, in arrival order, on a simulated clock::

    every worker runs the steps that end by now     (loadtest/sim_worker.py; its block pool)
      its cache events go to an embedded index      (cache_index/memory_index.py)
      the router sees its last polled load report
    Router.choose(plan)                             (router/router.py: index match + pending
                                                     guesses + hot prefixes -> WorkerState per
                                                     worker -> the policy, by name)
    Router.routed(plan, decision)                   (the guess that its blocks will be there,
                                                     the prefix's traffic counted)
    the chosen worker queues it; the router counts its uncached prompt and output tokens there

A request of a LoRA adapter (the trace's ``lora``) is admitted once its adapter is in one of
the worker's ``max_loras`` slots: the step that loads it takes ``lora_load_s`` longer, and evicts
the least recently used adapter no running request uses; with none to evict it waits at the head
of the queue, as the worker's scheduler makes it. Every worker serves every adapter.

What is not modelled: the network and the router's own time (a decision takes no simulated time),
index events in flight (the index learns a step's blocks as the step ends), failures and
failover, several routers, output blocks being hit (a trace names prompt blocks only). Worker
speed is a profile (loadtest/profiles.py), not a model run.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvswitch.cache_index.engine_feed import gpu_tier_id, gpu_tier_info
from kvswitch.cache_index.index import WorkerInfo
from kvswitch.cache_index.memory_index import MemoryIndex
from kvswitch.loadtest.policies import ALL_POLICIES, make_any_policy
from kvswitch.loadtest.profiles import PROFILES, get_profile
from kvswitch.loadtest.sim_worker import Job, SimWorker
from kvswitch.loadtest.trace import (
    GENERATED,
    TRACE_NAMESPACE,
    TraceRequest,
    block_hashes,
    distinct_blocks,
    generated_shape,
)
from kvswitch.router.heat import PrefixHeat
from kvswitch.router.pending import PendingBlocks
from kvswitch.router.policy import Decision, fetch_costs, make_policy
from kvswitch.router.router import RoutePlan, Router, TierWeights
from kvswitch.router.workers import WorkerDirectory, WorkerHandle

MAX_WORKERS = 1024
# Of the trace's distinct blocks, what the fleet's caches hold together when no capacity is given:
# enough that a policy keeping each prefix on one worker hits often, too few to keep everything.
DERIVED_CAPACITY_FRACTION = 0.5


@dataclass(frozen=True)
class SimConfig:
    trace: str = ""  # a JSON-lines file, or generated:SPEC (loadtest/trace.py load_trace)
    workers: int = 16
    capacity_blocks: int = 0  # KV blocks per worker; 0: derived from the trace (fleet_capacity)
    block_tokens: int = 512
    policy: str = "all"
    rate_scale: float = 1.0
    target_utilization: float = 0.0
    profile: str = "gpu"
    load_poll_s: float = 0.1
    pending_ttl_s: float = 2.0
    cost_weights: str = ""  # "key=value,..." for the cost policy; empty: its defaults
    # Peer block fetch: tokens of KV moved a second between two workers (0: none), and what one
    # transfer costs besides. The cost policy weighs it against the profile's prefill speed.
    fetch_tokens_per_s: float = 0.0
    fetch_latency_s: float = 0.001
    max_loras: int = 4  # LoRA adapter slots per worker
    lora_load_s: float = 0.005  # what putting an adapter in a slot adds to its step
    # A host tier under each worker's cache (the worker's --offload-gb): its blocks (0: none),
    # and the tokens of KV a second it loads back (PCIe for a Llama 3 8B in bf16: about 200K).
    offload_capacity_blocks: int = 0
    reload_tokens_per_s: float = 200_000.0
    cpu_block_weight: float = 0.8  # what the router counts a host-tier block for (the router's)
    # Router replicas (router/replicas.py): request i is routed by replica i mod this; each
    # hears the others' routes (guesses, heat, the tie rotation) this late, or never (< 0).
    # They share the workers' in-flight counts at once.
    router_replicas: int = 1
    replica_delay_ms: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        for name in ("fetch_tokens_per_s", "fetch_latency_s", "lora_load_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.offload_capacity_blocks < 0:
            raise ValueError(
                f"offload_capacity_blocks must be >= 0 (0: no host tier), got "
                f"{self.offload_capacity_blocks}"
            )
        TierWeights(cpu=self.cpu_block_weight)  # refuses a bad weight now
        if not 0 < self.reload_tokens_per_s < math.inf:
            raise ValueError(
                f"reload_tokens_per_s must be a positive number, got {self.reload_tokens_per_s}"
            )
        make_policy("cost", self.weights())  # refuses an unknown weight or a bad value now
        if not self.trace:
            raise ValueError(
                "give the trace to replay: --trace FILE (JSON lines) or --trace generated:chat"
            )
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be in [1, {MAX_WORKERS}], got {self.workers}")
        if self.capacity_blocks < 0:
            raise ValueError(
                f"capacity_blocks must be >= 1 (KV blocks per worker), or 0 to derive it from "
                f"the trace, got {self.capacity_blocks}"
            )
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.trace.startswith(GENERATED):
            try:
                generated_shape(self.trace, self.block_tokens)  # refuses a bad spec now
            except ValueError as e:
                raise ValueError(f"trace {e}") from None
        if self.policy != "all" and self.policy not in ALL_POLICIES:
            raise ValueError(
                f"policy must be all or one of {', '.join(ALL_POLICIES)}, got {self.policy!r}"
            )
        if not 0 < self.rate_scale < math.inf:
            raise ValueError(f"rate_scale must be a positive number, got {self.rate_scale}")
        if not 0 <= self.target_utilization < 1:
            raise ValueError(
                f"target_utilization must be in (0, 1), or 0 for none, got "
                f"{self.target_utilization}"
            )
        if self.target_utilization and self.rate_scale != 1.0:
            raise ValueError("give rate_scale or target_utilization, not both")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if not 0 <= self.load_poll_s < math.inf:
            raise ValueError(f"load_poll_s must be a number >= 0, got {self.load_poll_s}")
        if not 0 < self.pending_ttl_s < math.inf:
            raise ValueError(f"pending_ttl_s must be a positive number, got {self.pending_ttl_s}")
        if self.router_replicas < 1:
            raise ValueError(f"router_replicas must be >= 1, got {self.router_replicas}")
        if not self.replica_delay_ms < math.inf:
            raise ValueError("replica_delay_ms must be finite (below 0: replicas never hear)")

    @property
    def policies(self) -> tuple[str, ...]:
        return ALL_POLICIES if self.policy == "all" else (self.policy,)

    def weights(self) -> dict[str, float]:
        """The cost policy's weights: ``cost_weights`` over the peer-fetch ones the speeds
        give."""
        weights = {}
        if self.fetch_tokens_per_s > 0:
            prefill_tokens_per_s = 1 / get_profile(self.profile).prefill_s_per_token
            weights = fetch_costs(
                self.fetch_tokens_per_s, self.fetch_latency_s, prefill_tokens_per_s
            )
        return {**weights, **parse_cost_weights(self.cost_weights)}


def parse_cost_weights(text: str) -> dict[str, float]:
    """The weights of "key=value,..." as numbers; ValueError names a part that is not one."""
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            weights[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"cost_weights: {part!r} is not key=number") from None
    return weights


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A trace request as the router plans it: its full blocks' chained hashes."""

    request: TraceRequest
    plan: RoutePlan

    @property
    def block_hashes(self) -> list[bytes]:
        return self.plan.block_hashes


def prepare(requests: Sequence[TraceRequest], block_tokens: int) -> list[SimRequest]:
    """Hash every request's blocks once, for all the runs over the trace."""
    return [
        SimRequest(
            r,
            RoutePlan(
                # NOTE: the router reads only the prompt's length from its tokens.
                range(r.num_prompt_tokens),
                TRACE_NAMESPACE,
                block_tokens,
                block_hashes(r, block_tokens),
                lora=r.lora,
            ),
        )
        for r in requests
    ]


def blocks_needed(request: TraceRequest, block_tokens: int) -> int:
    """Blocks a worker holds for the request at its end (the last output token's KV is never
    computed)."""
    return -(-(request.num_prompt_tokens + request.num_output_tokens - 1) // block_tokens)


def check_capacity(
    requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int
) -> None:
    """ValueError if a request could not fit in an empty worker (the worker would fail it)."""
    largest = max(requests, key=lambda r: r.num_prompt_tokens + r.num_output_tokens)
    num_needed = blocks_needed(largest, block_tokens)
    if num_needed > capacity_blocks:
        raise ValueError(
            f"capacity_blocks {capacity_blocks} cannot hold the trace's largest request "
            f"({largest.num_prompt_tokens} prompt + {largest.num_output_tokens} output tokens: "
            f"{num_needed} blocks of {block_tokens})"
        )


@dataclass(frozen=True)
class Capacity:
    """KV blocks per worker, and where the number came from."""

    num_blocks: int
    how: str  # "given", or "derived: ..." with the figures it came from


def fleet_capacity(requests: Sequence[TraceRequest], config: SimConfig) -> Capacity:
    """``config.capacity_blocks`` if given, else ``derive_capacity`` over the trace."""
    if config.capacity_blocks:
        return Capacity(config.capacity_blocks, "given")
    return derive_capacity(requests, config.workers, config.block_tokens)


def derive_capacity(
    requests: Sequence[TraceRequest],
    num_workers: int,
    block_tokens: int,
    fraction: float = DERIVED_CAPACITY_FRACTION,
) -> Capacity:
    """Blocks per worker for the fleet to hold ``fraction`` of the trace's distinct blocks, but
    never fewer than its largest request needs (``check_capacity``)."""
    num_distinct = distinct_blocks(requests, block_tokens)
    num_share = int(num_distinct * fraction) // num_workers
    share = f"{fraction:g} x {num_distinct} distinct blocks in the trace / {num_workers} workers"
    num_largest = max(blocks_needed(r, block_tokens) for r in requests)
    if num_share >= num_largest:
        return Capacity(num_share, f"derived: {share}")
    return Capacity(
        num_largest,
        f"derived: the largest request's {num_largest} blocks, more than {share} = {num_share}",
    )


@dataclass(frozen=True)
class PolicyRun:
    """What one policy did with the trace."""

    policy: str
    rate_scale: float
    worker_ids: list[str]  # the worker chosen for each request, in arrival order
    ttfts_s: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens hit in the chosen worker's cache on admission
    worker_busy_s: list[float]
    worker_prefill_tokens: list[int]  # prompt tokens each worker computed
    makespan_s: float  # from the first arrival to the end of the last step
    num_preempted: int
    # Blocks taken from a peer's cache (peer block fetch); they count as cached tokens too.
    num_fetched_blocks: int = 0
    block_tokens: int = 0
    num_lora_loads: int = 0  # LoRA adapters put in a worker's slot
    # Of the cached prompt tokens, those loaded back from a worker's host tier.
    num_reloaded_tokens: int = 0

    @property
    def lora_loads_per_minute(self) -> float:
        return self.num_lora_loads / self.makespan_s * 60 if self.makespan_s else 0.0

    @property
    def utilization(self) -> float:
        """Mean over workers of the time spent in steps over the makespan."""
        return sum(self.worker_busy_s) / len(self.worker_busy_s) / self.makespan_s


def simulate(
    requests: Sequence[SimRequest],
    config: SimConfig,
    policy: str,
    rate_scale: float,
    *,
    check: bool = False,
) -> PolicyRun:
    """Replay ``requests`` with their arrivals ``rate_scale`` times as fast, through ``policy``.
    ``check``: verify every worker's accounting at every arrival (slow; for tests). The
    capacity must be given (``fleet_capacity`` derives one)."""
    if config.capacity_blocks < 1:
        raise ValueError("capacity_blocks must be given to simulate (fleet_capacity derives it)")
    return asyncio.run(_simulate(requests, config, policy, rate_scale, check))


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class _SimDirectory(WorkerDirectory):
    """The simulated workers as the router's directory: always live, never dialled."""

    def __init__(self, index: MemoryIndex, handles: list[WorkerHandle]) -> None:
        super().__init__(index)
        self._sim_handles = handles

    def routable(
        self, exclude: set[str] | frozenset[str] = frozenset(), *, engines: bool = False
    ) -> list[WorkerHandle]:
        return [h for h in self._sim_handles if h.worker_id not in exclude]


class _Replicas:
    """Router replicas on one fleet: request i goes to replica i mod their number, and each
    hears the others' routes (a guess, a heat count, the tie rotation moved on) after
    ``replica_delay_ms``, as router/replicas.py tells them; or never, with a delay below 0. The
    workers' in-flight counts (the handles) they share at once."""

    def __init__(
        self,
        router: Router,
        config: SimConfig,
        policy: str,
        weights: dict[str, float] | None,
        clock: _Clock,
    ) -> None:
        self.routers = [router]
        for r in range(1, config.router_replicas):
            replica = Router(
                router.index,
                router.directory,
                None,
                namespace=router.namespace,
                pending=PendingBlocks(config.pending_ttl_s, clock),
                heat=PrefixHeat(clock=clock),
                tier_weights=router.tier_weights,
            )
            replica.default_policy = make_any_policy(
                policy, weights, rng=random.Random(config.seed + r)
            )
            self.routers.append(replica)
        self.delay_s = config.replica_delay_ms / 1000
        self.syncs = len(self.routers) > 1 and self.delay_s >= 0
        for r, replica in enumerate(self.routers):
            replica.shared_rotation = self.syncs
            if self.syncs:
                replica.pending.on_confirm = functools.partial(self._confirmed, r)
        # (when, order, the replica that hears, worker, chain or None for a confirmation,
        # guessed)
        self._heard: list[tuple[float, int, int, str, list[bytes] | bytes, bool]] = []
        self._order = 0
        self._now_s = 0.0

    def take(self, k: int, now_s: float) -> Router:
        """The replica that routes request ``k``, told every route due by ``now_s``."""
        self._now_s = now_s
        while self._heard and self._heard[0][0] <= now_s:
            heard_s, _, r, worker_id, block_hashes, guessed = heapq.heappop(self._heard)
            replica = self.routers[r]
            if isinstance(block_hashes, bytes):  # a confirmation: the chain's last hash
                replica.pending.confirmed(worker_id, block_hashes)
                continue
            # NOTE: as of when it was heard, not of this request's arrival: the guess's
            # lifetime and the heat's decay start then.
            ttl_s = replica.pending.ttl_s - (now_s - heard_s)
            if guessed and ttl_s > 0:
                replica.pending.add(worker_id, block_hashes, ttl_s)
            replica.heat.record(block_hashes, heard_s)
            replica.num_routed += 1
        return self.routers[k % len(self.routers)]

    def routed(
        self, router: Router, block_hashes: list[bytes], decision: Decision, now_s: float
    ) -> None:
        if self.syncs:
            guessed = not decision.fetch_from
            self._tell(router, decision.worker_id, block_hashes, guessed, now_s)

    def _confirmed(self, r: int, worker_id: str, last_hash: bytes) -> None:
        self._tell(self.routers[r], worker_id, last_hash, False, self._now_s)

    def _tell(
        self,
        router: Router,
        worker_id: str,
        what: list[bytes] | bytes,
        guessed: bool,
        now_s: float,
    ) -> None:
        for r, replica in enumerate(self.routers):
            if replica is not router:
                self._order += 1
                heard = (now_s + self.delay_s, self._order, r, worker_id)
                heapq.heappush(self._heard, (*heard, what, guessed))


async def _simulate(
    requests: Sequence[SimRequest], config: SimConfig, policy: str, rate_scale: float, check: bool
) -> PolicyRun:
    profile = get_profile(config.profile)
    clock = _Clock()
    index = MemoryIndex(clock)
    width = len(str(config.workers - 1))  # w00 ... w15: ids sort as numbers do
    loras = sorted({r.request.lora for r in requests} - {None})  # type: ignore[type-var]
    workers: list[SimWorker] = []
    for k in range(config.workers):
        info = WorkerInfo(
            f"w{k:0{width}d}",
            f"sim:{k}",
            TRACE_NAMESPACE,
            config.block_tokens,
            num_blocks=config.capacity_blocks,
        )
        await index.register(info, ttl_s=math.inf)
        if config.offload_capacity_blocks:
            # The device tier's entry, as a worker with a host tier keeps one (INDEX.md).
            await index.register(gpu_tier_info(info), ttl_s=math.inf)
        # NOTE: no channel: a simulated worker is not behind gRPC.
        handle = WorkerHandle(info, channel=None, stub=None)  # type: ignore[arg-type]
        workers.append(
            SimWorker(
                handle,
                profile,
                config.capacity_blocks,
                config.block_tokens,
                config.load_poll_s,
                loras=loras,
                max_loras=config.max_loras,
                lora_load_s=config.lora_load_s,
                num_host_blocks=config.offload_capacity_blocks,
                reload_tokens_per_s=config.reload_tokens_per_s,
            )
        )
    by_id = {w.handle.worker_id: w for w in workers}
    seqs = dict.fromkeys(by_id, 0)
    directory = _SimDirectory(index, [w.handle for w in workers])
    if config.offload_capacity_blocks:
        directory.gpu_tiers = {w: gpu_tier_id(w) for w in by_id}
    router = Router(
        index,
        directory,
        None,
        namespace=TRACE_NAMESPACE,
        pending=PendingBlocks(config.pending_ttl_s, clock),
        heat=PrefixHeat(clock=clock),
        tier_weights=TierWeights(cpu=config.cpu_block_weight),
    )
    weights = config.weights() if policy == "cost" else None
    # NOTE: the router's default set aside: the simulator also replays other routers' rules.
    router.default_policy = make_any_policy(policy, weights, rng=random.Random(config.seed))
    replicas = _Replicas(router, config, policy, weights, clock)

    jobs: list[Job] = []
    worker_ids: list[str] = []
    # Requests whose prefix is on its way from a peer: (when it is there, order, worker, job,
    # the blocks).
    deliveries: list[tuple[float, int, SimWorker, Job, list[bytes]]] = []
    num_fetched_blocks = 0

    async def publish(worker: SimWorker) -> None:
        events = worker.take_events()
        if events:
            worker_id = worker.handle.worker_id
            seqs[worker_id] += 1
            await index.apply(worker_id, seqs[worker_id], events)
            if config.offload_capacity_blocks:
                device = [e for e in events if getattr(e, "medium", None) is None]
                await index.apply(gpu_tier_id(worker_id), seqs[worker_id], device)

    async def deliver(until_s: float) -> None:
        while deliveries and deliveries[0][0] <= until_s:
            ready_s, _, worker, job, taken = heapq.heappop(deliveries)
            clock.now_s = max(clock.now_s, ready_s)
            worker.advance_to(ready_s)
            await publish(worker)
            worker.take_blocks(taken)
            worker.add(job, ready_s)

    start_s = requests[0].request.arrival_s
    for sim_request in requests:
        request = sim_request.request
        now_s = (request.arrival_s - start_s) / rate_scale
        clock.now_s = now_s
        for worker in workers:
            if worker.next_change_s <= now_s:
                worker.advance_to(now_s)
                await publish(worker)
            worker.poll(now_s)
            if check:
                worker.check()
        await deliver(now_s)
        plan = sim_request.plan
        router = replicas.take(len(jobs), now_s)
        decision, handle = await router.choose(plan)
        router.routed(plan, decision)
        replicas.routed(router, plan.block_hashes, decision, now_s)
        num_uncached = router.num_uncached_tokens(plan, decision)
        # The router's count of the request on its worker; the worker counts it down.
        router.directory.begin(handle, num_uncached, request.num_output_tokens)
        job = Job(
            now_s,
            request.num_prompt_tokens,
            request.num_output_tokens,
            plan.block_hashes,
            num_uncached,
            lora=request.lora,
        )
        worker = by_id[decision.worker_id]
        if decision.fetch_from:
            # Peer block fetch: the request reaches its worker once the prefix has moved.
            holder = by_id[decision.fetch_from]
            taken = plan.block_hashes[: holder.blocks.num_held(plan.block_hashes)]
            num_moved = len(taken) - worker.blocks.num_held(taken)
            ready_s = now_s + config.fetch_latency_s
            ready_s += num_moved * config.block_tokens / config.fetch_tokens_per_s
            worker.expect(job)
            heapq.heappush(deliveries, (ready_s, len(jobs), worker, job, taken))
            num_fetched_blocks += num_moved
        else:
            worker.add(job, now_s)
        jobs.append(job)
        worker_ids.append(decision.worker_id)
    await deliver(math.inf)
    for worker in workers:
        worker.advance_to(math.inf)
        handle = worker.handle
        if (handle.num_in_flight, handle.num_prefill_tokens, handle.num_output_tokens) != (0, 0, 0):
            raise RuntimeError(f"{handle.worker_id}: requests left over at the end")  # a bug
    return PolicyRun(
        policy=policy,
        rate_scale=rate_scale,
        worker_ids=worker_ids,
        ttfts_s=[job.first_token_s - job.arrival_s for job in jobs],
        num_prompt_tokens=sum(job.num_prompt_tokens for job in jobs),
        num_cached_tokens=sum(job.num_cached_tokens for job in jobs),
        worker_busy_s=[w.busy_s for w in workers],
        worker_prefill_tokens=[w.num_prefill_tokens for w in workers],
        makespan_s=max(w.end_s for w in workers),
        num_preempted=sum(w.num_preempted for w in workers),
        num_fetched_blocks=num_fetched_blocks,
        block_tokens=config.block_tokens,
        num_lora_loads=sum(w.num_lora_loads for w in workers),
        num_reloaded_tokens=sum(job.num_reloaded_tokens for job in jobs),
    )
