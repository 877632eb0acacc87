"""Faults under load, and a soak: a local cluster of real processes (``kvswitch up``'s), steady
greedy load whose every answer is checked token for token, faults on a schedule, and what held.

    python -m kvswitch.loadtest.chaos                                  each fault once
    python -m kvswitch.loadtest.chaos --redis external                 the same, an external Redis
    python -m kvswitch.loadtest.chaos --schedule soak --duration-s 600 the 10-minute churn run

Schedule ``faults``: after ``warmup_s`` of load, each of ``faults`` in turn (``loadtest/faults.py``
lists them), with ``settle_s`` of load before and after each; then the load pauses while every
worker is checked for leaked KV blocks and the index is audited against the workers' caches.

Schedule ``soak``: ``duration_s`` of load; every ``kill_every_s`` a worker (each in turn) gets
SIGKILL and the cluster's supervisor starts it again; once, at 55 % of the run (or at its end,
where the kills before it took that long), the Redis goes (``--redis local``: killed and
restarted at once by the cluster; ``external``: down for ``redis_down_s``). At the end: leaks,
the audit, and each process's memory over the last ``rss_window_s``.

The summary is JSON (stdout, and ``--json``): per fault its figures (seconds) and the tally of
the requests that were running while it lasted; the run's tally; leaks; audits; memory (each
process's growth over the last ``rss_window_s``, and its RSS every 30 s); and the goals of
docs/RELIABILITY.md, each with whether it held. The exit status is 1 when one did not.
A ``partition`` needs root: run as root, the command moves itself into a network namespace of
its own (``unshare --net``) so that dropping a worker's packets touches nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.deploy.local import ClusterConfig, ClusterError, LocalCluster
from kvswitch.deploy.processes import RestartPolicy
from kvswitch.loadtest import faults
from kvswitch.loadtest.chaos_goals import goals
from kvswitch.loadtest.checked_load import CheckedLoad, make_prompts, tally
from kvswitch.loadtest.fleet_checks import (
    RssSampler,
    engine_core_pid,
    leaked_blocks,
    wait_for_index,
)

SCHEDULES = ("faults", "soak")
REDIS_MODES = ("local", "external", "none")
SOAK_REDIS_AT = 0.55  # of the soak's duration


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    schedule: str = "faults"
    faults: str = "all"
    workers: int = 3
    redis: str = "local"
    concurrency: int = 4
    max_tokens: int = 128
    timeout_s: float = 8.0
    max_retries: int = 30  # see CheckedLoad
    warmup_s: float = 5.0
    settle_s: float = 3.0
    stall_s: float = 10.0
    redis_down_s: float = 10.0
    partition_s: float = 6.0
    duration_s: float = 600.0
    kill_every_s: float = 60.0
    rss_window_s: float = 300.0
    rss_every_s: float = 1.0
    progress_every_s: float = 30.0
    seed: int = 0
    log_dir: str = ""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.redis not in REDIS_MODES:
            raise ValueError(f"redis must be one of {', '.join(REDIS_MODES)}, got {self.redis!r}")
        unknown = set(self.fault_names(applicable_only=False)) - set(faults.FAULTS)
        if unknown:
            raise ValueError(
                f"unknown fault {sorted(unknown)[0]!r}; the faults are {', '.join(faults.FAULTS)}"
            )
        if self.stall_s <= self.timeout_s:
            raise ValueError(
                f"stall_s ({self.stall_s}) must pass the requests' deadline (timeout_s, "
                f"{self.timeout_s}): the stall is meant to outlast it"
            )
        for name in ("workers", "concurrency", "max_tokens", "timeout_s", "duration_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def fault_names(self, *, applicable_only: bool = True) -> list[str]:
        """The faults to inject, in order (schedule ``faults``). ``all``: those this fleet has
        (no Redis faults without a Redis, ``redis-kill`` only for ``--redis local``)."""
        names = list(faults.FAULTS) if self.faults == "all" else self.faults.split(",")
        if not applicable_only:
            return names
        return [n for n in names if not self.why_not(n)]

    def why_not(self, fault: str) -> str:
        """Why ``fault`` cannot be injected in this fleet; empty if it can."""
        if fault.startswith("redis") and self.redis == "none":
            return "the fleet has no Redis (--redis none)"
        if fault == "redis-kill" and self.redis != "local":
            return "only a --redis local server is restarted by the cluster"
        if fault == "partition" and os.geteuid() != 0:
            return "dropping a worker's packets needs root (tc)"
        return ""


HELP = {
    "schedule": "faults: each fault once, checks after each; soak: workers killed every "
    "--kill-every-s for --duration-s, the Redis once",
    "faults": f"comma-separated, in order, of: {', '.join(faults.FAULTS)}; all = every one "
    "this fleet has",
    "workers": "CPU workers in the local cluster",
    "redis": "local = the cluster's own redis-server (kvswitch up --redis local); external = a "
    "redis-server this run starts beside the cluster; none = the router's embedded index",
    "concurrency": "requests kept running at once (a closed loop)",
    "max_tokens": "greedy tokens per request",
    "timeout_s": "each request's deadline, all its retries included",
    "max_retries": "the client's retries of a request that failed before its first token",
    "warmup_s": "seconds of load before the first fault",
    "settle_s": "seconds of load after a fault's recovery, before the checks",
    "stall_s": "worker-stall: seconds between SIGSTOP and SIGCONT (more than --timeout-s)",
    "redis_down_s": "redis-outage: seconds the Redis stays down",
    "partition_s": "partition: seconds a worker's packets are dropped",
    "duration_s": "soak: seconds of load",
    "kill_every_s": "soak: seconds between two worker kills",
    "rss_window_s": "soak: memory must be flat over this last stretch of the run",
    "rss_every_s": "seconds between two memory samples of each process",
    "progress_every_s": "soak: seconds between two progress lines on stderr",
    "seed": "random seed of the prompts and of the order they are sent in",
    "log_dir": "keep every process's log here; empty = a temporary folder, removed at the end",
}


def run(config: ChaosConfig, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start the cluster, run the schedule, check what held; the summary."""
    run_started_s = time.monotonic()

    def progress(line: str) -> None:
        text = f"[{time.monotonic() - run_started_s:6.1f} s] {line}"
        (say or (lambda text: print(text, file=sys.stderr, flush=True)))(text)

    log_dir = Path(config.log_dir) if config.log_dir else None
    with contextlib.ExitStack() as stack:
        external = stack.enter_context(LocalRedis()) if config.redis == "external" else None
        # ClusterConfig.redis: "local" (its own server), a URL, or "" (the embedded index).
        redis = (
            external.url if external is not None else {"local": "local", "none": ""}[config.redis]
        )
        cluster_config = ClusterConfig(workers=config.workers, port=0, redis=redis, grace_s=2.0)
        progress(f"starting {config.workers} workers and a router (redis: {config.redis})")
        cluster = stack.enter_context(
            LocalCluster(
                cluster_config,
                log_dir=log_dir,
                supervise=True,
                restart_policy=RestartPolicy(initial_backoff_s=1.0),
                say=progress,
            )
        )
        load = CheckedLoad(
            cluster.address,
            make_prompts(seed=config.seed),
            concurrency=config.concurrency,
            max_tokens=config.max_tokens,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            seed=config.seed,
        )
        load.take_references()
        sampler = RssSampler(
            lambda: process_pids(cluster, external), config.rss_every_s, kind_of=process_kind
        )
        sampler.start()
        stack.callback(sampler.stop)
        load.start()
        stack.callback(load.stop)
        progress(f"load running: {config.concurrency} requests at a time")
        injected: list[tuple[faults.FaultReport, dict[str, Any]]] = []
        error = ""
        try:
            if config.schedule == "faults":
                time.sleep(config.warmup_s)
                for name in config.fault_names():
                    time.sleep(config.settle_s)  # steady load again after the checks' pause
                    report = inject(name, cluster, config, external)
                    time.sleep(config.settle_s)
                    injected.append((report, quiet_checks(cluster, load)))
                    progress(f"{name}: {json.dumps(report.figures)}")
            else:
                soak(cluster, load, config, external, progress, injected)
        except (faults.FaultError, ClusterError) as e:
            # NOTE: the fleet did not get over a fault: say so, with what was measured so far.
            error = str(e)
            progress(f"stopping early: {error}")
        end_s = time.monotonic()
        final = quiet_checks(cluster, load, resume=False)
        outcomes = load.outcomes()
        memory = sampler.growth(since_s=end_s - config.rss_window_s)
        summary = {
            "config": dataclasses.asdict(config),
            "machine": machine(),
            "duration_s": round(end_s - run_started_s, 1),
            "skipped": {n: config.why_not(n) for n in config.fault_names(applicable_only=False)
                        if config.why_not(n)},
            "faults": [
                {**r.to_json(), "requests": tally(faults.during(outcomes, r)),
                 "max_wait_s": faults.max_wait_s(outcomes, r), **checks}
                for r, checks in injected
            ],
            "requests": tally(outcomes),
            "final": final,
            "memory": memory,
            "memory_timeline": sampler.timeline(run_started_s),
            "error": error,
        }  # fmt: skip
        summary["goals"] = goals(summary, config.schedule)
        progress("stopping the cluster")
    return summary


