"""Drives sessions against a live router through the project's ``AsyncClient`` and records what
every request saw (``RequestRecord``).

One phase runs one policy over every session, session ``i`` through router ``i`` mod the number
of routers (several routers may serve one fleet): sessions start at their open-loop times (or, with
``concurrency``, whenever fewer than that many are running: a closed loop), each session's turns
one after another. The first ``num_warmup`` sessions are sent like the others but marked as
warm-up, so the figures leave them out. Issuing stops at ``max_requests`` requests or after
``duration_s``; requests already sent are waited for.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvswitch.client import AsyncClient, KvswitchError
from kvswitch.loadtest.figures import RequestRecord
from kvswitch.loadtest.openai_target import OpenAITarget, TargetError
from kvswitch.loadtest.workloads import Session


@dataclass(frozen=True)
class PhasePlan:
    """How one phase sends its sessions. ``start_times_s`` (one per session, from the phase's
    start) drive an open loop; ``concurrency`` > 0 a closed loop instead."""

    policy: str | None  # None: the router's default
    cache_salt: str
    start_times_s: Sequence[float] = ()
    concurrency: int = 0
    num_warmup: int = 0
    max_requests: int = 0  # 0: no bound
    duration_s: float = math.inf
    timeout_s: float = 300.0  # each request's deadline


class _Budget:
    """Requests a phase may still issue, and until when."""

    def __init__(self, max_requests: int, deadline_s: float) -> None:
        self.left = max_requests or math.inf
        self.deadline_s = deadline_s

    def take(self) -> bool:
        if self.left <= 0 or time.monotonic() >= self.deadline_s:
            return False
        self.left -= 1
        return True


async def run_phase(
    clients: Sequence[AsyncClient | OpenAITarget],
    sessions: Sequence[Session],
    plan: PhasePlan,
    on_request_done: Callable[[RequestRecord], None] = lambda record: None,
) -> tuple[list[RequestRecord], float, float]:
    """Run the phase; returns its records in completion order and its start and end times (on
    ``time.monotonic``'s clock)."""
    start_s = time.monotonic()
    budget = _Budget(plan.max_requests, start_s + plan.duration_s)
    records: list[RequestRecord] = []

    async def run_session(index: int) -> None:
        session = sessions[index]
        history: np.ndarray | None = None
        for turn, message in enumerate(session.messages):
            if not budget.take():
                return
            prompt = message if history is None else np.concatenate([history, message])
            client = clients[index % len(clients)]
            record, output = await _send(
                client, plan, prompt, session.max_tokens[turn], session.prompt_logprobs
            )
            record.session, record.turn, record.warmup = index, turn, index < plan.num_warmup
            record.router = client.target
            records.append(record)
            on_request_done(record)
            if not record.ok:
                return  # the conversation cannot go on without its answer
            history = np.concatenate([prompt, np.asarray(output, np.int64)])

    if plan.concurrency > 0:
        queue = iter(range(len(sessions)))

        async def closed_loop_worker() -> None:
            for index in queue:
                if time.monotonic() >= budget.deadline_s or budget.left <= 0:
                    return
                await run_session(index)

        await asyncio.gather(*(closed_loop_worker() for _ in range(plan.concurrency)))
    else:
        if len(plan.start_times_s) != len(sessions):
            raise ValueError("an open loop needs one start time per session")
        tasks = []
        for index, at_s in enumerate(plan.start_times_s):
            delay_s = start_s + at_s - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if time.monotonic() >= budget.deadline_s or budget.left <= 0:
                break
            tasks.append(asyncio.create_task(run_session(index)))
        await asyncio.gather(*tasks)
    return records, start_s, time.monotonic()


async def _send(
    client: AsyncClient | OpenAITarget,
    plan: PhasePlan,
    prompt: np.ndarray,
    max_tokens: int,
    prompt_logprobs: int | None = None,
) -> tuple[RequestRecord, list[int]]:
    """Send one request and stream it to the end: what it saw, and its output tokens.
    ``prompt_logprobs``: the prompt is scored too (``echo`` with ``logprobs`` over HTTP)."""
    record = RequestRecord(0, 0, False, time.monotonic(), len(prompt))
    output: list[int] = []
    scored = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    try:
        async with client.stream(
            prompt_token_ids=prompt.tolist(),
            max_tokens=max_tokens,
            cache_salt=plan.cache_salt,
            policy=plan.policy,
            timeout_s=plan.timeout_s,
            **scored,
        ) as stream:
            async for chunk in stream:
                if chunk.token_ids:
                    record.chunk_times_s.append(time.monotonic())
                    output += chunk.token_ids
            result = stream.result
        record.end_s = time.monotonic()
        record.num_output_tokens = len(output)
        record.num_cached_tokens = result.stats.num_cached_tokens
        record.worker_id = result.stats.worker_id
        if not output:
            record.error = "no output token"
    except KvswitchError as e:
        record.end_s = time.monotonic()
        record.error = e.code.name
    except TargetError as e:
        record.end_s = time.monotonic()
        record.error = e.reason
    return record, output
