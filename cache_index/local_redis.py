"""Start and stop local ``redis-server`` processes: for ``kvswitch up --redis local``, the index
benchmark and the tests. Each server listens on 127.0.0.1 on a free port, keeps nothing on disk
and is killed on ``stop()``."""

from __future__ import annotations

import random
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path


class RedisNotInstalled(RuntimeError):
    """No redis-server executable on PATH."""


def free_port(*, with_bus: bool = False) -> int:
    """A port nobody listens on. ``with_bus``: also port + 10000 (a cluster node's bus port)."""
    if not with_bus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(100):
        port = random.randint(20000, 55000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("found no free port pair for a cluster node")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nobody listens on: ``free_port`` asked again may hand out a port it
    just did (of 128 asked one after another, two were the same in 2 of 5 tries)."""
    ports: dict[int, None] = {}
    while len(ports) < n:
        ports[free_port()] = None
    return list(ports)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class LocalRedis:
    """One redis-server process. ``password`` turns on AUTH; ``cluster`` makes it a cluster node;
    ``tls`` serves TLS only, with a self-signed certificate made at start (needs ``openssl``)."""

    def __init__(
        self,
        *,
        port: int = 0,
        password: str | None = None,
        cluster: bool = False,
        tls: bool = False,
    ) -> None:
        self.port = port or free_port(with_bus=cluster)
        self.password = password
        self.cluster = cluster
        self.tls = tls
        self._dir: tempfile.TemporaryDirectory | None = None
        self._process: subprocess.Popen | None = None

    @property
    def cert_path(self) -> Path:
        """The TLS server's self-signed certificate, which is also its CA."""
        if self._dir is None:
            raise RuntimeError("the server is not running")
        return Path(self._dir.name) / "cert.pem"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}?ssl_ca_certs={self.cert_path}"
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the server is not running")
        return self._process.pid

    @property
    def exited(self) -> bool:
        """It was started and has died since."""
        return self._process is not None and self._process.poll() is not None

    def restart(self, timeout_s: float = 10.0) -> LocalRedis:
        """A new, empty server on the same port (a restarted Redis without persistence)."""
        self.stop()
        return self.start(timeout_s, _port_checked=True)

    def start(self, timeout_s: float = 10.0, *, _port_checked: bool = False) -> LocalRedis:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RedisNotInstalled(
                "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)"
            )
        # NOTE: a restart skips the check: the old server's closed connections may still hold
        # the port in TIME_WAIT, which redis-server itself (SO_REUSEADDR) does not mind.
        if not _port_checked and not _is_free(self.port):
            raise RuntimeError(f"port {self.port} is already in use")
        self._dir = tempfile.TemporaryDirectory(prefix="kvswitch-redis-")
        log_path = Path(self._dir.name) / "redis.log"
        # fmt: off
        args = [
            executable, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--dir", self._dir.name, "--logfile", str(log_path),
        ]
        # fmt: on
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            self._make_certificate()
            cert = str(self.cert_path)
            args[args.index("--port") + 1] = "0"  # plain TCP off
            # fmt: off
            args += [
                "--tls-port", str(self.port), "--tls-cert-file", cert,
                "--tls-key-file", str(Path(self._dir.name) / "key.pem"),
                "--tls-ca-cert-file", cert, "--tls-auth-clients", "no",
            ]
            # fmt: on
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(Path(self._dir.name) / "nodes.conf"),
            ]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self._process.poll() is not None:
                log = log_path.read_text(errors="replace") if log_path.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server exited: {log.strip()[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.02)
        return self

    def _make_certificate(self) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RedisNotInstalled("a TLS redis-server needs openssl to make its certificate")
        # fmt: off
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(self.cert_path.with_name("key.pem")), "-out", str(self.cert_path),
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )
        # fmt: on

    def ping(self) -> bool:
        """Whether the server answers PING (a raw RESP exchange, no client library needed)."""
        try:
            with self._connect() as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _connect(self) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        if not self.tls:
            return raw
        context = ssl.create_default_context(cafile=str(self.cert_path))
        return context.wrap_socket(raw, server_hostname="127.0.0.1")

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalRedisCluster:
    """``num_nodes`` masters (no replicas) joined into one cluster with ``redis-cli``."""

    def __init__(self, num_nodes: int = 3) -> None:
        if num_nodes < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        self.nodes = [LocalRedis(cluster=True) for _ in range(num_nodes)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 20.0) -> LocalRedisCluster:
        redis_cli = shutil.which("redis-cli")
        if redis_cli is None:
            raise RedisNotInstalled("redis-cli is not installed (it comes with redis-server)")
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                [
                    redis_cli,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            deadline = time.monotonic() + timeout_s
            while not all(self._cluster_ok(redis_cli, node) for node in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the local Redis Cluster never reached cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _cluster_ok(redis_cli: str, node: LocalRedis) -> bool:
        info = subprocess.run(
            [redis_cli, "-p", str(node.port), "cluster", "info"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        return "cluster_state:ok" in info

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
