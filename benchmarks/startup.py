"""``kvswitch bench startup``: how long things take to start.

- **Commands**: each ``kvswitch`` command as a fresh process that prints its help (or version)
  and exits: what every use of the command line pays before it does anything (``--num-runs``
  each, the median reported; 0 = none).
- **A worker** (``--repeat`` times; 0 = none): a router on the embedded index is started and
  ready, then a worker process (the built-in tiny model, CPU) with a request already waiting at
  the router. ``worker_ready_s`` is the time from the worker's process start until that request
  was served by it: imported, engine core up, serving, registered, seen by the router and routed
  to. The phases come from the worker's own log (its startup lines, ``worker/startup.py``) and
  from outside: ``import_s`` (process start to the worker's code running: the interpreter, the
  serving process's imports, parsing), ``engine_core_start_s`` (the engine core's process
  started until it said READY; of which ``core_spawn_s``, its interpreter and protocol imports,
  ``core_import_s``, the engine's modules (torch), and ``model_load_s``, the model and its KV
  cache), ``listening_s`` (the worker printed its address), ``registered_s`` (the index lists it).
- **A restart** (``--restart``, as many as ``--repeat``): a one-worker cluster under ``kvswitch
  up``'s supervisor; the worker's serving process is killed (SIGKILL) and requests are sent
  until one is served again. ``restart_ready_s`` is from the kill to that answer, of which
  ``restart_launched_s`` is the supervisor's wait before it starts the worker again and
  ``restart_listening_s`` when the new one printed its address.

Figures are medians over the runs, with every run in ``runs`` / ``restart_runs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
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
_KVSWITCH = (sys.executable, "-m", "kvswitch.app.cli")
START_TIMEOUT_S = 180.0  # a worker on a busy machine
PROMPT_TOKEN_IDS = [1, 2, 3, 4]
# A log field and its value: a bare word, or a JSON string (kvswitch.logs quotes those).
_LOG_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass(frozen=True)
class StartupBenchConfig:
    num_runs: int = 7  # fresh processes per command; the median is reported; 0 = none
    repeat: int = 3  # worker starts timed (and as many restarts); 0 = none
    restart: bool = True  # also time a worker killed under kvswitch up's supervisor

    def __post_init__(self) -> None:
        if self.num_runs < 0:
            raise ValueError(f"num_runs must be >= 0, got {self.num_runs}")
        if self.repeat < 0:
            raise ValueError(f"repeat must be >= 0, got {self.repeat}")
        if self.num_runs == 0 and self.repeat == 0:
            raise ValueError("nothing to measure: num_runs and repeat are both 0")


def run(config: StartupBenchConfig) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if config.num_runs:
        result["median_s"] = _time_commands(config.num_runs)
    if config.repeat:
        runs = []
        for i in range(config.repeat):
            runs.append(time_worker_start())
            print(f"worker start {i + 1}: {_describe(runs[-1])}", file=sys.stderr)
        result.update(_medians(runs))
        result["runs"] = runs
        if config.restart:
            restarts = time_worker_restarts(config.repeat)
            result.update(_medians(restarts))
            result["restart_runs"] = restarts
    result["config"] = asdict(config)
    result["machine"] = machine_info()
    return result


def _time_commands(num_runs: int) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for command in COMMANDS:
        argv = [*_KVSWITCH, *command.split()]
        runs_s = []
        for _ in range(num_runs):
            started_s = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True)
            runs_s.append(time.perf_counter() - started_s)
        seconds[command] = statistics.median(runs_s)
        print(f"kvswitch {command}: {seconds[command]:.2f} s", file=sys.stderr)
    return seconds


# -- a worker's start ------------------------------------------------------------------------------


def time_worker_start() -> dict[str, float]:
    """One worker started beside a ready router; its phases in seconds from its process start."""
    from kvswitch.deploy.processes import Child

    with tempfile.TemporaryDirectory(prefix="kvswitch-startup-") as folder:
        logs = Path(folder)
        router = Child(
            "router",
            [*_KVSWITCH, "router", "--port", "0", "--index", "memory://", "--metrics-port", "-1",
             "--wait-for-worker-s", str(START_TIMEOUT_S)],
            env=None,
            log_path=logs / "router.log",
        )  # fmt: skip
        worker = Child(
            "worker",
            [*_KVSWITCH, "worker", "--port", "0", "--worker-id", "bench-worker",
             "--metrics-port", "-1"],
            env=None,
            log_path=logs / "worker.log",
        )  # fmt: skip
        try:
            router.launch()
            address = router.wait_ready(START_TIMEOUT_S)
            worker.argv += ["--index", f"grpc://{address}"]
            figures = _watch_start(worker, address)
        finally:
            for child in (worker, router):
                child.terminate()
                child.wait(30.0)
        figures.update(_logged_phases(logs / "worker.log"))
    return figures


def _watch_start(worker: Any, router_address: str) -> dict[str, float]:
    """Launch ``worker`` and time it from outside: when it listens, registers, serves."""
    from kvswitch.cache_index.connect import connect_index
    from kvswitch.client import Client

    with Client(router_address, timeout_s=START_TIMEOUT_S, max_retries=0) as client:
        client.wait_until_connected(START_TIMEOUT_S)
        figures: dict[str, float] = {}
        started_s = time.monotonic()  # Popen returns once the process runs its program
        worker.launch()
        # Waits at the router (--wait-for-worker-s) until the worker is routable.
        served = _in_thread(
            lambda: client.generate(prompt_token_ids=PROMPT_TOKEN_IDS, max_tokens=1)
        )

        async def registered() -> None:
            index = await connect_index(f"grpc://{router_address}")
            try:
                while not any(w.worker_id == "bench-worker" for w in await index.live_workers()):
                    await asyncio.sleep(0.01)
            finally:
                await index.close()

        worker.wait_ready(START_TIMEOUT_S)
        figures["listening_s"] = time.monotonic() - started_s
        asyncio.run(registered())
        figures["registered_s"] = time.monotonic() - started_s
        served.join()
        figures["worker_ready_s"] = served.done_s - started_s
        if served.error is not None:
            raise served.error
    return figures


class _Timed(threading.Thread):
    def __init__(self, call: Any) -> None:
        super().__init__(daemon=True)
        self._call = call
        self.done_s = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._call()
        except BaseException as e:  # handed to the caller
            self.error = e
        self.done_s = time.monotonic()


def _in_thread(call: Any) -> _Timed:
    thread = _Timed(call)
    thread.start()
    return thread


def _logged_phases(log_path: Path) -> dict[str, float]:
    """The worker's startup lines (``worker/startup.py``'s fields) as phases."""
    fields: dict[str, float] = {}
    for line in log_path.read_text().splitlines():
        for key, value in _LOG_FIELD.findall(line):
            if key.startswith("startup_"):
                fields[key.removeprefix("startup_")] = float(value)
    names = {
        "imports_s": "import_s",
        "engine_core_s": "engine_core_start_s",
        "core_spawn_s": "core_spawn_s",
        "core_imports_s": "core_import_s",
        "engine_build_s": "model_load_s",
    }
    return {name: fields[key] for key, name in names.items() if key in fields}


# -- a worker's restart ----------------------------------------------------------------------------


def time_worker_restarts(num_restarts: int) -> list[dict[str, float]]:
    """Kill a supervised worker ``num_restarts`` times; each: seconds from the kill."""
    from kvswitch.deploy.local import ClusterConfig, LocalCluster
    from kvswitch.deploy.processes import RestartPolicy

    # NOTE: every death counts as a first one (each run waits the first backoff, as a worker
    # that was up a minute does), not as one of a crash loop.
    policy = dataclasses.replace(RestartPolicy(), healthy_s=1e-3)
    config = ClusterConfig(workers=1, port=0)
    runs = []
    with LocalCluster(config, supervise=True, restart_policy=policy, say=lambda line: None) as (
        cluster
    ):
        from kvswitch.client import Client

        with Client(cluster.address, timeout_s=START_TIMEOUT_S, max_retries=0) as client:
            client.generate(prompt_token_ids=PROMPT_TOKEN_IDS, max_tokens=1)
            for i in range(num_restarts):
                runs.append(_time_restart(cluster, client))
                print(f"worker restart {i + 1}: {_describe(runs[-1])}", file=sys.stderr)
    return runs


def _time_restart(cluster: Any, client: Any) -> dict[str, float]:
    worker = cluster.workers[0]
    old_popen = worker.popen
    killed_s = time.monotonic()
    os.kill(old_popen.pid, signal.SIGKILL)

    def listening() -> None:
        while worker.popen is old_popen or not worker.is_ready:
            time.sleep(0.01)

    back = _in_thread(listening)
    while True:
        try:
            # The router holds it while it has no routable worker, up to its deadline.
            client.generate(prompt_token_ids=PROMPT_TOKEN_IDS, max_tokens=1, timeout_s=2.0)
        except Exception:  # the dead worker's failures, until the new one serves
            if time.monotonic() - killed_s > START_TIMEOUT_S:
                raise
            time.sleep(0.01)
            continue
        if worker.popen is not old_popen:
            break
    ready_s = time.monotonic()
    back.join()
    return {
        "restart_launched_s": worker.started_s - killed_s,
        "restart_listening_s": back.done_s - killed_s,
        "restart_ready_s": ready_s - killed_s,
    }


# -- figures ---------------------------------------------------------------------------------------


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(key for run in runs for key in run)
    return {key: statistics.median(run[key] for run in runs if key in run) for key in keys}


def _describe(figures: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.2f}" for key, value in figures.items())
