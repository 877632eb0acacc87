"""What a fault run checks on a live fleet from outside its processes.

- ``rss_bytes`` / ``RssSampler``: each process's resident memory over time (``VmRSS`` in
  ``/proc/PID/status``), by name, and how much each incarnation grew once warmed up.
- ``leaked_blocks``: a quiet worker's KV blocks not back in its free queue (its ``GetLoad``: an
  idle worker has every block free, cached ones included, unless a request leaked some).
- ``wait_for_index``: how long until every worker is registered with the index and the index
  agrees with each worker's own cache (``cache_index.audit``: nothing stale, nothing missing).
- ``log_times``: when a process logged a line (its ``ts`` field), to time what it noticed.
"""

from __future__ import annotations

import asyncio
import calendar
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvswitch.v1 import worker_pb2, worker_pb2_grpc

MIB = 1 << 20
SETTLED_FRACTION = 0.99  # of its elders' RSS, for a restarted process to count as filled up


# -- memory --------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """The process's resident set, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def engine_core_pid(pid: int) -> int | None:
    """The worker ``pid``'s engine core: its child started by multiprocessing's spawn."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                return child
    return None


@dataclass
class _Incarnation:
    """One process under one name: a name gets a new incarnation when its pid changes."""

    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, bytes)


class RssSampler:
    """Samples the RSS of named processes every ``every_s`` on a thread of its own.

    ``pids()`` says which process each name is now (a restarted worker is a new pid under its
    old name). ``kind_of(name)`` says which names run the same program (``worker-3/core`` and
    ``worker-0/core``): a restarted process is judged once it has grown to its elders' size, so
    a worker still filling its KV cache after a restart is not taken for a leak."""

    def __init__(
        self,
        pids: Callable[[], Mapping[str, int]],
        every_s: float = 1.0,
        kind_of: Callable[[str], str] = lambda name: name,
    ) -> None:
        self._pids = pids
        self._every_s = every_s
        self._kind_of = kind_of
        self._by_name: dict[str, list[_Incarnation]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def sample(self) -> None:
        now_s = time.monotonic()
        for name, pid in self._pids().items():
            size = rss_bytes(pid)
            if size is not None:
                self.record(name, pid, now_s, size)

    def record(self, name: str, pid: int, at_s: float, size: int) -> None:
        """One sample: ``name`` is process ``pid``, of ``size`` bytes at monotonic ``at_s``."""
        incarnations = self._by_name.setdefault(name, [])
        if not incarnations or incarnations[-1].pid != pid:
            incarnations.append(_Incarnation(pid))
        incarnations[-1].samples.append((at_s, size))

    def latest_mib(self) -> dict[str, float]:
        return {
            name: round(incarnations[-1].samples[-1][1] / MIB, 1)
            for name, incarnations in self._by_name.items()
        }

    def growth(self, since_s: float, warmup_s: float = 20.0) -> dict[str, list[dict[str, Any]]]:
        """Per name, each incarnation that lived past ``warmup_s`` after ``since_s`` (and after
        its own start): its RSS once warmed up, at its last sample and at most, in MiB, and its
        growth in MiB per minute (least squares over those samples). A restarted process (a
        name's later incarnation) is warmed up only once it reached ``SETTLED_FRACTION`` of the
        most its kind's elders had: until then it is still filling up, and is left out."""
        report: dict[str, list[dict[str, Any]]] = {}
        for name, incarnations in sorted(self._by_name.items()):
            for restarted, incarnation in enumerate(incarnations):
                start_s = max(since_s, incarnation.samples[0][0] + warmup_s)
                settled_s = self._settled_s(name, incarnation) if restarted else start_s
                if settled_s is None:
                    continue
                start_s = max(start_s, settled_s)
                samples = [(t, b) for t, b in incarnation.samples if t >= start_s]
                if len(samples) < 3:
                    continue
                report.setdefault(name, []).append(
                    {
                        "pid": incarnation.pid,
                        "seconds": round(samples[-1][0] - samples[0][0], 1),
                        "first_mib": round(samples[0][1] / MIB, 1),
                        "last_mib": round(samples[-1][1] / MIB, 1),
                        "max_mib": round(max(b for _, b in samples) / MIB, 1),
                        "mib_per_min": round(_slope(samples) * 60 / MIB, 3),
                    }
                )
        return report

    def _settled_s(self, name: str, incarnation: _Incarnation) -> float | None:
        """When ``incarnation`` first reached the size of its kind's elders (those sampled
        before it started), or None if it never did; its start if it has none."""
        born_s = incarnation.samples[0][0]
        kind = self._kind_of(name)
        elders_max = max(
            (
                size
                for other_name, others in self._by_name.items()
                if self._kind_of(other_name) == kind
                for other in others
                if other is not incarnation and other.samples[0][0] < born_s
                for _, size in other.samples
            ),
            default=None,
        )
        if elders_max is None:
            return born_s
        return next(
            (t for t, size in incarnation.samples if size >= SETTLED_FRACTION * elders_max), None
        )

    def timeline(self, origin_s: float, every_s: float = 30.0) -> dict[str, list[list[float]]]:
        """Per name, ``[seconds since origin_s, MiB]`` about every ``every_s``, and at the first
        sample of each incarnation (a restart shows as a new start)."""
        report: dict[str, list[list[float]]] = {}
        for name, incarnations in sorted(self._by_name.items()):
            points = report.setdefault(name, [])
            for incarnation in incarnations:
                last_s = -math.inf
                for t, size in incarnation.samples:
                    if t - last_s >= every_s:
                        points.append([round(t - origin_s, 1), round(size / MIB, 1)])
                        last_s = t
        return report

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()


def _slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of bytes over seconds."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_b = sum(b for _, b in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (b - mean_b) for t, b in samples) / var


# -- blocks ------------------------------------------------------------------------------------


def worker_load(address: str, timeout_s: float = 5.0) -> worker_pb2.WorkerLoad:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=timeout_s
        )


