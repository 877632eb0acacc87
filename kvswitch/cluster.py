"""``kvswitch up``: a local cluster in the foreground — N workers and a router, as processes.

The router starts first; by default it holds the embedded block index and serves it to the
workers on its own port (``--index grpc://ROUTER``). With ``--redis local`` the cluster starts a
redis-server of its own (a free port, nothing on disk) and everyone uses it; with
``--redis redis://...`` it uses that one. Every process it started is stopped on Ctrl-C or
SIGTERM (SIGTERM first, so workers leave the index and finish what they can), and if any of them
dies, the cluster stops with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kvswitch.cache_index.local_redis import LocalRedis

_KVSWITCH = (sys.executable, "-m", "kvswitch.cli")
STARTUP_TIMEOUT_S = 120.0  # a worker loads its model before it prints its address
READY_MARK = "listening on "


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    workers: int = 2
    port: int = 50051  # the router's; 0 = a free port
    redis: str = ""  # empty = the router's embedded index; "local" = start one; or a URL
    model: str = ""  # checkpoint directory for every worker; empty = the built-in tiny model
    device: str = "cpu"  # cpu, or cuda: worker i gets GPU i mod the number of GPUs
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20  # per worker
    policy: str = "cost"
    host: str = "127.0.0.1"
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be in [1, 64], got {self.workers}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.redis not in ("", "local") and "://" not in self.redis:
            raise ValueError(f"redis must be empty, 'local' or a redis:// URL, got {self.redis!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or died."""


@dataclasses.dataclass
class _Process:
    name: str
    popen: subprocess.Popen
    address: str = ""


class LocalCluster:
    """Starts and stops the processes; ``with LocalCluster(config) as cluster: cluster.address``.

    Each process's log goes to ``log_dir/NAME.log`` (a temporary folder unless given), or to
    this process's stderr with ``inherit_logs``.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        log_dir: Path | None = None,
        inherit_logs: bool = False,
        extra_worker_args: tuple[str, ...] = (),
        worker_command: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self._own_log_dir = log_dir is None and not inherit_logs
        self.log_dir = Path(tempfile.mkdtemp(prefix="kvswitch-")) if log_dir is None else log_dir
        self._inherit_logs = inherit_logs
        self._extra_worker_args = extra_worker_args
        # How to run ``kvswitch worker ...``; tests put a wrapper here.
        self._worker_command = worker_command or _KVSWITCH
        self._redis: LocalRedis | None = None
        self.router: _Process | None = None
        self.workers: list[_Process] = []
        self.extra_routers: list[_Process] = []
        self.index_url = ""

    @property
    def address(self) -> str:
        """Where clients connect: the router's host:port."""
        assert self.router is not None, "start the cluster first"
        return self.router.address

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        config = self.config
        router_index = "memory://"
        if config.redis == "local":
            self._redis = LocalRedis()
            self._redis.start()
            router_index = self.index_url = self._redis.url
        elif config.redis:
            router_index = self.index_url = config.redis
        self.router = self._spawn("router", self._router_args(router_index, config.port))
        if not self.index_url:
            self.index_url = f"grpc://{self.router.address}"
        for i in range(config.workers):
            args = [
                "worker",
                "--host", config.host,
                "--port", "0",
                "--worker-id", f"worker-{i}",
                "--index", self.index_url,
                "--model", config.model,
                "--device", config.device,
                "--dtype", config.dtype,
                "--block-size", str(config.block_size),
                "--kv-cache-bytes", str(config.kv_cache_bytes),
                *self._extra_worker_args,
            ]  # fmt: skip
            self.workers.append(
                self._spawn(
                    f"worker-{i}", args, env=self._worker_env(i), command=self._worker_command
                )
            )

    def add_router(self) -> str:
        """Start one more router on a free port, sharing the cluster's Redis index; returns its
        address. Routers share nothing but the index, so the embedded one cannot be shared."""
        if self.index_url.startswith("grpc://"):
            raise ClusterError("several routers need a Redis index: start the cluster with redis")
        name = f"router-{len(self.extra_routers) + 1}"
        router = self._spawn(name, self._router_args(self.index_url, 0))
        self.extra_routers.append(router)
        return router.address

    def _router_args(self, index_url: str, port: int) -> list[str]:
        config = self.config
        return [
            "router",
            "--host", config.host,
            "--port", str(port),
            "--index", index_url,
            "--model", config.model,
            "--policy", config.policy,
        ]  # fmt: skip

    def stop(self) -> None:
        """SIGTERM every process, wait for them to finish, SIGKILL the stragglers."""
        processes = [*self.workers, *self.extra_routers, *([self.router] if self.router else [])]
        for process in processes:
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_s + 10.0
        for process in processes:
            try:
                process.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        self.workers = []
        self.extra_routers = []
        self.router = None
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def wait_for_registration(self, timeout_s: float = 60.0) -> None:
        """Block until every worker has registered with the index (after loading its model)."""
        import asyncio

        from kvswitch.cache_index.connect import connect_index

        async def count_workers() -> int:
            index = await connect_index(self.index_url)
            try:
                return len(await index.live_workers())
            finally:
                await index.close()

        deadline = time.monotonic() + timeout_s
        while (num_live := asyncio.run(count_workers())) < len(self.workers):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {num_live} of {len(self.workers)} workers registered in {timeout_s} s"
                )
            time.sleep(0.1)
        # The router re-reads the live workers every quarter second.
        time.sleep(0.3)

    def dead_processes(self) -> list[str]:
        processes = [*self.workers, *self.extra_routers, *([self.router] if self.router else [])]
        return [p.name for p in processes if p.popen.poll() is not None]

    # -- helpers -----------------------------------------------------------------------------

    def _worker_env(self, i: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.device == "cuda":
            num_gpus = _num_gpus()
            if num_gpus > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(i % num_gpus)
        return env

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        command: tuple[str, ...] = (),
    ) -> _Process:
        """Start ``kvswitch ARGS`` and wait for the line that says where it listens."""
        log: IO | None = None
        if not self._inherit_logs:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (lives with the child)
        popen = subprocess.Popen(
            [*(command or _KVSWITCH), *args],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop the children
        )
        if log is not None:
            log.close()
        process = _Process(name, popen)
        process.address = _read_address(popen, name, self._log_hint(name))
        return process

    def _log_hint(self, name: str) -> str:
        return "" if self._inherit_logs else f"; its log: {self.log_dir / f'{name}.log'}"