def inject(
    name: str, cluster: LocalCluster, config: ChaosConfig, external: LocalRedis | None
) -> faults.FaultReport:
    if name == "worker-kill":
        return faults.kill_worker(cluster, faults.busiest_worker(cluster))
    if name == "worker-stall":
        return faults.stall_worker(cluster, faults.busiest_worker(cluster), config.stall_s)
    if name == "redis-kill":
        return faults.kill_redis(cluster)
    if name == "redis-outage":
        return faults.redis_outage(cluster, config.redis_down_s, external)
    if name in ("router-restart", "router-kill"):
        return faults.restart_router(cluster, kill=name == "router-kill")
    if name == "partition":
        return faults.partition_worker(cluster, faults.busiest_worker(cluster), config.partition_s)
    raise ValueError(f"unknown fault {name!r}")


def soak(
    cluster: LocalCluster,
    load: CheckedLoad,
    config: ChaosConfig,
    external: LocalRedis | None,
    progress: Callable[[str], None],
    injected: list[tuple[faults.FaultReport, dict[str, Any]]],
) -> None:
    """Workers killed in turn every ``kill_every_s``, the Redis once, each added to
    ``injected``; progress lines."""
    started_s = time.monotonic()
    end_s = started_s + config.duration_s
    events: list[tuple[float, str]] = []
    at_s = started_s + config.kill_every_s
    while at_s < end_s:
        events.append((at_s, "worker-kill"))
        at_s += config.kill_every_s
    if config.redis != "none":
        redis_fault = "redis-kill" if config.redis == "local" else "redis-outage"
        events.append((started_s + SOAK_REDIS_AT * config.duration_s, redis_fault))
    events.sort()
    num_kills = 0

    def run_fault(name: str) -> None:
        nonlocal num_kills
        if name == "worker-kill":
            victim = cluster.workers[num_kills % len(cluster.workers)]
            num_kills += 1
            report = faults.kill_worker(cluster, victim)
        else:
            report = inject(name, cluster, config, external)
        injected.append((report, {}))
        progress(f"{name} {report.target}: {json.dumps(report.figures)}")

    next_progress_s = started_s + config.progress_every_s
    while (now_s := time.monotonic()) < end_s:
        if events and events[0][0] <= now_s:
            run_fault(events.pop(0)[1])
        elif now_s >= next_progress_s:
            counts = tally(load.outcomes())
            progress(
                f"{counts['num_requests']} requests: {counts['num_exact']} exact, "
                f"{counts['num_not_exact']} not, {counts['num_failed']} failed"
            )
            next_progress_s += config.progress_every_s
        else:
            next_s = min([end_s, next_progress_s, *(t for t, _ in events[:1])])
            time.sleep(max(min(next_s - now_s, 0.5), 0.0))
    # NOTE: each fault waits for the one before to be over (a killed worker back), so on a slow
    # machine the kills can run past the Redis fault's time, even past the end: it happens then.
    for _, name in events:
        if name != "worker-kill":
            run_fault(name)


