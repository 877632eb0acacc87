"""Child processes of a local cluster: each says where it listens on a line of its stdout, and
one that dies is started again after a backoff.

A ``Child`` is launched without waiting; ``wait_ready`` blocks until its "listening on ADDRESS"
line (or its death). ``RestartPolicy`` says how long to wait before each restart::

    death 1 -> 1 s -> death 2 -> 2 s -> ... -> 30 s, 30 s, ...   (up a minute: back to 1 s)
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from kvswitch.serving import READY_MARK

LOG_TAIL_BYTES = 2000  # of a child's log, quoted when it fails to start
EXIT_WAIT_S = 5.0  # a child whose output ended has this long to exit before it counts as hung


class ChildError(RuntimeError):
    """A child failed to start."""


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    # NOTE: short: a killed worker is back in the time its start takes, plus this.
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 30.0
    healthy_s: float = 60.0  # a child up this long starts its backoff over when it dies

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                "backoffs must satisfy 0 < initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s}, {self.max_backoff_s}"
            )
        if self.healthy_s <= 0:
            raise ValueError(f"healthy_s must be positive, got {self.healthy_s}")

    def backoff_s(self, num_failures: int) -> float:
        """The wait before the restart that follows the ``num_failures``-th death in a row."""
        return min(self.initial_backoff_s * 2 ** (num_failures - 1), self.max_backoff_s)


class Child:
    """One child process, started again by ``launch`` after it dies.

    Its stderr goes to ``log_path`` (appended to across restarts), or to ours when None.
    """

    def __init__(
        self, name: str, argv: list[str], *, env: dict[str, str] | None, log_path: Path | None
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.popen: subprocess.Popen | None = None
        self.address = ""  # set when the current run says where it listens
        self.started_s = 0.0
        self.num_failures = 0  # deaths in a row, for the backoff
        self.num_restarts = 0
        self.restart_at_s: float | None = None  # dead, to be started again then
        self._ready = threading.Event()

    def launch(self) -> None:
        """Start it (again); returns at once."""
        log: IO | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        self.address = ""
        self._ready = threading.Event()
        self.popen = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=log,
            env=self.env,
            text=True,
            start_new_session=True,  # Ctrl-C in a terminal reaches only the parent
        )
        if log is not None:
            log.close()
        self.started_s = time.monotonic()
        threading.Thread(
            target=self._read_stdout, args=(self.popen, self._ready), daemon=True
        ).start()

    def _read_stdout(self, popen: subprocess.Popen, ready: threading.Event) -> None:
        # NOTE: read to the end, so that the child never blocks on a full pipe.
        assert popen.stdout is not None
        for line in popen.stdout:
            if not ready.is_set() and READY_MARK in line:
                self.address = line.split(READY_MARK, 1)[1].strip()
                ready.set()
        ready.set()  # it exited, maybe without saying

    @property
    def is_ready(self) -> bool:
        """Running, and it said where it listens."""
        return bool(self.address) and self.returncode is None

    @property
    def returncode(self) -> int | None:
        """None while it runs (or was never launched)."""
        return None if self.popen is None else self.popen.poll()

    def wait_ready(self, timeout_s: float) -> str:
        """Its address, once it says; ``ChildError`` (with its log's tail) if it dies or is silent
        for ``timeout_s``."""
        said = self._ready.wait(timeout_s)
        if self.address and self.returncode is None:
            return self.address
        if said and not self.address and self.popen is not None:
            # NOTE: its stdout ended: it is exiting, and its exit status may lag the pipe's end.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=EXIT_WAIT_S)
        why = "exited" if self.returncode is not None else f"did not start in {timeout_s:.0f} s"
        self.kill()
        raise ChildError(f"{self.name} {why}{self.log_tail()}")

    def log_tail(self) -> str:
        if self.log_path is None:
            return " (its log, above, says why)"  # its output went to this terminal
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, 2)
                log.seek(max(log.tell() - LOG_TAIL_BYTES, 0))
                tail = log.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"; the end of its log:\n{tail}" if tail else "; its log is empty"

    def terminate(self) -> None:
        if self.returncode is None and self.popen is not None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.returncode is None and self.popen is not None:
            self.popen.kill()
            self.popen.wait()

    def wait(self, timeout_s: float) -> None:
        """Until it exits; SIGKILL after ``timeout_s``."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
