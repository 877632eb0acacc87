"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def rate_per_s(run_once: Callable[[], int], *, duration_s: float, label: str) -> dict[str, float]:
    """Call ``run_once`` (which returns how many units it processed) for about ``duration_s``.

    Returns the median and best rate over the calls, in units per second, and prints a line of
    progress to stderr about once a second.
    """
    rates: list[float] = []
    deadline = time.perf_counter() + duration_s
    next_report = time.perf_counter() + 1.0
    while True:
        start = time.perf_counter()
        num_units = run_once()
        now = time.perf_counter()
        rates.append(num_units / (now - start))
        if now >= next_report:
            print(
                f"  {label}: {statistics.median(rates):,.0f}/s over {len(rates)} runs",
                file=sys.stderr,
            )
            next_report = now + 1.0
        if now >= deadline and len(rates) >= 3:
            break
    return {
        "median_per_s": statistics.median(rates),
        "best_per_s": max(rates),
        "num_runs": len(rates),
    }


def machine_info() -> dict[str, str | int]:
    """What the figures were measured on, recorded beside them."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "num_cpus": os.cpu_count() or 0, "python": platform.python_version()}


class BenchmarkUnavailable(RuntimeError):
    """This machine cannot run the benchmark (e.g. it needs a GPU)."""


def percentile(values: list[float], q: float) -> float:
    """The value at fraction ``q`` of ``values`` sorted (nearest rank, no interpolation)."""
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def p50_p99(values: list[float]) -> dict[str, float]:
    """``values``' p50 and p99 (``percentile``); both 0 for none."""
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) of ``pid`` and the processes under it, from /proc."""
    total = 0.0
    for task in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{task}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _descendants(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in map(int, children):
            found += [child, *_descendants(child)]
    return found
