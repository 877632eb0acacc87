"""Faults injected into a local cluster of real processes (``deploy.local.LocalCluster``), and
how long the fleet took to get over each::

    worker-kill     SIGKILL to the busiest worker; the cluster's supervisor starts it again
                    timed: restarted, registered again
    worker-stall    SIGSTOP to a busy worker and its engine core for stall_s, then SIGCONT
                    timed: left out by the router, serving again
    redis-kill      SIGKILL to --redis local's server; the supervisor starts a new, empty one
                    timed: back, index rebuilt
    redis-outage    the index's redis-server down for down_s, then a new, empty one
                    timed: index rebuilt
    router-restart  SIGTERM to the router (it finishes its requests), started on its port again
                    timed: serving, routing to every worker
    router-kill     the same with SIGKILL: the streams it relays break
    partition       every packet to or from a busy worker's port dropped for partition_s
                    timed: left out by the router, serving again

Each returns a ``FaultReport``: when the fault began and the fleet had recovered (the window whose
requests count against the fault: ``during``; the longest a client waited in it: ``max_wait_s``),
and the figures above in seconds. ``partition`` changes the
loopback's traffic control (``tc``): it needs root and a network namespace of the run's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.deploy.local import LocalCluster
from kvswitch.deploy.processes import Child
from kvswitch.loadtest.checked_load import Outcome
from kvswitch.loadtest.fleet_checks import log_times, num_running, wait_for_index

FAULTS = (
    "worker-kill",
    "worker-stall",
    "redis-kill",
    "redis-outage",
    "router-restart",
    "router-kill",
    "partition",
)
RECOVERY_TIMEOUT_S = 60.0
# What the router logs when a worker stops and starts answering its load polls again.
LEFT_OUT = "stopped answering its load polls"
ANSWERS_AGAIN = "answers its load polls again"
OWN_NETWORK_ENV = "KVSWITCH_OWN_NETWORK_NAMESPACE"


@dataclass
class FaultReport:
    fault: str
    target: str  # the process it hit
    started_s: float  # time.monotonic() at the injection
    ended_s: float = 0.0  # once the fleet had got over it
    figures: dict[str, Any] = field(default_factory=dict)  # seconds, from the injection

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "target": self.target, **self.figures}


class FaultError(RuntimeError):
    """The fleet did not get over a fault within ``RECOVERY_TIMEOUT_S``."""


def during(outcomes: list[Outcome], report: FaultReport) -> list[Outcome]:
    """The requests that were running at some moment between the injection and the recovery."""
    return [o for o in outcomes if o.sent_s <= report.ended_s and o.done_s >= report.started_s]


def max_wait_s(outcomes: list[Outcome], report: FaultReport) -> float:
    """The longest a client waited for a message, among waits that overlapped the fault."""
    waits = [
        o.max_gap_s
        for o in outcomes
        if o.max_gap_from_s <= report.ended_s and o.max_gap_from_s + o.max_gap_s >= report.started_s
    ]
    return round(max(waits, default=0.0), 3)


def busiest_worker(cluster: LocalCluster) -> Child:
    """The worker running the most requests now (its ``GetLoad``); the first on a tie."""
    ready = [w for w in cluster.workers if w.is_ready]
    return max(ready, key=lambda w: num_running(w.address))


def registered_workers(cluster: LocalCluster) -> dict[str, str]:
    """Id -> address of the workers that are up, as the index should list them."""
    return {w.name: w.address for w in cluster.workers if w.is_ready}


def kill_worker(cluster: LocalCluster, victim: Child) -> FaultReport:
    """SIGKILL, no goodbye to the router or the index; the supervisor starts it again."""
    report = FaultReport("worker-kill", victim.name, time.monotonic())
    old_address = victim.address
    assert victim.popen is not None
    victim.popen.kill()
    _wait(lambda: victim.is_ready and victim.address != old_address, f"{victim.name} restarted")
    report.figures["restarted_after_s"] = _since(report.started_s)
    _wait_registered(cluster, victim)
    report.figures["registered_after_s"] = _since(report.started_s)
    report.ended_s = time.monotonic()
    return report


def stall_worker(cluster: LocalCluster, victim: Child, stall_s: float) -> FaultReport:
    """SIGSTOP to the worker's process group (its serving process and its engine core) for
    ``stall_s``, then SIGCONT: a frozen host, from which no error ever comes."""
    assert victim.popen is not None
    return _out_of_reach(
        cluster, victim, "worker-stall", _stopped(victim.popen.pid), stall_s, "stall", "resume"
    )


@contextlib.contextmanager
def _stopped(process_group: int) -> Iterator[None]:
    os.killpg(process_group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(process_group, signal.SIGCONT)


def _out_of_reach(
    cluster: LocalCluster,
    victim: Child,
    kind: str,
    cut: contextlib.AbstractContextManager,
    cut_s: float,
    what: str,
    healed: str,
) -> FaultReport:
    """``victim`` out of reach while ``cut`` holds, for ``cut_s`` (figure ``<what>_s``): when
    the router left it out (from its log), and how soon after the cut ends it serves again
    (``serving_again_after_<healed>_s``)."""
    report = FaultReport(kind, victim.name, time.monotonic())
    cut_wall_s = time.time()
    with cut:
        time.sleep(cut_s)
    healed_s, healed_wall_s = time.monotonic(), time.time()
    report.figures[f"{what}_s"] = cut_s
    report.figures["left_out_after_s"] = _logged_after(
        cluster, f"worker {victim.name} {LEFT_OUT}", cut_wall_s
    )
    _wait_serving(cluster, victim, healed_wall_s)
    report.figures[f"serving_again_after_{healed}_s"] = _since(healed_s)
    report.ended_s = time.monotonic()
    return report


def kill_redis(cluster: LocalCluster) -> FaultReport:
    """SIGKILL to the cluster's own redis-server; its supervisor starts a new, empty one."""
    redis = cluster.redis
    assert redis is not None, "redis-kill needs --redis local"
    report = FaultReport("redis-kill", "redis", time.monotonic())
    os.kill(redis.pid, signal.SIGKILL)
    time.sleep(0.05)  # NOTE: else the ping below may reach the dying server
    _wait(redis.ping, "redis-server restarted", every_s=0.01)
    report.figures["restarted_after_s"] = back_s = _since(report.started_s)
    _wait_rebuilt(cluster, report, back_s)
    return report