def leaked_blocks(address: str, timeout_s: float = 15.0) -> int:
    """Blocks a quiet worker does not get back: those not free once it runs nothing. Waits up to
    ``timeout_s`` for its last requests to end (a worker cut off finds its streams gone only
    when its connections fail)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        load = worker_load(address)
        idle = load.num_running_requests == 0 and load.num_waiting_requests == 0
        num_leaked = load.num_total_blocks - load.num_free_blocks
        if (idle and num_leaked == 0) or time.monotonic() > deadline_s:
            return num_leaked
        time.sleep(0.05)


def num_running(address: str) -> int:
    return worker_load(address).num_running_requests


# -- the index ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexCheck:
    """The index against the workers, at one moment."""

    registered: dict[str, bool]  # worker id -> live in the index at its current address
    num_stale: int
    num_missing: int
    num_entries: int  # blocks the index lists for the audited workers
    errors: list[str]  # workers that could not be asked for their snapshot

    @property
    def clean(self) -> bool:
        return (
            all(self.registered.values())
            and self.num_stale == 0
            and self.num_missing == 0
            and not self.errors
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "registered": self.registered,
            "num_stale": self.num_stale,
            "num_missing": self.num_missing,
            "num_entries": self.num_entries,
            "errors": self.errors,
        }


async def check_index(index: Any, workers: Mapping[str, str]) -> IndexCheck:
    """``workers`` (id -> address) registered in ``index``, and its audit."""
    from kvswitch.cache_index.audit import audit

    live = {info.worker_id: info.address for info in await index.live_workers()}
    audits = [a for a in await audit(index) if a.worker_id in workers]
    return IndexCheck(
        registered={w: live.get(w) == address for w, address in workers.items()},
        num_stale=sum(a.num_stale for a in audits),
        num_missing=sum(a.num_missing for a in audits),
        num_entries=sum(a.num_in_index for a in audits),
        errors=[f"{a.worker_id}: {a.error}" for a in audits if a.error],
    )


def wait_for_index(
    index_url: str,
    workers: Callable[[], Mapping[str, str]],
    timeout_s: float = 30.0,
    every_s: float = 0.1,
) -> tuple[float | None, IndexCheck | None]:
    """Seconds until the index is clean for ``workers()`` (None if it never was within
    ``timeout_s``), and the last check. An index that cannot be reached counts as not clean."""
    from kvswitch.cache_index.connect import connect_index

    async def wait() -> tuple[float | None, IndexCheck | None]:
        started_s = time.monotonic()
        last: IndexCheck | None = None
        index = None
        try:
            while time.monotonic() - started_s < timeout_s:
                try:
                    if index is None:
                        index = await connect_index(index_url)
                    last = await check_index(index, workers())
                    if last.clean:
                        return time.monotonic() - started_s, last
                except (ConnectionError, OSError, TimeoutError, grpc.aio.AioRpcError) as e:
                    last = IndexCheck({}, 0, 0, 0, [f"index: {e}"])
                except Exception as e:  # the Redis client's own errors
                    if index is None or not isinstance(e, index.unavailable_errors):
                        raise
                    last = IndexCheck({}, 0, 0, 0, [f"index: {e}"])
                await asyncio.sleep(every_s)
            return None, last
        finally:
            if index is not None:
                await index.close()

    return asyncio.run(wait())


# -- logs --------------------------------------------------------------------------------------

_TS = re.compile(r'(?:^ts=|"ts": ")(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})Z')


def log_times(path: Path, text: str, since_wall_s: float = 0.0) -> list[float]:
    """``time.time()`` of each line of the log at ``path`` that contains ``text``, from
    ``since_wall_s`` on (the key=value and the JSON log formats both)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    times = []
    for line in lines:
        if text not in line:
            continue
        match = _TS.search(line)
        if match is None:
            continue
        seconds = calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S"))
        wall_s = seconds + int(match.group(2)) / 1000
        if wall_s >= since_wall_s:
            times.append(wall_s)
    return times
