"""Continuous batching: which requests run in the next step, and how many tokens each computes.

Every step has a token budget. Running requests go first, in arrival order: a decoding request
needs one token, a request still prefilling takes its next chunk. Waiting requests are admitted
after them, with their cached prefix skipped, while budget, sequence slots and KV blocks last.
When a running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it waits again at the head of the queue, to be recomputed
(mostly from the prefix cache) later. The scheduler never blocks and never fails a request for
lack of blocks unless the request could not fit even in an empty cache.

A request whose prompt's KV a transfer brings from a peer (``add_awaiting_kv``) holds the blocks
for its whole prompt from the start and waits apart, never scheduled, until ``kv_landed``; it
then joins the head of the waiting queue with its landed prefix computed. It goes first because
it holds its blocks already: a request behind it that waits for blocks must not keep it waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvswitch.worker.block_pool import KVBlock
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.request import BATCH, PullSlots, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Distinct LoRA adapters the running requests may use at once (the device's slots); 0: any.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(slots=True)
class SchedulerOutput:
    """The step's work, in batch order: ``requests[i]`` computes ``num_new_tokens[i]`` tokens
    from position ``start_pos[i]`` (the tokens it had computed), ``num_tokens`` in all."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    num_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.start_pos.append(request.num_computed_tokens)
        self.num_tokens += num_new_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        # How many leading blocks of a prefix hit have their hidden states cached: a request
        # that wants its prompt's (``Request.needs_prompt_hidden``) reuses only those.
        self.num_hidden_blocks: Callable[[Sequence[KVBlock]], int] = lambda blocks: 0

    @property
    def num_unfinished(self) -> int:
        """Requests a step may run: those waiting for KV from a peer are not (a command moves
        them on)."""
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to start, those waiting for KV from a peer too."""
        return len(self.waiting) + len(self.waiting_for_kv)

    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, waiting requests counted whole but for a prefix that
        landed from a peer (hits not known yet)."""
        running = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.running)
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return running + waiting + sum(r.num_tokens for r in self.waiting_for_kv.values())

    def add(self, request: Request) -> None:
        """Queue a new request: behind every waiting request of its priority or a higher one,
        ahead of the lower ones (an interactive request passes the waiting batch ones)."""
        request.status = RequestStatus.WAITING
        waiting = self.waiting
        if request.priority == BATCH or not waiting or waiting[-1].priority != BATCH:
            waiting.append(request)
            return
        # NOTE: batch requests wait at the tail: walk back over them.
        i = len(waiting)
        while i > 0 and waiting[i - 1].priority == BATCH:
            i -= 1
        waiting.insert(i, request)

    def add_awaiting_kv(self, request: Request) -> PullSlots:
        """Queue a request whose prompt's KV a transfer brings, holding its blocks
        (``KVCacheManager.allocate_for_pull``), not to run until ``kv_landed``. When they are
        refused, it still waits for ``kv_landed`` (or an abort), then runs as any other request,
        computing its prompt."""
        slots = self.kv_cache.allocate_for_pull(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[request.request_id] = request
        if not slots.refused and not slots.block_ids:  # all cached here: nothing to wait for
            self.kv_landed(request.request_id)
        return slots

    def kv_landed(self, request_id: str, num_written_blocks: int = 0) -> int:
        """The transfer for a request waiting for KV is over (done, cut short or failed): its
        blocks that hold their KV are cached (``KVCacheManager.commit_pull``) and it waits at the
        head of the queue to compute the rest. Returns how many awaited blocks landed; 0 for a
        request that waits for no KV."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return 0
        if not self.kv_cache.holds_blocks(request):  # refused blocks: it computes its prompt
            self.add(request)
            return 0
        num_landed = self.kv_cache.commit_pull(request, num_written_blocks)
        request.num_computed_tokens = self.kv_cache.num_cached_blocks(request) * request.block_size
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return num_landed

    def remove(self, request: Request) -> None:
        """Drop a request (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.waiting_for_kv.pop(request.request_id, None)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv_cache = self.kv_cache

        # Running requests first: decodes and the next chunk of unfinished prefills.
        # NOTE: the steady state runs this loop once per decoding request per step, so it keeps
        # to local names and appends to the output's lists directly.
        running, allocate_slots = self.running, kv_cache.allocate_slots
        requests, num_new_tokens, start_pos = out.requests, out.num_new_tokens, out.start_pos
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                num_new = budget
            while allocate_slots(request, num_new) is None:
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                requests.append(request)
                num_new_tokens.append(num_new)
                start_pos.append(num_computed)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it can run either
        out.num_tokens = self.config.max_num_batched_tokens - budget

        # Then admit waiting requests, oldest first, as long as everything fits: blocks, the
        # budget, and a slot for the request's adapter (one the running requests use, or a
        # free one of max_loras).
        max_loras = self.config.max_loras
        adapters = {r.hasher.lora for r in self.running} - {None} if max_loras else set()
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not out.preempted
        ):
            request = self.waiting[0]
            adapter = request.hasher.lora
            if max_loras and adapter is not None and adapter not in adapters:
                if len(adapters) >= max_loras:
                    break  # head-of-line, as for blocks: it runs once an adapter's slot frees
                adapters.add(adapter)
            if kv_cache.holds_blocks(request):  # its prefix landed from a peer
                computed, num_cached = [], request.num_computed_tokens
            else:
                computed, num_cached = kv_cache.get_computed_blocks(request)
                if computed and request.needs_prompt_hidden:
                    computed = computed[: self.num_hidden_blocks(computed)]
                    num_cached = len(computed) * request.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if kv_cache.allocate_slots(request, num_new, computed) is None:
                break  # head-of-line: keep arrival order
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new)
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
