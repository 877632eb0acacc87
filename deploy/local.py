"""``kvswitch up``: a local cluster in the foreground — N workers and a router, as processes.

The router starts first; by default it holds the embedded block index and serves it to the
workers on its own port (the index ``grpc://ROUTER``, as ``kvswitch up`` prints it). With
``--redis local`` the cluster starts a redis-server of its own (a free port, nothing on disk) and
everyone uses it; with ``--redis redis://...`` it uses that one. The cluster is up once every
worker has joined and the router routes to all of them.

It outlives its members: a worker that dies is started again after a backoff (0.25 s, doubling to
30 s, back to 0.25 s after a healthy minute) while the router serves on the others, and a local
redis-server that dies is started again on the same port, empty, for the workers to resync. Only
the router's death, Ctrl-C or SIGTERM stops the cluster; then the workers get SIGTERM (so they
leave the index and finish what they can), then the routers, each SIGKILL after the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvswitch.cache_index.connect import split_password
from kvswitch.cache_index.local_redis import LocalRedis
from kvswitch.deploy.processes import Child, ChildError, RestartPolicy
from kvswitch.router.disagg import TRANSPORTS
from kvswitch.security import INDEX_PASSWORD_ENV
from kvswitch.serving import host_port
from kvswitch.worker.engine_config import lora_paths

_KVSWITCH = (sys.executable, "-m", "kvswitch.app.cli")
STARTUP_TIMEOUT_S = 120.0  # a worker loads its model before it prints its address
SUPERVISE_EVERY_S = 0.2
ROUTER_REFRESH_S = 0.25  # RouterConfig.refresh_s: how often the router re-reads the workers


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    workers: int = -1  # of role both; -1 = 2, or none when prefill or decode workers are asked for
    prefill_workers: int = 0  # of role prefill (disaggregated prefill, docs/DISAGGREGATION.md)
    decode_workers: int = 0  # of role decode
    port: int = 50051  # the router's; 0 = a free port
    redis: str = ""  # empty = the router's embedded index; "local" = start one; or a URL
    model: str = ""  # checkpoint directory for every worker; empty = the built-in tiny model
    device: str = "cpu"  # cpu, or cuda: worker i gets GPU i mod the number of GPUs
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20  # per worker
    kv_cache_shm: bool = False  # CPU: KV caches in /dev/shm, blocks copied straight between them
    max_num_seqs: int = 64  # per worker: most requests computed together in one step
    # CUDA: every worker replays its steps from CUDA graphs; None: the workers' default (on CUDA).
    cuda_graphs: bool | None = None
    # LoRA adapters every worker serves, each NAME=PATH (the workers' --lora); max_loras: the
    # workers' --max-loras.
    lora: tuple[str, ...] = ()
    max_loras: int = 4
    # The workers make their slots without a lora too (--enable-lora), and the router's HTTP API
    # loads adapters on them at run time (--lora-updates; it needs http_port).
    enable_lora: bool = False
    lora_updates: bool = False
    # The workers keep their blocks' final hidden states (--cache-hidden-states: prompt logprobs
    # and embeddings of a cached prefix from the cache).
    cache_hidden_states: bool = False
    policy: str = "cost"
    kv_transport: str = "auto"  # disaggregated prefill: how KV blocks travel (the router's)
    host: str = "127.0.0.1"
    http_port: int = -1  # the router's OpenAI-compatible HTTP API; -1 = none, 0 = a free port
    # Prometheus /metrics: the router on this port, worker i (in --workers, --prefill-workers,
    # --decode-workers order) on the i+1-th after it; -1 = none, 0 = a free port each.
    metrics_port: int = -1
    grace_s: float = 5.0
    # Every process listens beyond loopback without the fleet token or mutual TLS (and the HTTP
    # API without keys): passed on as --insecure. On 127.0.0.1 none is needed.
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {', '.join(t for t in TRANSPORTS if t)}, got "
                f"{self.kv_transport!r}"
            )
        for name in ("prefill_workers", "decode_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        num_workers = len(self.worker_roles())
        if self.workers < -1 or not 1 <= num_workers <= 64:
            if not (self.prefill_workers or self.decode_workers):
                raise ValueError(f"workers must be in [1, 64], got {self.workers}")
            raise ValueError(f"a cluster has 1 to 64 workers in all, not {num_workers}")
        if all(role == "prefill" for _, role in self.worker_roles()):
            raise ValueError(
                "prefill workers need a worker to decode: add --decode-workers or --workers"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be -1 or in [0, 65535], got {self.http_port}")
        last_metrics_port = self.metrics_port + (self.metrics_port > 0) * num_workers
        if not -1 <= self.metrics_port <= last_metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be -1, 0 or a port with {num_workers} more after it (one "
                f"per worker), got {self.metrics_port}"
            )
        if self.redis not in ("", "local") and "://" not in self.redis:
            raise ValueError(f"redis must be empty, 'local' or a redis:// URL, got {self.redis!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.kv_cache_shm and self.device != "cpu":
            raise ValueError("kv_cache_shm is for CPU workers: use it with device cpu")
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError("cuda_graphs is for GPU workers: use it with device cuda")
        lora_paths(self.lora)  # a malformed spec is refused before any process starts
        if self.max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if self.lora_updates and self.http_port < 0:
            raise ValueError("lora_updates is served by the router's HTTP API: give --http-port")
        if self.lora_updates and not (self.lora or self.enable_lora):
            raise ValueError(
                "lora_updates loads adapters into the workers' slots: give --enable-lora or "
                "a --lora"
            )

    def metrics_port_of(self, name: str) -> int:
        """The /metrics port of the process ``name`` ("router" or a worker's); -1 = none."""
        if self.metrics_port <= 0:
            return self.metrics_port
        if name == "router":
            return self.metrics_port
        names = [worker_name for worker_name, _ in self.worker_roles()]
        return self.metrics_port + 1 + names.index(name)

    def worker_roles(self) -> list[tuple[str, str]]:
        """(name, role) of each worker to start."""
        asked_for_roles = self.prefill_workers or self.decode_workers
        num_both = (0 if asked_for_roles else 2) if self.workers < 0 else self.workers
        return [
            *((f"worker-{i}", "both") for i in range(num_both)),
            *((f"prefill-{i}", "prefill") for i in range(self.prefill_workers)),
            *((f"decode-{i}", "decode") for i in range(self.decode_workers)),
        ]


class ClusterError(RuntimeError):
    """A process of the cluster failed to start, or the router died."""


class LocalCluster:
    """Starts, supervises and stops the processes: ``with LocalCluster(config) as cluster:``.

    ``start()`` returns once the cluster is ready. With ``supervise`` a background thread restarts
    workers (and a local redis-server) that die; ``wait()`` blocks until the router dies.
    Each process's log goes to ``log_dir/NAME.log`` (a temporary folder, removed on ``stop``,
    unless given), or to this process's stderr with ``inherit_logs``.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        log_dir: Path | None = None,
        inherit_logs: bool = False,
        supervise: bool = False,
        restart_policy: RestartPolicy | None = None,
        extra_worker_args: tuple[str, ...] = (),
        worker_command: tuple[str, ...] = (),
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._own_log_dir = log_dir is None and not inherit_logs
        self.log_dir = Path(tempfile.mkdtemp(prefix="kvswitch-")) if self._own_log_dir else log_dir
        self._inherit_logs = inherit_logs
        self._supervise = supervise
        self._restart_policy = restart_policy or RestartPolicy()
        self._extra_worker_args = extra_worker_args
        # How to run ``kvswitch worker ...``; tests put a wrapper here.
        self._worker_command = worker_command or _KVSWITCH
        self._say = say or (lambda line: print(f"kvswitch up: {line}", file=sys.stderr, flush=True))
        self._redis: LocalRedis | None = None
        self.router: Child | None = None
        self.workers: list[Child] = []
        self.extra_routers: list[Child] = []
        self.index_url = ""
        self._router_index = ""  # what the router reads: the index URL, or memory://
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._restarting: set[str] = set()  # workers started again, not yet listening
        # Held while the router or the local redis-server is being restarted on purpose, so that
        # the supervisor does not take that death for a crash.
        self._router_lock = threading.Lock()
        self._redis_lock = threading.Lock()
        self.router_died = threading.Event()

    @property
    def redis(self) -> LocalRedis | None:
        """The cluster's own redis-server (``--redis local``)."""
        return self._redis

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
        """Start every process and return once the router routes to every worker."""
        config = self.config
        self._router_index = "memory://"
        if config.redis == "local":
            self._redis = LocalRedis()
            self._redis.start()
            self._router_index = self.index_url = self._redis.url
        elif config.redis:
            self._router_index = self.index_url = config.redis
        self.router = self._child("router", [*_KVSWITCH, *self._router_args(self._router_index)])
        self.router.launch()
        self._wait_ready(self.router)
        if not self.index_url:
            self.index_url = f"grpc://{self.router.address}"
        # NOTE: launched together, so the workers load their models in parallel.
        self.workers = [
            self._child(name, self._worker_argv(name, role), env=self._worker_env(i))
            for i, (name, role) in enumerate(config.worker_roles())
        ]
        for worker in self.workers:
            worker.launch()
        for worker in self.workers:
            self._wait_ready(worker)
        self.wait_for_registration()
        if self._supervise:
            self._supervisor = threading.Thread(
                target=self._supervise_forever, name="supervisor", daemon=True
            )
            self._supervisor.start()

    def add_router(self) -> str:
        """Start one more router on a free port, sharing the cluster's Redis index; returns its
        address. Routers share nothing but the index, so the embedded one cannot be shared."""
        if self.index_url.startswith("grpc://"):
            raise ClusterError("several routers need a Redis index: start the cluster with redis")
        name = f"router-{len(self.extra_routers) + 1}"
        args = self._router_args(self.index_url, port=0, http=False)
        router = self._child(name, [*_KVSWITCH, *args])
        router.launch()
        self.extra_routers.append(router)
        return self._wait_ready(router)

    def restart_router(self, *, kill: bool = False) -> str:
        """Stop the router and start it again on the same port; returns once it serves (its
        workers may not have joined it yet: ``wait_for_registration``). SIGTERM lets it finish
        its requests within ``grace_s``; ``kill`` is SIGKILL, which breaks them. An embedded
        index comes back empty, and the workers register with it again."""
        assert self.router is not None, "start the cluster first"
        port = int(self.router.address.rsplit(":", 1)[1])
        with self._router_lock:
            if kill:
                self.router.kill()
            else:
                self.router.terminate()
                self.router.wait(self.config.grace_s + 10.0)
            # NOTE: the same port: clients, and workers publishing to an embedded index, keep
            # their address for it.
            self.router.argv = [*_KVSWITCH, *self._router_args(self._router_index, port=port)]
            self.router.num_restarts += 1
            self.router.launch()
        return self._wait_ready(self.router)

    @contextlib.contextmanager
    def redis_outage(self) -> Iterator[None]:
        """The cluster's own redis-server (``--redis local``) killed for as long as the block
        runs, then started again, empty, on the same port: an outage of a chosen length, where
        the supervisor alone would restart it at once."""
        if self._redis is None:
            raise ClusterError("the cluster runs no redis-server of its own (--redis local)")
        with self._redis_lock:
            self._redis.stop()
        try:
            yield
        finally:
            with self._redis_lock:
                self._redis.restart()

    def wait(self) -> None:
        """Block until the router dies (supervised clusters only)."""
        self.router_died.wait()

    def stop(self) -> None:
        """SIGTERM every worker, then every router; wait for each to finish, SIGKILL the
        stragglers."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        # NOTE: workers first, routers once they are gone: a stopping worker leaves the index,
        # and an embedded one stops with its router.
        routers = [*self.extra_routers, *([self.router] if self.router else [])]
        for processes in (self.workers, routers):
            for process in processes:
                process.terminate()
            deadline = time.monotonic() + self.config.grace_s + 10.0
            for process in processes:
                process.wait(deadline - time.monotonic())
        self.workers = []
        self.extra_routers = []
        self.router = None
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def wait_for_registration(self, timeout_s: float = 60.0) -> None:
        """Block until every worker is registered with the index and the router has read them."""
        from kvswitch.cache_index.connect import connect_index

        async def live_workers() -> dict[str, str]:
            index = await connect_index(self.index_url)
            try:
                return {info.worker_id: info.address for info in await index.live_workers()}
            finally:
                await index.close()

        deadline = time.monotonic() + timeout_s
        while True:
            wanted = {w.name: w.address for w in self.workers if w.is_ready}
            live = asyncio.run(live_workers())
            joined = [name for name, address in wanted.items() if live.get(name) == address]
            if len(joined) == len(self.workers):
                break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(joined)} of {len(self.workers)} workers registered in "
                    f"{timeout_s:.0f} s"
                )
            time.sleep(0.05)
        # NOTE: any refresh that starts from now on sees them all: wait out one whole period.
        time.sleep(2 * ROUTER_REFRESH_S)

    def dead_processes(self) -> list[str]:
        """Processes that are not running right now (a supervised worker may be restarting)."""
        processes = [*self.workers, *self.extra_routers, *([self.router] if self.router else [])]
        return [p.name for p in processes if p.returncode is not None]

    # -- supervision -------------------------------------------------------------------------

    def _supervise_forever(self) -> None:
        while not self._stopping.wait(SUPERVISE_EVERY_S):
            if self.supervise_once():
                return

    def supervise_once(self) -> bool:
        """Restart what died; True when the router died, which ends the cluster."""
        assert self.router is not None
        with self._router_lock:
            returncode = self.router.returncode
        if returncode is not None:
            self._say(f"the router exited with code {returncode}; stopping")
            self.router_died.set()
            return True
        with self._redis_lock:
            if self._redis is not None and self._redis.exited:
                self._say("redis-server exited; starting a new one on the same port")
                try:
                    self._redis.restart()
                except RuntimeError as e:
                    self._say(f"redis-server did not restart ({e}); trying again")
        now = time.monotonic()
        for worker in self.workers:
            self._supervise_worker(worker, now)
        return False

    def _supervise_worker(self, worker: Child, now: float) -> None:
        if worker.restart_at_s is not None:
            if now >= worker.restart_at_s:
                worker.restart_at_s = None
                worker.num_restarts += 1
                worker.launch()
            return
        returncode = worker.returncode
        if returncode is None:
            if worker.name in self._restarting and worker.is_ready:
                self._restarting.discard(worker.name)
                self._say(f"{worker.name} is back at {worker.address}")
            return
        if now - worker.started_s >= self._restart_policy.healthy_s:
            worker.num_failures = 0
        worker.num_failures += 1
        delay_s = self._restart_policy.backoff_s(worker.num_failures)
        worker.restart_at_s = now + delay_s
        self._restarting.add(worker.name)
        self._say(f"{worker.name} exited with code {returncode}; restarting it in {delay_s:g} s")

    # -- helpers -----------------------------------------------------------------------------

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = None if self._inherit_logs else self.log_dir / f"{name}.log"
        # NOTE: the index's password goes in the environment: a command line is for anyone on
        # the host to read (the arguments carry the URL without it).
        _, password = split_password(self._router_index)
        if password is not None:
            env = {**(os.environ if env is None else env), INDEX_PASSWORD_ENV: password}
        return Child(name, argv, env=env, log_path=log_path)

    def _wait_ready(self, child: Child) -> str:
        try:
            return child.wait_ready(STARTUP_TIMEOUT_S)
        except ChildError as e:
            raise ClusterError(str(e)) from None

    def _router_args(
        self, index_url: str, port: int | None = None, *, http: bool = True
    ) -> list[str]:
        """``http``: serve the HTTP API on ``http_port`` (the cluster's own router does)."""
        config = self.config
        return [
            "router",
            "--host", config.host,
            "--port", str(config.port if port is None else port),
            "--index", split_password(index_url)[0],
            "--model", config.model,
            "--policy", config.policy,
            "--kv-transport", config.kv_transport,
            *(["--http-port", str(config.http_port)] if http and config.http_port >= 0 else []),
            *(["--lora-updates"] if http and config.lora_updates else []),
            *(["--metrics-port", str(config.metrics_port_of("router"))] if http else []),
            *(["--insecure"] if config.insecure else []),
        ]  # fmt: skip

    def _worker_argv(self, name: str, role: str) -> list[str]:
        config = self.config
        return [
            *self._worker_command,
            "worker",
            "--host", config.host,
            "--port", "0",
            "--worker-id", name,
            "--role", role,
            "--index", split_password(self.index_url)[0],
            "--model", config.model,
            "--device", config.device,
            "--dtype", config.dtype,
            "--block-size", str(config.block_size),
            "--kv-cache-bytes", str(config.kv_cache_bytes),
            "--max-num-seqs", str(config.max_num_seqs),
            "--metrics-port", str(config.metrics_port_of(name)),
            *(["--kv-cache-shm"] if config.kv_cache_shm else []),
            *[arg for spec in config.lora for arg in ("--lora", spec)],
            *(["--enable-lora"] if config.enable_lora else []),
            *(["--cache-hidden-states"] if config.cache_hidden_states else []),
            *(["--max-loras", str(config.max_loras)] if config.lora or config.enable_lora else []),
            *({True: ["--cuda-graphs"], False: ["--no-cuda-graphs"]}.get(config.cuda_graphs, [])),
            *(["--cpu-threads", str(self._cpu_threads())] if config.device == "cpu" else []),
            *(["--insecure"] if config.insecure else []),
            *self._extra_worker_args,
        ]  # fmt: skip

    def _cpu_threads(self) -> int:
        """Each CPU worker's share of this machine's cores."""
        return max((os.cpu_count() or 1) // len(self.config.worker_roles()), 1)

    def _worker_env(self, i: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.device == "cuda":
            num_gpus = _num_gpus()
            if num_gpus > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(i % num_gpus)
        return env


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _describe_fleet(config: ClusterConfig) -> str:
    """ "2 workers", "1 prefill worker, 2 decode workers"."""
    roles = [role for _, role in config.worker_roles()]
    parts = []
    for role in dict.fromkeys(roles):
        n = roles.count(role)
        parts.append(f"{n} {'' if role == 'both' else role + ' '}worker{'s' if n > 1 else ''}")
    return ", ".join(parts)


def run(config: ClusterConfig) -> None:
    """Run the cluster until Ctrl-C or SIGTERM; ``ClusterError`` if the router dies first."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting {_describe_fleet(config)} and a router ...", file=sys.stderr, flush=True)
    with LocalCluster(config, inherit_logs=True, supervise=True) as cluster:
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
        if config.metrics_port > 0:
            last = config.metrics_port_of(config.worker_roles()[-1][0])
            print(
                f"metrics: router http://{host_port(config.host, config.metrics_port)}/metrics, "
                f"workers on ports {config.metrics_port + 1} to {last}",
                file=sys.stderr,
                flush=True,
            )
        if config.http_port > 0:
            print(
                f"or: curl http://{host_port(config.host, config.http_port)}/v1/models",
                file=sys.stderr,
                flush=True,
            )
        while not stop.wait(0.2) and not cluster.router_died.is_set():
            pass
        print("stopping the cluster ...", file=sys.stderr, flush=True)
    print("stopped", file=sys.stderr, flush=True)
    if not stop.is_set():
        raise ClusterError("the router died")


@contextlib.contextmanager
def running(config: ClusterConfig, **kwargs: object) -> Iterator[LocalCluster]:
    """A started cluster whose workers the router already sees."""
    with LocalCluster(config, **kwargs) as cluster:  # type: ignore[arg-type]
        yield cluster