def quiet_checks(
    cluster: LocalCluster, load: CheckedLoad, *, resume: bool = True
) -> dict[str, Any]:
    """With the load paused: each worker's leaked blocks, and whether the index agrees with
    the workers; then the load resumes, unless ``resume`` is False."""
    load.pause()
    try:
        leaks = {w.name: leaked_blocks(w.address) for w in cluster.workers if w.is_ready}
        seconds, check = wait_for_index(
            cluster.index_url, lambda: faults.registered_workers(cluster), timeout_s=15.0
        )
    finally:
        if resume:
            load.resume()
    return {
        "leaked_blocks": leaks,
        "index_clean": seconds is not None,
        "index": check.to_json() if check is not None else None,
    }


def process_pids(cluster: LocalCluster, external: LocalRedis | None) -> dict[str, int]:
    """Name -> pid of every process of the fleet that runs now."""
    pids: dict[str, int] = {}
    for child in [cluster.router, *cluster.workers]:
        if child is None or child.popen is None or child.returncode is not None:
            continue
        pids[child.name] = child.popen.pid
        core = engine_core_pid(child.popen.pid) if child is not cluster.router else None
        if core is not None:
            pids[f"{child.name}/core"] = core
    redis = external or cluster.redis
    with contextlib.suppress(RuntimeError):  # between a stop and a start
        if redis is not None:
            pids["redis"] = redis.pid
    return pids


def process_kind(name: str) -> str:
    """Which program a name of ``process_pids`` runs: ``worker-3/core`` -> ``worker/core``."""
    return re.sub(r"^worker-\d+", "worker", name)


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": model}


# -- the command ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """One ``--option`` per ``ChaosConfig`` field, its default the field's, and ``--json``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvswitch.loadtest.chaos",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for config_field in dataclasses.fields(ChaosConfig):
        parser.add_argument(
            "--" + config_field.name.replace("_", "-"),
            type=type(config_field.default),
            default=config_field.default,
            help=f"{HELP[config_field.name]} (default: %(default)s)",
        )
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the summary here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    json_path = args.pop("json")
    try:
        config = ChaosConfig(**args)
    except ValueError as e:
        parser.error(str(e))
    wants_partition = config.schedule == "faults" and "partition" in config.fault_names()
    if wants_partition and not faults.private_network():
        # NOTE: tc changes the loopback of the whole network namespace: take one of our own.
        command = [sys.executable, "-m", "kvswitch.loadtest.chaos", *argv]
        return faults.run_in_own_network(command).returncode
    summary = run(config)
    text = json.dumps(summary, indent=2, sort_keys=True)
    print(text)
    if json_path is not None:
        json_path.write_text(text + "\n")
    return 0 if all(goal["held"] for goal in summary["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
