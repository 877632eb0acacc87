"""``kvswitch bench engines``: routing a fleet of OpenAI-API engines against routing the same
fleet as kvswitch workers.

Two fleets of ``--num-engines`` CPU workers of the built-in model, each with a cache of
``--kv-cache-blocks`` blocks, as processes, one after the other:

- engines: each worker serves its own OpenAI API (``--http-port``) and publishes vLLM's KV events
  (``--kv-events-config``); a router in engine mode follows the events and forwards requests to
  the workers' HTTP APIs; the load test speaks to the router's HTTP API (docs/ENGINES.md);
- workers: the same workers registered with a router over gRPC; the load test speaks gRPC.

Each runs ``kvswitch loadtest``'s ``long_document_qa`` once per policy (``cost``, then
``round_robin``, each with its own cache salt). Reported per fleet and policy: the share of
prompt tokens served from cache and the time to the first token.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvswitch.benchmarks.timing import machine_info
from kvswitch.cache_index.local_redis import free_port

BLOCK_BYTES = 32 << 10  # the built-in model's KV, one 16-token block
MODEL = "kvswitch-tiny"


@dataclass(frozen=True)
class EnginesBenchConfig:
    num_engines: int = 4
    kv_cache_blocks: int = 256  # per engine: with the defaults, the documents just fit the fleet
    documents: int = 16
    document_len: int = 1024  # tokens
    questions: int = 4  # per document
    concurrency: int = 4  # sessions at a time
    policies: str = "cost,round_robin"

    def __post_init__(self) -> None:
        for name in ("num_engines", "kv_cache_blocks", "documents", "questions", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.document_len < 16:
            raise ValueError(f"document_len must be at least 16, got {self.document_len}")


def run(config: EnginesBenchConfig) -> dict[str, Any]:
    fleets = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvswitch-engines-") as folder,
        _engine_fleet(config, folder) as target,
    ):
        fleets["engines"] = _load_test(config, target)
    with _worker_fleet(config) as target:
        fleets["workers"] = _load_test(config, target)
    return {"config": asdict(config), "machine": machine_info(), "fleets": fleets}


def _load_test(config: EnginesBenchConfig, target: str) -> dict[str, Any]:
    """``kvswitch loadtest`` against ``target``, as a process of its own (as a user runs it)."""
    workload_args = (
        f"documents={config.documents},questions={config.questions},"
        f"document_len={config.document_len}"
    )
    command = [sys.executable, "-m", "kvswitch.app.cli", "loadtest", "--target", target]
    command += ["--workload", "long_document_qa", "--workload-args", workload_args]
    command += ["--policies", config.policies, "--concurrency", str(config.concurrency)]
    command += ["--no-progress", "--json", "-"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kvswitch loadtest failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    return {
        policy: {
            "completed": figures["completed"],
            "failed": figures["failed"],
            "token_hit_rate": figures["token_hit_rate"],
            "ttft_ms": figures["ttft_ms"],
        }
        for policy, figures in report["policies"].items()
    }


def _worker_args(config: EnginesBenchConfig) -> list[str]:
    kv_cache_bytes = config.kv_cache_blocks * BLOCK_BYTES
    return ["worker", "--port", "0", "--cpu-threads", "1", "--kv-cache-bytes", str(kv_cache_bytes)]


@contextlib.contextmanager
def _engine_fleet(config: EnginesBenchConfig, folder: str) -> Iterator[str]:
    """Engines behind a router in engine mode; yields the router's HTTP API's URL."""
    from kvswitch.serving import start_server_process

    processes: list[subprocess.Popen] = []
    router_args = ["router", "--port", "0", "--namespace", MODEL]
    try:
        for i in range(config.num_engines):
            http_port = free_port()
            events, replay = f"ipc://{folder}/e{i}-events", f"ipc://{folder}/e{i}-replay"
            kv_events = {
                "enable_kv_cache_events": True,
                "endpoint": events,
                "replay_endpoint": replay,
            }
            worker_args = [*_worker_args(config), "--http-port", str(http_port)]
            worker_args += ["--kv-events-config", json.dumps(kv_events)]
            processes.append(start_server_process(worker_args)[0])
            router_args += ["--engine", f"e{i}=http://127.0.0.1:{http_port}"]
            router_args += [
                "--engine-events",
                f"e{i}={events}",
                "--engine-replay",
                f"e{i}={replay}",
            ]
        http_port = free_port()
        processes.append(start_server_process([*router_args, "--http-port", str(http_port)])[0])
        yield f"http://127.0.0.1:{http_port}"
    finally:
        _stop(processes)


@contextlib.contextmanager
def _worker_fleet(config: EnginesBenchConfig) -> Iterator[str]:
    """The same workers registered with a router over gRPC; yields the router's address."""
    from kvswitch.serving import start_server_process

    processes: list[subprocess.Popen] = []
    try:
        router, address = start_server_process(["router", "--port", "0"])
        processes.append(router)
        for _ in range(config.num_engines):
            worker_args = [*_worker_args(config), "--index", f"grpc://{address}"]
            processes.append(start_server_process(worker_args)[0])
        yield address
    finally:
        _stop(processes)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