def _read_address(popen: subprocess.Popen, name: str, log_hint: str) -> str:
    """The address in the child's "listening on" line. A thread reads its stdout to the end, so
    the child never blocks on a full pipe."""
    assert popen.stdout is not None
    stdout = popen.stdout
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in stdout:
            if not ready.is_set() and READY_MARK in line:
                found.append(line.split(READY_MARK, 1)[1].strip())
                ready.set()
        ready.set()  # it exited without saying

    threading.Thread(target=read, daemon=True).start()
    ready.wait(STARTUP_TIMEOUT_S)
    if not found:
        popen.kill()
        why = "exited" if popen.poll() is not None else "did not start in time"
        raise ClusterError(f"{name} {why}{log_hint}")
    return found[0]


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def run(config: ClusterConfig) -> None:
    """Run the cluster until Ctrl-C or SIGTERM, or until one of its processes dies."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting {config.workers} workers and a router ...", file=sys.stderr, flush=True)
    with LocalCluster(config, inherit_logs=True) as cluster:
        print(
            f"kvswitch cluster up: router at {cluster.address}, index {cluster.index_url}, "
            f"workers {', '.join(w.address for w in cluster.workers)}",
            flush=True,
        )
        print(
            f"try: kvswitch generate --target {cluster.address} --prompt 'Hello'",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):
            dead = cluster.dead_processes()
            if dead:
                print(f"kvswitch up: {', '.join(dead)} exited; stopping", file=sys.stderr)
                break
        print("stopping the cluster ...", file=sys.stderr, flush=True)
    print("stopped", file=sys.stderr, flush=True)


@contextlib.contextmanager
def running(config: ClusterConfig, **kwargs: object) -> Iterator[LocalCluster]:
    """A started cluster whose workers the router already sees."""
    with LocalCluster(config, **kwargs) as cluster:  # type: ignore[arg-type]
        cluster.wait_for_registration()
        yield cluster
