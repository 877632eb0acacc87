"""``kvswitch bench startup``: how long each ``kvswitch`` command takes to start, as a fresh
process that prints its help (or version) and exits: what every use of the command line pays
before it does anything. A command imports only what it runs (``kvswitch --help`` none of the
commands), so its figure is its own imports'."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvswitch.benchmarks.timing import machine_info

COMMANDS = (
    "--help",
    "--version",
    "generate --help",
    "health --help",
    "index --help",
    "router --help",
    "worker --help",
    "up --help",
    "bench --help",
)


@dataclass(frozen=True)
class StartupBenchConfig:
    num_runs: int = 7  # per command; the median is reported

    def __post_init__(self) -> None:
        if self.num_runs < 1:
            raise ValueError(f"num_runs must be at least 1, got {self.num_runs}")


def run(config: StartupBenchConfig) -> dict[str, Any]:
    seconds: dict[str, float] = {}
    for command in COMMANDS:
        argv = [sys.executable, "-m", "kvswitch.app.cli", *command.split()]
        runs_s = []
        for _ in range(config.num_runs):
            started_s = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True)
            runs_s.append(time.perf_counter() - started_s)
        seconds[command] = statistics.median(runs_s)
        print(f"kvswitch {command}: {seconds[command]:.2f} s", file=sys.stderr)
    return {"median_s": seconds, "config": asdict(config), "machine": machine_info()}
