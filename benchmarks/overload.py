"""``kvswitch bench overload``: a fleet at ten times its capacity refuses what it cannot take, at
once, and what it admits stays as fast as at capacity.

A router and ``--num-workers`` CPU workers (``--max-num-seqs`` running and
``--max-waiting-requests`` waiting each) run as processes. Two phases of ``--duration-s``:

- **capacity**: a closed loop of as many clients as the fleet runs at once, each sending its next
  request when the last ends: the latency of a request at capacity, and the fleet's throughput;
- **overload**: requests arriving (Poisson) at ``--overload`` times that throughput, never
  retried (the SDK's ``max_retries=0``), so that admission itself is measured.

Every request is a random ``--prompt-tokens`` prompt with ``--output-tokens`` to generate.
Reported per phase: requests completed, refused (RESOURCE_EXHAUSTED) and failed otherwise; the
end-to-end latency of completed requests (p50, p99); the time a refusal took; and the resident
memory of the router and of each worker's processes at the start and end of the phase.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvswitch.benchmarks.timing import machine_info


@dataclass(frozen=True)
class OverloadBenchConfig:
    num_workers: int = 2
    max_num_seqs: int = 4
    max_waiting_requests: int = 4
    prompt_tokens: int = 32
    output_tokens: int = 32
    duration_s: float = 20.0
    overload: float = 10.0  # arrival rate in the overload phase, as a multiple of capacity
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_workers", "max_num_seqs", "prompt_tokens", "output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if not (self.duration_s > 0 and self.overload >= 1):
            raise ValueError("duration_s must be positive and overload at least 1")


@dataclass
class _Phase:
    latencies_s: list[float]
    refusal_s: list[float]
    num_failed: int = 0


def run(config: OverloadBenchConfig) -> dict[str, Any]:
    from kvswitch.serving import start_server_process

    router, address = start_server_process(["router", "--port", "0", "--wait-for-worker-s", "5"])
    workers = []
    try:
        for _ in range(config.num_workers):
            workers.append(
                start_server_process(
                    [
                        "worker",
                        "--port",
                        "0",
                        "--index",
                        f"grpc://{address}",
                        "--cpu-threads",
                        "1",
                        "--max-num-seqs",
                        str(config.max_num_seqs),
                        "--max-waiting-requests",
                        str(config.max_waiting_requests),
                    ]
                )[0]
            )
        processes = {"router": router, **{f"worker{i}": w for i, w in enumerate(workers)}}
        return asyncio.run(_measure(address, config, processes))
    finally:
        for process in [*workers, router]:
            process.terminate()
        for process in [*workers, router]:
            process.wait(timeout=30)


async def _measure(
    address: str, config: OverloadBenchConfig, processes: dict[str, subprocess.Popen]
) -> dict[str, Any]:
    from kvswitch.client import AsyncClient

    rng = random.Random(config.seed)

    def prompt() -> list[int]:
        return [rng.randrange(256) for _ in range(config.prompt_tokens)]

    report: dict[str, Any] = {}
    async with AsyncClient(address, max_retries=0, timeout_s=120) as client:
        # Every worker has joined once as many requests as they run at once have been served.
        await _wait_for_workers(client, config.num_workers)
        num_running = config.num_workers * config.max_num_seqs
        print(f"capacity: {num_running} clients, {config.duration_s:g} s", file=sys.stderr)
        memory_before = _memory(processes)
        phase = _Phase([], [])
        stop_s = time.monotonic() + config.duration_s
        await asyncio.gather(
            *(_closed_loop(client, prompt, config, phase, stop_s) for _ in range(num_running))
        )
        report["capacity"] = _figures(phase, config.duration_s, memory_before, processes)
        rate = config.overload * report["capacity"]["completed_per_s"]
        print(f"overload: {rate:.0f} requests/s, {config.duration_s:g} s", file=sys.stderr)
        memory_before = _memory(processes)
        phase = _Phase([], [])
        tasks = []
        arrivals = random.Random(config.seed + 1)
        stop_s = time.monotonic() + config.duration_s
        while time.monotonic() < stop_s:
            tasks.append(asyncio.create_task(_one(client, prompt(), config, phase)))
            await asyncio.sleep(arrivals.expovariate(rate))
        await asyncio.gather(*tasks)
        report["overload"] = _figures(phase, config.duration_s, memory_before, processes)
        report["overload"]["arrivals_per_s"] = rate
    capacity, overload = report["capacity"], report["overload"]
    report["admitted_p99_over_capacity_p99"] = overload["latency_ms"]["p99"] / max(
        capacity["latency_ms"]["p99"], 1e-9
    )
    report["config"] = {k: getattr(config, k) for k in config.__dataclass_fields__}
    report["machine"] = machine_info()
    return report


async def _wait_for_workers(client, num_workers: int) -> None:
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while len(seen) < num_workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only workers {sorted(seen)} joined")
        result = await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1, policy="random")
        seen.add(result.stats.worker_id)


async def _closed_loop(client, prompt, config: OverloadBenchConfig, phase: _Phase, stop_s: float):
    while time.monotonic() < stop_s:
        await _one(client, prompt(), config, phase)


async def _one(client, prompt: list[int], config: OverloadBenchConfig, phase: _Phase) -> None:
    from kvswitch.client import KvswitchError

    start_s = time.monotonic()
    try:
        await client.generate(prompt_token_ids=prompt, max_tokens=config.output_tokens)
    except KvswitchError as e:
        if e.code.name == "RESOURCE_EXHAUSTED":
            phase.refusal_s.append(time.monotonic() - start_s)
        else:
            phase.num_failed += 1
        return
    phase.latencies_s.append(time.monotonic() - start_s)


def _percentiles_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"p50": 0.0, "p99": 0.0}
    ordered = sorted(values_s)

    def at(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1e3

    return {"p50": at(0.5), "p99": at(0.99)}


def _figures(
    phase: _Phase, duration_s: float, memory_before: dict, processes: dict
) -> dict[str, Any]:
    return {
        "completed": len(phase.latencies_s),
        "completed_per_s": len(phase.latencies_s) / duration_s,
        "refused": len(phase.refusal_s),
        "failed_otherwise": phase.num_failed,
        "latency_ms": _percentiles_ms(phase.latencies_s),
        "refusal_ms": _percentiles_ms(phase.refusal_s),
        "rss_mib_before": memory_before,
        "rss_mib_after": _memory(processes),
    }


def _memory(processes: dict[str, subprocess.Popen]) -> dict[str, float]:
    """Resident MiB of each process and its children (a worker's engine core)."""
    return {name: round(_rss_kib(p.pid) / 1024, 1) for name, p in processes.items()}


def _rss_kib(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1])
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        total += sum(_rss_kib(int(child)) for child in children)
    return total