def redis_outage(cluster: LocalCluster, down_s: float, redis: LocalRedis | None) -> FaultReport:
    """The index's redis-server down for ``down_s``, then a new, empty one on its port:
    ``redis`` (an external server) or, when None, the cluster's own."""
    report = FaultReport("redis-outage", "redis", time.monotonic())
    outage = cluster.redis_outage() if redis is None else _external_outage(redis)
    with outage:
        time.sleep(down_s)
    report.figures["down_s"] = back_s = _since(report.started_s)
    _wait_rebuilt(cluster, report, back_s)
    return report


@contextlib.contextmanager
def _external_outage(redis: LocalRedis) -> Iterator[None]:
    redis.stop()
    try:
        yield
    finally:
        redis.restart()


def restart_router(cluster: LocalCluster, *, kill: bool) -> FaultReport:
    """SIGTERM (or SIGKILL) to the router, which starts again on its own port."""
    report = FaultReport("router-kill" if kill else "router-restart", "router", time.monotonic())
    cluster.restart_router(kill=kill)
    report.figures["serving_after_s"] = _since(report.started_s)
    cluster.wait_for_registration(timeout_s=RECOVERY_TIMEOUT_S)
    report.figures["routing_to_all_after_s"] = _since(report.started_s)
    report.ended_s = time.monotonic()
    return report


def partition_worker(cluster: LocalCluster, victim: Child, partition_s: float) -> FaultReport:
    """Every packet to or from the worker's port dropped for ``partition_s``: the worker runs
    on, and reaches the index, but the router's calls to it go unanswered, without an error."""
    cut = dropped_port(int(victim.address.rsplit(":", 1)[1]))
    return _out_of_reach(cluster, victim, "partition", cut, partition_s, "partition", "heal")


