"""``kvswitch loadtest``: one workload against a live router, once per routing policy.

Each policy gets a phase of its own over the same sessions, one after another, with its own
cache salt, so that no policy finds blocks another one cached (nor blocks of an earlier run: the
salt holds a fresh run id). A phase's first ``warmup`` sessions are left out of its figures.
The report holds each phase's figures (``figures.py``) under ``policies``, in the order run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvswitch.client import AsyncClient
from kvswitch.loadtest.arrivals import open_loop_times
from kvswitch.loadtest.figures import SLOs, figures
from kvswitch.loadtest.openai_target import OpenAITarget
from kvswitch.loadtest.runner import PhasePlan, run_phase
from kvswitch.loadtest.workloads import Session, TraceReplay, make_workload
from kvswitch.router.policy import POLICIES

DEFAULT_POLICY = "default"  # the router's own default policy
CONNECT_TIMEOUT_S = 10.0  # how long a router may take to accept the connection


@dataclass(frozen=True)
class LoadTestConfig:
    target: str = "127.0.0.1:50051"  # a router, or several (comma-separated) serving one fleet
    model: str = ""  # an HTTP target's model; empty = the first its /v1/models lists
    workload: str = "shared_prefix"
    workload_args: str = ""  # "key=value,..." over the workload's defaults
    policies: str = "cost,round_robin"  # comma-separated, "all", or "default"
    rate: float = math.inf  # sessions per second (open loop); inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps: 1 = Poisson
    concurrency: int = 0  # > 0: a closed loop of this many sessions at a time instead
    warmup: int = 0  # sessions per phase left out of the figures
    max_requests: int = 0  # per phase; 0: every session's every turn
    duration_s: float = math.inf  # per phase: stop issuing after this long
    timeout_s: float = 300.0  # each request's deadline
    vocab_size: int = 256  # prompts draw token ids from [0, vocab_size)
    num_workers: int = 0  # the fleet size, when some worker may get no request
    slo_ttft_ms: float = 0.0  # goodput's objectives; 0: not checked
    slo_tpot_ms: float = 0.0
    slo_e2el_ms: float = 0.0
    seed: int = 0
    plots: str = ""  # a folder for the PNG plots; empty: none
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be positive (inf: all at once), got {self.rate}")
        if self.concurrency < 0 or self.warmup < 0 or self.max_requests < 0:
            raise ValueError("concurrency, warmup and max_requests must be >= 0")
        if not self.duration_s > 0 or not self.timeout_s > 0:
            raise ValueError("duration_s and timeout_s must be positive")
        if min(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_e2el_ms) < 0:
            raise ValueError("an SLO must be a number of milliseconds >= 0 (0: not checked)")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if not self.targets():
            raise ValueError("target must name a router, HOST:PORT (several: comma-separated)")
        self.policy_names()  # refuses unknown names now, not after a phase has run

    def targets(self) -> list[str]:
        return [target.strip() for target in self.target.split(",") if target.strip()]

    def policy_names(self) -> list[str]:
        if self.policies == "all":
            return list(POLICIES)
        names = [name.strip() for name in self.policies.split(",") if name.strip()]
        unknown = [n for n in names if n not in POLICIES and n != DEFAULT_POLICY]
        if unknown or not names:
            raise ValueError(
                f"unknown policies {unknown}; choose from {', '.join(POLICIES)}, "
                f"{DEFAULT_POLICY} (the router's) or all"
            )
        return list(dict.fromkeys(names))


def _client(target: str, model: str) -> AsyncClient | OpenAITarget:
    """The gRPC client of a router at HOST:PORT, or its HTTP API at http(s)://HOST:PORT."""
    if target.startswith(("http://", "https://")):
        return OpenAITarget(target, model)
    return AsyncClient(target, max_retries=0)


def run(config: LoadTestConfig) -> dict[str, Any]:
    """Run every phase; returns the report (see the module docstring)."""
    workload = make_workload(config.workload, config.workload_args)
    sessions = workload.sessions(config.vocab_size, config.seed)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a router dependency, absent on Windows
        return asyncio.run(_run(config, workload, sessions))
    return uvloop.run(_run(config, workload, sessions))


async def _run(config: LoadTestConfig, workload: Any, sessions: list[Session]) -> dict[str, Any]:
    run_id = secrets.token_hex(4)
    policies = config.policy_names()
    slos = SLOs(config.slo_ttft_ms or None, config.slo_tpot_ms or None, config.slo_e2el_ms or None)
    num_requests = sum(s.num_turns for s in sessions)
    if config.max_requests:
        num_requests = min(num_requests, config.max_requests)
    # NOTE: imported before any connection: a missing extra is said first.
    new_progress = _progress_bar() if config.progress else None
    report: dict[str, Any] = {
        "config": asdict(config),
        "workload": {"name": config.workload, **asdict(workload)},
        "num_sessions": len(sessions),
        "run_id": run_id,
        "policies": {},
    }
    all_records, origins = {}, {}
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(_client(target, config.model))
            for target in config.targets()
        ]
        # NOTE: a router that is not there is one error, not a report of requests all failed.
        for client in clients:
            await client.wait_until_connected(CONNECT_TIMEOUT_S)
        progress = new_progress(num_requests * len(policies)) if new_progress else None
        for policy in policies:
            plan = PhasePlan(
                policy=None if policy == DEFAULT_POLICY else policy,
                cache_salt=f"loadtest-{run_id}-{policy}",
                start_times_s=_start_times(config, workload, sessions),
                concurrency=config.concurrency,
                num_warmup=config.warmup,
                max_requests=config.max_requests,
                duration_s=config.duration_s,
                timeout_s=config.timeout_s,
            )
            if progress is not None:
                progress.set_description(policy)
            records, start_s, end_s = await run_phase(
                clients, sessions, plan, lambda _: progress.update() if progress else None
            )
            measured = [r for r in records if not r.warmup]
            first_s = min((r.start_s for r in measured), default=start_s)
            report["policies"][policy] = figures(
                records, end_s - first_s, slos, _idle_workers(records, config.num_workers)
            )
            all_records[policy], origins[policy] = records, start_s
    if progress is not None:
        progress.close()
    if config.plots:
        from kvswitch.loadtest.plots import write_plots

        paths = write_plots(Path(config.plots), all_records, report["policies"], origins)
        report["plots"] = [str(p) for p in paths]
    return report


def _start_times(config: LoadTestConfig, workload: Any, sessions: list[Session]) -> list[float]:
    if config.concurrency:
        return []
    if isinstance(workload, TraceReplay) and math.isinf(config.rate):
        return [s.arrival_s or 0.0 for s in sessions]  # the trace's own times
    return open_loop_times(len(sessions), config.rate, config.burstiness, config.seed)


def _idle_workers(records: list, num_workers: int) -> list[str]:
    """Names for the workers of a ``num_workers`` fleet that served none of ``records``, so that
    the imbalance counts them (with no work)."""
    seen = {r.worker_id for r in records if r.ok and not r.warmup}
    return [f"(idle {i})" for i in range(max(num_workers - len(seen), 0))]


def _progress_bar() -> Callable[[int], Any]:
    """What makes a progress bar of ``total`` requests on stderr."""
    from tqdm import tqdm

    return lambda total: tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
