"""A router and its workers in this process, on one event-loop thread, over real gRPC.

Workers publish to the router's embedded index through ``grpc://ROUTER``, as in ``kvswitch up``;
tests talk to the router with the blocking client SDK and reach into the servers for checks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from kvswitch.cache_index.index import ROLES
from kvswitch.router.server import RouterConfig, RouterServer, start_router
from kvswitch.worker.server import WorkerConfig, WorkerServer, start_worker

T = TypeVar("T")

BLOCK_SIZE = 16
BLOCK_BYTES = 32 << 10  # one 16-token block of the built-in model in fp32
WORKER_CONFIG = WorkerConfig(port=0, kv_cache_bytes=256 * BLOCK_BYTES, grace_s=0.0)
ROUTER_CONFIG = RouterConfig(
    port=0, refresh_s=0.05, load_poll_s=0.05, grace_s=0.0, wait_for_worker_s=0.3
)


def _task_stacks(loop: asyncio.AbstractEventLoop) -> str:
    """Each task of ``loop`` and the chain of awaits it is waiting in, innermost last."""
    lines = []
    for task in asyncio.all_tasks(loop):
        lines.append(f"{task.get_name()}:")
        awaiting: Any = task.get_coro()
        while awaiting is not None:
            frame = getattr(awaiting, "cr_frame", None) or getattr(awaiting, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
            else:
                lines.append(f"  {awaiting!r}")
            awaiting = getattr(awaiting, "cr_await", None) or getattr(
                awaiting, "gi_yieldfrom", None
            )
    return "\n".join(lines)


@contextlib.contextmanager
def paused_core(worker: WorkerServer) -> Iterator[None]:
    """The worker's engine core stopped (SIGSTOP) until the block ends: its serving process
    still takes calls and answers load polls, but nothing it submits runs, so a test can hold
    requests at a known point (a prefill not finished, a pull not started)."""
    pid = worker.engine.pid
    assert pid is not None, "the engine core runs on a thread: nothing to stop"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds; TimeoutError naming ``what`` after ``timeout_s`` (a
    bound for a hang, far above any wait a working run makes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"never: {what}")
        time.sleep(0.01)


class BackgroundCluster:
    def __init__(
        self,
        num_workers: int = 2,
        router_config: RouterConfig = ROUTER_CONFIG,
        worker_config: WorkerConfig = WORKER_CONFIG,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.router: RouterServer = self.run(start_router(router_config))
        embedded = router_config.index.startswith("memory://")
        self.worker_config = dataclasses.replace(
            worker_config,
            index=f"grpc://{self.router.address}" if embedded else router_config.index,
        )
        self.workers: list[WorkerServer] = []
        for i in range(num_workers):
            self.add_worker(f"w{i}")

    @property
    def address(self) -> str:
        return self.router.address

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            # NOTE: a hang is a bug somewhere; say where every task of the loop is waiting.
            raise TimeoutError(
                f"{coro.__qualname__} did not finish in {timeout_s} s; the loop's tasks:\n"
                + _task_stacks(self._loop)
            ) from None

    def add_worker(self, worker_id: str, role: str = "both", **config: Any) -> WorkerServer:
        config = dataclasses.replace(self.worker_config, worker_id=worker_id, role=role, **config)
        worker = self.run(start_worker(config))
        self.workers.append(worker)
        self.wait_for_workers()
        return worker

    def stop_worker(self, worker: WorkerServer) -> None:
        """Stop at once: running requests are cancelled, as if the worker died."""
        self.run(worker.server.stop(0))
        self.run(worker.stop(0))
        self.workers.remove(worker)

    def wait_for_workers(self, timeout_s: float = 10.0) -> None:
        """Until the router routes to exactly the running workers."""
        wanted = {w.worker_id for w in self.workers}
        deadline = time.monotonic() + timeout_s
        directory = self.router.router.directory
        while {h.worker_id for h in directory.routable(roles=ROLES)} != wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router never saw workers {sorted(wanted)}")
            time.sleep(0.02)

    def worker(self, worker_id: str) -> WorkerServer:
        return next(w for w in self.workers if w.worker_id == worker_id)

    def __enter__(self) -> BackgroundCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for worker in list(self.workers):
            self.run(worker.stop(0))
        self.run(self.router.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
