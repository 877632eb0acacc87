"""One simulated worker: the scheduler's batching, the block pool, and a clock that only moves
when steps end.

Each step is scheduled as ``worker/scheduler.py`` schedules one: running requests first (a decode
takes one token, an unfinished prefill its next chunk), then waiting requests oldest first, their
cached prefix skipped, while the token budget, the sequence limit and free blocks last; when a
running request cannot get a block, the most recently admitted one is preempted and waits again,
to be recomputed. The step takes the profile's time for what it computes, then its effects land:
prompt tokens count as computed, a finished prefill yields the first token, the pool's cache
events go to the index.

A step with no prompt work repeats itself exactly until some decode finishes or needs a new
block, so such a run of steps is one *stretch* here: step ``j`` of it costs ``a + j b`` (every
request's context grows by a token a step), and a stretch is cut short when a request arrives, so
that it joins the step it would have joined. The worker also keeps, as ``WorkerHandle`` counters,
what the router knows of it (``router/workers.py``): the uncached prompt tokens of its requests
not yet past their first token and the output tokens still to come, counted down a step at a
time, and the load report the router last polled.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvswitch.cache_index.events import CacheEvent
from kvswitch.loadtest.kv_blocks import BlockTable, KVBlocks
from kvswitch.loadtest.profiles import WorkerProfile, attention_pairs
from kvswitch.router.workers import WorkerHandle
from kvswitch.v1 import worker_pb2


@dataclass(slots=True, eq=False)
class Job:
    """One request on a simulated worker."""

    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: list[bytes]  # of the full prompt blocks
    num_routed_prefill_tokens: int  # the uncached tokens the router charged the worker with
    lora: str | None = None  # the LoRA adapter it runs under
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose KV is computed
    num_produced: int = 0  # output tokens, as of decode step ``decode_mark`` of the worker
    decode_mark: int = 0
    decoding: bool = False
    num_cached_tokens: int = -1  # the prefix hit on first admission
    num_reloaded_tokens: int = 0  # of which loaded back from the host tier
    first_token_s: float = math.nan

    @property
    def num_tokens(self) -> int:
        """Tokens to hold before decoding (again): the prompt and the output so far."""
        return self.num_prompt_tokens + self.num_produced


class SimWorker:
    def __init__(
        self,
        handle: WorkerHandle,
        profile: WorkerProfile,
        num_blocks: int,
        block_tokens: int,
        load_poll_s: float,
        *,
        loras: Sequence[str] = (),
        max_loras: int = 1,
        lora_load_s: float = 0.0,
        num_host_blocks: int = 0,
        reload_tokens_per_s: float = math.inf,
    ) -> None:
        """``num_host_blocks``: a host tier of that many blocks under the pool
        (``KVBlocks``), whose blocks load back at ``reload_tokens_per_s`` tokens of KV a
        second, the load adding to the step the request joins."""
        self.handle = handle
        self.loras = tuple(loras)  # the adapters it serves
        self.max_loras = max_loras
        self.lora_load_s = lora_load_s
        self._slots: OrderedDict[str, None] = OrderedDict()  # adapters in a slot, LRU first
        self.num_lora_loads = 0
        self.profile = profile
        self.blocks = KVBlocks(num_blocks, block_tokens, num_host_blocks)
        self.block_tokens = block_tokens
        self.reload_tokens_per_s = reload_tokens_per_s
        self.load_poll_s = load_poll_s
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []  # in admission order
        self.arriving: list[Job] = []  # routed here, their prefix still on its way from a peer
        self.busy_s = 0.0
        self.end_s = 0.0  # when the last step ended
        self.num_prefill_tokens = 0  # prompt tokens computed, recomputation included
        self.num_preempted = 0
        self._num_decode_steps = 0  # steps so far; every decoding request gains a token in each
        self._num_queued_prefill_tokens = 0  # as the worker reports it (waiting ones whole)
        # The step in progress: `_num_steps` left of a stretch, the next one starting at
        # `_step_start_s` and taking `_step_s`, each later one `_step_growth_s` longer.
        self._num_steps = 0
        self._step_start_s = 0.0
        self._step_s = 0.0
        self._step_growth_s = 0.0
        self._num_decodes = 0
        self._chunks: list[tuple[Job, int]] = []  # prompt tokens the step computes, per request
        self._events: list[CacheEvent] = []
        self._poll_index = -1  # of the last poll whose report is known
        self._report = self._current_load()  # at that poll
        self._reported: tuple[object, ...] = ()  # what handle.load says
        self._polled_index = -1  # of the poll handle.load was last brought up to
        self.next_change_s = math.inf  # before this, advance_to has nothing to do

    # -- the fleet's side ----------------------------------------------------------------------

    def advance_to(self, now_s: float) -> None:
        """Run every step that ends by ``now_s``; a step that would start at ``now_s`` or later
        waits, so that a request arriving at ``now_s`` can join it."""
        while True:
            if not self._num_steps:
                if not (self.running or self.waiting) or self.end_s >= now_s:
                    break
                self._schedule(self.end_s)
            num_done = self._steps_done_by(now_s)
            if num_done:
                self._run_steps(num_done)
            if self._num_steps:
                break
        self._set_next_change()

    def expect(self, job: Job) -> None:
        """A request is routed here but arrives later, once its prefix came from a peer."""
        self.arriving.append(job)

    def take_blocks(self, block_hashes: list[bytes]) -> int:
        """Blocks a peer held, into the cache (after ``advance_to`` their arrival); how many
        were new."""
        return self.blocks.take(block_hashes)

    def add(self, job: Job, now_s: float) -> None:
        """A request arrives (after ``advance_to(now_s)``)."""
        if job in self.arriving:
            self.arriving.remove(job)
        self._observe(now_s)
        self.waiting.append(job)
        self._num_queued_prefill_tokens += job.num_prompt_tokens
        if self._num_steps > 1:
            self._num_steps = 1  # the stretch ends with the step under way: the request joins next
        elif not self._num_steps:
            self.end_s = max(self.end_s, now_s)
        self._set_next_change()

    def _set_next_change(self) -> None:
        if self._num_steps:
            self.next_change_s = self._step_start_s + self._step_s  # the next step's end
        else:
            self.next_change_s = self.end_s if self.running or self.waiting else math.inf

    def poll(self, now_s: float) -> None:
        """Give the router the load report it polled last (every ``load_poll_s``; 0: now)."""
        if self.load_poll_s > 0:
            poll_index = int(now_s // self.load_poll_s)
            if poll_index == self._polled_index:
                return  # no poll since the last: the router has that report
            self._polled_index = poll_index
        self._observe(now_s)
        report = self._report if self.load_poll_s > 0 else self._current_load()
        if report != self._reported:
            self._reported = report
            running, waiting, queued, free, loaded, free_slots = report
            self.handle.load = worker_pb2.WorkerLoad(
                worker_id=self.handle.worker_id,
                num_running_requests=running,
                num_waiting_requests=waiting,
                num_queued_prefill_tokens=queued,
                num_free_blocks=free,
                num_total_blocks=self.blocks.pool.num_blocks,
                loras=self.loras,
                loaded_loras=loaded,
                num_free_lora_slots=free_slots,
            )

    def take_events(self) -> list[CacheEvent]:
        """The cache events of the steps ended so far, for the index."""
        events, self._events = self._events, []
        return events

    # -- steps ---------------------------------------------------------------------------------

    def _schedule(self, start_s: float) -> None:
        self._observe(start_s)
        profile, blocks = self.profile, self.blocks
        budget = profile.max_num_batched_tokens
        chunks: list[tuple[Job, int]] = []
        num_decodes = num_context = num_prompt_tokens = 0
        num_pairs = 0.0
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            job = running[i]
            if job.decoding:
                self._sync(job)
                num_new = 1
            else:
                num_new = min(job.num_tokens - job.num_computed, budget)
            while not blocks.allocate(job.table, job.block_hashes, job.num_computed + num_new):
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is job:
                    break
            else:
                if job.decoding:
                    num_decodes += 1
                    num_context += job.num_computed + 1
                else:
                    chunks.append((job, num_new))
                    num_prompt_tokens += num_new
                    num_pairs += attention_pairs(num_new, job.num_computed)
                budget -= num_new
                i += 1
                continue
            break
        waiting = self.waiting
        in_use = {j.lora for j in running}
        num_lora_loads = num_reload_tokens = 0
        while waiting and budget > 0 and len(running) < profile.max_num_seqs and not preempted:
            job = waiting[0]
            victim = self._slot_for(job.lora, in_use)
            if victim is None:
                break  # its adapter waits for a slot, at the head of the line
            hit = blocks.lookup(job.block_hashes, job.num_tokens)
            num_reloaded = 0
            if blocks.num_host_blocks:
                num_reloaded = self.block_tokens * blocks.num_in_host(
                    job.block_hashes, len(hit), job.num_tokens
                )
            num_cached = len(hit) * self.block_tokens + num_reloaded
            num_new = min(job.num_tokens - num_cached, budget)
            if not blocks.allocate(job.table, job.block_hashes, num_cached + num_new, hit):
                break  # head of line: keep arrival order
            if job.lora is not None:
                if job.lora not in self._slots:
                    self._slots.pop(victim, None)
                    num_lora_loads += 1
                self._slots[job.lora] = None
                self._slots.move_to_end(job.lora)
                in_use.add(job.lora)
            waiting.popleft()
            num_reload_tokens += num_reloaded
            if job.num_cached_tokens < 0:
                job.num_cached_tokens = num_cached
                job.num_reloaded_tokens = num_reloaded
            job.num_computed = num_cached
            self._num_queued_prefill_tokens -= num_cached
            running.append(job)
            chunks.append((job, num_new))
            num_prompt_tokens += num_new
            num_pairs += attention_pairs(num_new, num_cached)
            budget -= num_new
        self._chunks = chunks
        self._num_decodes = num_decodes
        self._step_start_s = start_s
        self._step_s = profile.step_time_s(num_prompt_tokens, num_pairs, num_decodes, num_context)
        self._step_s += num_lora_loads * self.lora_load_s
        self._step_s += num_reload_tokens / self.reload_tokens_per_s
        self.num_lora_loads += num_lora_loads
        self._step_growth_s = num_decodes * profile.decode_s_per_context_token
        self._num_steps = 1 if chunks or preempted else self._stretch()

    def _slot_for(self, lora: str | None, in_use: set[str | None]) -> str | None:
        """What a request of ``lora`` evicts to run: "" when nothing (no adapter, its adapter
        in a slot, a slot free), else the least recently used adapter that no running request
        uses; None when every slot holds one in use."""
        if lora is None or lora in self._slots or len(self._slots) < self.max_loras:
            return ""
        return next((name for name in self._slots if name not in in_use), None)

    def _stretch(self) -> int:
        """Decode-only steps from now until the first that finishes a request or needs a block."""
        block_tokens = self.block_tokens
        steps = math.inf
        for job in self.running:
            if job.decoding:
                until_done = job.num_output_tokens - job.num_produced
                until_full = len(job.table.blocks) * block_tokens - job.num_computed
                steps = min(steps, until_done, until_full)
        if steps == math.inf:
            raise RuntimeError("a step with nothing to compute")  # a bug: it would never end
        return max(int(steps), 1)

    def _steps_done_by(self, now_s: float) -> int:
        """How many steps of the one under way end by ``now_s``."""
        elapsed_s = now_s - self._step_start_s
        if elapsed_s == math.inf:
            return self._num_steps
        if self._num_steps == 1 or elapsed_s < self._step_s:
            return int(self._stretch_s(1) <= elapsed_s)
        a, b = self._step_s, self._step_growth_s
        # Solve n a + b n (n - 1) / 2 = elapsed for n, then settle rounding either way.
        if b > 0:
            half = a / b - 0.5
            n = int(math.sqrt(half * half + 2 * elapsed_s / b) - half)
        else:
            n = int(elapsed_s / a)
        n = min(max(n, 0), self._num_steps)
        while n > 0 and self._stretch_s(n) > elapsed_s:
            n -= 1
        while n < self._num_steps and self._stretch_s(n + 1) <= elapsed_s:
            n += 1
        return n

    def _stretch_s(self, num_steps: int) -> float:
        return num_steps * self._step_s + self._step_growth_s * num_steps * (num_steps - 1) / 2

    def _run_steps(self, num_steps: int) -> None:
        took_s = self._stretch_s(num_steps)
        self.busy_s += took_s
        self._step_start_s += took_s
        self._step_s += num_steps * self._step_growth_s
        self._num_steps -= num_steps
        self._num_decode_steps += num_steps
        # NOTE: each decode streams a token a step; the router counts them off as they come.
        self.handle.num_output_tokens -= num_steps * self._num_decodes
        if not self._num_steps:
            self._end_step(self._step_start_s)

    def _end_step(self, end_s: float) -> None:
        self._observe(end_s)
        self.end_s = end_s
        handle = self.handle
        for job, num_new in self._chunks:
            job.num_computed += num_new
            self.num_prefill_tokens += num_new
            self._num_queued_prefill_tokens -= num_new
            if job.num_computed < job.num_tokens:
                continue
            # The prompt is in: its last step samples the next output token.
            job.decoding = True
            job.num_produced += 1
            job.decode_mark = self._num_decode_steps
            if math.isnan(job.first_token_s):
                job.first_token_s = end_s
                handle.num_prefill_tokens -= job.num_routed_prefill_tokens
            handle.num_output_tokens -= 1
        self._chunks = []
        finished = False
        for job in self.running:
            if job.decoding:
                self._sync(job)
                finished |= job.num_produced >= job.num_output_tokens
        if finished:
            self._finish()
        self._events += self.blocks.pool.take_events()

    def _finish(self) -> None:
        still = []
        for job in self.running:
            if job.decoding and job.num_produced >= job.num_output_tokens:
                self.blocks.free(job.table)
                self.handle.num_in_flight -= 1
            else:
                still.append(job)
        self.running = still

    def _sync(self, job: Job) -> None:
        """Bring a decoding request's output count up to the steps run since it was last read."""
        job.num_produced += self._num_decode_steps - job.decode_mark
        job.decode_mark = self._num_decode_steps
        job.num_computed = job.num_tokens - 1  # the newest token's KV comes with the next step

    def _preempt(self, job: Job) -> None:
        if job.decoding:
            self._sync(job)
        self.blocks.free(job.table)
        # Waiting, it counts whole; running, it counted what was left of its prompt.
        left = 0 if job.decoding else job.num_tokens - job.num_computed
        self._num_queued_prefill_tokens += job.num_tokens - left
        job.num_computed = 0
        job.decoding = False
        self.num_preempted += 1
        self.waiting.appendleft(job)

    def check(self) -> None:
        """AssertionError unless the router's counters here and the queued prefill the worker
        reports are what its requests add up to, and its block pool and tables agree."""
        jobs = [*self.running, *self.waiting, *self.arriving]
        handle = self.handle
        assert handle.num_in_flight == len(jobs), (handle.num_in_flight, len(jobs))
        not_started = [j for j in jobs if math.isnan(j.first_token_s)]
        assert handle.num_prefill_tokens == sum(j.num_routed_prefill_tokens for j in not_started)
        produced = [
            j.num_produced + (self._num_decode_steps - j.decode_mark if j.decoding else 0)
            for j in jobs
        ]
        num_output = sum(j.num_output_tokens for j in jobs) - sum(produced)
        assert handle.num_output_tokens == num_output, (handle.num_output_tokens, num_output)
        queued = sum(j.num_tokens for j in self.waiting)  # not those arriving: not here yet
        queued += sum(j.num_tokens - j.num_computed for j in self.running if not j.decoding)
        assert self._num_queued_prefill_tokens == queued, (self._num_queued_prefill_tokens, queued)
        pool = self.blocks.pool
        pool.check_integrity()
        assert all(not j.table.blocks for j in self.waiting), "a waiting request holds blocks"
        refs = sum(len(j.table.blocks) for j in self.running)
        assert refs == sum(block.ref_cnt for block in pool.blocks), "block tables and refs differ"

    # -- the load report -----------------------------------------------------------------------

    def _current_load(self) -> tuple[int, int, int, int, tuple[str, ...], int]:
        return (
            len(self.running),
            len(self.waiting),
            self._num_queued_prefill_tokens,
            self.blocks.num_free_blocks,
            tuple(self._slots),
            self.max_loras - len(self._slots),
        )

    def _observe(self, now_s: float) -> None:
        """Called before the load changes at ``now_s``: polls since the last change saw the
        load as it is now."""
        if self.load_poll_s <= 0:
            return
        poll_index = int(now_s // self.load_poll_s)
        if poll_index > self._poll_index:
            self._poll_index = poll_index
            self._report = self._current_load()
