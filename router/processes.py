"""``kvswitch router --processes N``: N whole routers on one port, serving as one, kept running.

Each process is a full router (its own event loop, gRPC server, HTTP front and load polls),
bound with SO_REUSEPORT to the same ``--port`` and ``--http-port``: the kernel spreads clients'
connections over them. They share the index (a Redis) and tell each other what they route over
its pub/sub (``router/replicas.py``), so a burst split among them is routed as one router would.
Process ``i`` serves metrics on ``--metrics-port + i``.

The parent starts them, says the router is ready once every one is, starts again one that dies
(it rejoins the others and takes their guesses as it starts) and stops them all on SIGINT or
SIGTERM, each with ``--grace-s`` for its running requests.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import time
from typing import TYPE_CHECKING, Any

from kvswitch.logs import LogSettings, configure_logging, log_settings
from kvswitch.router.forwarded import new_front_key
from kvswitch.serving import announce_ready, run_event_loop, wait_for_stop_signal

if TYPE_CHECKING:
    from kvswitch.router.server import RouterConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # for every process to serve
RESTART_DELAY_S = 1.0  # before a process that died is started again
KILL_AFTER_S = 5.0  # past the grace period, a process that has not stopped is killed


def process_config(config: RouterConfig, i: int) -> RouterConfig:
    """What process ``i`` of ``config.processes`` runs: one router on the shared ports."""
    return dataclasses.replace(
        config,
        processes=1,
        reuse_port=True,
        metrics_port=config.metrics_port + i if config.metrics_port >= 0 else -1,
    )


def _process_main(
    config: RouterConfig, front_key: str, settings: LogSettings, i: int, ready: Any
) -> None:
    # NOTE: a group of its own: a terminal's Ctrl-C reaches the parent alone, which stops each
    # process once (a second signal would cut a process's graceful stop short).
    os.setpgrp()
    configure_logging(
        settings.level, settings.json, (*settings.process_fields, ("router_process", str(i)))
    )
    run_event_loop(_serve(config, front_key, ready, i))


async def _serve(config: RouterConfig, front_key: str, ready: Any, i: int) -> None:
    from kvswitch.router.server import RouterStartError, start_router

    try:
        router = await start_router(config, front_key=front_key)
    except RouterStartError as e:
        ready.put((i, None, str(e)))
        return
    ready.put((i, router.address, ""))
    await wait_for_stop_signal()
    await router.stop(config.grace_s)


class RouterProcesses:
    """The processes of one router: started, watched, restarted, stopped."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._context = multiprocessing.get_context("spawn")
        self._front_key = new_front_key()
        self._ready: Any = self._context.Queue()
        self._processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.num_restarts = 0

    def start(self) -> str:
        """Start every process and wait until each serves; its address. RuntimeError (the
        processes stopped) if one cannot start."""
        for i in range(self.config.processes):
            self._start(i)
        address = ""
        waiting = set(self._processes)
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while waiting:
            try:
                i, address_i, error = self._ready.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i in waiting if not self._processes[i].is_alive()]
                if dead or time.monotonic() > deadline_s:
                    self.stop()
                    raise RuntimeError(
                        f"router process {dead[0]} exited while starting"
                        if dead
                        else f"the router processes did not serve within {START_TIMEOUT_S:.0f} s"
                    ) from None
                continue
            if error:
                self.stop()
                raise RuntimeError(f"router process {i}: {error}")
            waiting.discard(i)
            address = address_i
        return address

    def _start(self, i: int) -> None:
        process = self._context.Process(
            target=_process_main,
            args=(process_config(self.config, i), self._front_key, log_settings(), i, self._ready),
            name=f"router-{i}",
        )
        process.start()
        self._processes[i] = process

    def watch(self, stop: Any) -> None:
        """Until ``stop()`` is true: start again any process that dies."""
        while not stop():
            sentinels = {p.sentinel: i for i, p in self._processes.items()}
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.2):
                i = sentinels[sentinel]  # type: ignore[index]
                if stop():
                    return
                logger.warning(
                    "router process %d exited (code %s); starting it again",
                    i,
                    self._processes[i].exitcode,
                )
                time.sleep(RESTART_DELAY_S)
                self._start(i)
                self.num_restarts += 1
            self._drain_ready()

    def _drain_ready(self) -> None:
        """Log what restarted processes say as they serve (or fail to)."""
        while True:
            try:
                i, _, error = self._ready.get_nowait()
            except queue.Empty:
                return
            if error:
                logger.error("router process %d cannot start: %s", i, error)
            else:
                logger.info("router process %d serves again", i)

    def stop(self) -> None:
        """SIGTERM to each process; those still running past the grace period are killed."""
        for process in self._processes.values():
            if process.is_alive():
                process.terminate()
        deadline_s = time.monotonic() + self.config.grace_s + KILL_AFTER_S
        for process in self._processes.values():
            process.join(max(deadline_s - time.monotonic(), 0))
            if process.is_alive():
                process.kill()
                process.join()


def run(config: RouterConfig) -> None:
    """Serve with ``config.processes`` router processes until SIGINT or SIGTERM."""
    processes = RouterProcesses(config)
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    address = processes.start()
    logger.info("router serving on %s from %d processes", address, config.processes)
    announce_ready("router", address)
    processes.watch(lambda: stopping)
    logger.info("shutting down: %.1f s for running requests to finish", config.grace_s)
    processes.stop()