@contextlib.contextmanager
def dropped_port(port: int) -> Iterator[None]:
    """Every IPv4 packet to or from ``port`` on the loopback dropped while the block runs: an
    HTB class for it whose queue holds nothing. Needs root; changes the loopback of the whole
    network namespace, so run it in one of its own (``unshare --net``)."""
    _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1")
    try:
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit")
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:2", "htb", "rate", "8bit")
        _tc("qdisc", "add", "dev", "lo", "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
        for direction in ("dport", "sport"):
            _tc(
                "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", direction, str(port), "0xffff", "flowid", "1:2",
            )  # fmt: skip
        yield
    finally:
        _tc("qdisc", "del", "dev", "lo", "root")


def private_network() -> bool:
    """Whether this process runs in a network namespace of its own: one ``run_in_own_network``
    made (it says so in ``OWN_NETWORK_ENV``), or one that is not PID 1's."""
    if os.environ.get(OWN_NETWORK_ENV) == "1":
        return True
    try:
        return os.stat("/proc/self/ns/net").st_ino != os.stat("/proc/1/ns/net").st_ino
    except OSError:  # PID 1's namespace may be hidden from us
        return False


def run_in_own_network(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``command`` in a new network namespace (``unshare --net``, root) whose loopback is
    up; ``kwargs`` go to ``subprocess.run``."""
    script = 'ip link set lo up && exec "$@"'
    env = {**os.environ, OWN_NETWORK_ENV: "1"}
    return subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", script, "sh", *command], env=env, **kwargs
    )


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


# -- waiting ---------------------------------------------------------------------------------------


def _since(started_s: float) -> float:
    return round(time.monotonic() - started_s, 3)


def _wait(done: Callable[[], bool], what: str, every_s: float = 0.05) -> None:
    deadline_s = time.monotonic() + RECOVERY_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline_s:
            raise FaultError(f"not {what} within {RECOVERY_TIMEOUT_S:.0f} s")
        time.sleep(every_s)


def _wait_registered(cluster: LocalCluster, victim: Child) -> None:
    seconds, check = wait_for_index(
        cluster.index_url, lambda: {victim.name: victim.address}, RECOVERY_TIMEOUT_S
    )
    if seconds is None:
        raise FaultError(f"{victim.name} not back in the index: {check}")


def _wait_serving(cluster: LocalCluster, victim: Child, since_wall_s: float) -> None:
    """Until the router polls the worker's load again (or, its registration having lapsed
    meanwhile, takes it in anew) and the index lists it."""
    router_log = cluster.log_dir / "router.log"

    def back() -> bool:
        return any(
            log_times(router_log, text, since_wall_s)
            for text in (f"worker {victim.name} {ANSWERS_AGAIN}", f"worker {victim.name} joined")
        )

    _wait(back, f"{victim.name} answering the router again")
    _wait_registered(cluster, victim)


def _wait_rebuilt(cluster: LocalCluster, report: FaultReport, back_s: float) -> None:
    """Until every worker is registered again and the index agrees with their caches."""
    seconds, check = wait_for_index(
        cluster.index_url, lambda: registered_workers(cluster), RECOVERY_TIMEOUT_S
    )
    if seconds is None:
        raise FaultError(f"the index was not rebuilt within {RECOVERY_TIMEOUT_S:.0f} s: {check}")
    report.figures["index_rebuilt_after_back_s"] = round(_since(report.started_s) - back_s, 3)
    report.ended_s = time.monotonic()


def _logged_after(cluster: LocalCluster, text: str, since_wall_s: float) -> float | None:
    """Seconds from ``since_wall_s`` to the router's first log line with ``text`` after it."""
    times = log_times(cluster.log_dir / "router.log", text, since_wall_s)
    return round(times[0] - since_wall_s, 3) if times else None
