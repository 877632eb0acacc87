"""End to end with real processes on 127.0.0.1, as ``kvswitch up`` runs them: a router and CPU
workers (the built-in model), the embedded or a Redis index, requests through the client SDK."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kvswitch.app.cli import main
from kvswitch.app.demo import DemoConfig, document_questions
from kvswitch.client import Client, GenerateResult
from kvswitch.deploy.local import ClusterConfig, LocalCluster, running
from kvswitch.deploy.processes import RestartPolicy
from kvswitch.loadtest.faults import registered_workers
from kvswitch.loadtest.fleet_checks import leaked_blocks, wait_for_index
from kvswitch.tokenizer import ByteTokenizer
from kvswitch.v1 import worker_pb2, worker_pb2_grpc
from kvswitch.worker.engine import EngineConfig, LLMEngine
from tests.worker.background import engine_core_pids
from tests.worker.teacher_forcing import not_greedy

QUESTIONS = document_questions(DemoConfig(num_documents=3, questions_per_document=3))
NUM_DOCUMENTS = 3

RESTART_BOUND_S = 90  # a killed worker's supervisor has it back before this


def document_of(label: str) -> int:
    return int(label.split()[1])


def check_each_document_stayed_on_one_worker(results: list[tuple[str, GenerateResult]]) -> None:
    workers_by_document: dict[int, set[str]] = {}
    for label, result in results:
        workers_by_document.setdefault(document_of(label), set()).add(result.stats.worker_id)
    assert all(len(w) == 1 for w in workers_by_document.values()), workers_by_document
    # ... and later questions reused the document: all but the last partial block or so.
    for label, result in results:
        if not label.endswith("q1"):
            assert result.stats.num_cached_tokens > 0.9 * result.stats.num_prompt_tokens, label


@pytest.fixture(scope="module")
def embedded_cluster() -> Iterator[LocalCluster]:
    with running(ClusterConfig(workers=2, port=0, grace_s=1.0)) as cluster:
        yield cluster


def test_interleaved_questions_land_where_their_document_is(
    embedded_cluster: LocalCluster,
) -> None:
    with Client(embedded_cluster.address, timeout_s=60) as client:
        # The first question of each document, then the rest interleaved and concurrent.
        first = [(label, client.generate(p, max_tokens=2)) for label, p in QUESTIONS[:3]]
        with ThreadPoolExecutor(6) as pool:
            rest = list(
                zip(
                    [label for label, _ in QUESTIONS[3:]],
                    pool.map(lambda q: client.generate(q[1], max_tokens=2), QUESTIONS[3:]),
                    strict=True,
                )
            )
    check_each_document_stayed_on_one_worker(first + rest)
    assert len({r.stats.worker_id for _, r in first}) == 2  # new documents spread


def test_the_embedded_index_agrees_with_the_workers(
    embedded_cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvswitch index audit`` against the router's embedded index, after traffic."""
    with Client(embedded_cluster.address, timeout_s=60) as client:
        client.generate(QUESTIONS[0][1], max_tokens=2)
    time.sleep(0.3)  # the worker publishes its events every 20 ms
    assert main(["index", "audit", "--index", embedded_cluster.index_url]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert len(audit["workers"]) == 2
    assert audit["num_stale"] == 0 and audit["num_missing"] == 0
    assert sum(w["num_in_index"] for w in audit["workers"]) > 0


def test_two_routers_share_one_redis_index() -> None:
    with running(ClusterConfig(workers=2, port=0, redis="local", grace_s=1.0)) as cluster:
        second = cluster.add_router()
        cluster.wait_for_registration()
        routers = [Client(cluster.address, timeout_s=60), Client(second, timeout_s=60)]
        try:
            results = [
                (label, routers[i % 2].generate(prompt, max_tokens=2))
                for i, (label, prompt) in enumerate(QUESTIONS)
            ]
        finally:
            for client in routers:
                client.close()
    check_each_document_stayed_on_one_worker(results)
    # Both routers took part, each sending questions to documents the other had placed.
    assert {label for label, _ in results[1::2]} & {f"doc {d} q2" for d in (1, 2, 3)}


def busiest_worker(cluster: LocalCluster):
    """The worker running the most requests right now (asked over its own GetLoad)."""

    def num_running(address: str) -> int:
        with grpc.insecure_channel(address) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=5
            )
        return load.num_running_requests

    running_per_worker = [num_running(worker.address) for worker in cluster.workers]
    assert max(running_per_worker) > 0, "every request finished before the kill"
    return cluster.workers[running_per_worker.index(max(running_per_worker))]


@pytest.mark.parametrize("victim_part", ["serving process", "engine core"])
def test_a_worker_killed_mid_load_loses_no_request_and_comes_back(victim_part: str) -> None:
    prompts = [
        f"Request {i}: " + "tell me a long story about routers. " * (2 + i % 6) for i in range(32)
    ]
    # NOTE: long enough that the busiest worker's requests are still running when it is
    # killed, on a quiet machine too, after every request has started.
    max_tokens = 256
    engine = LLMEngine(EngineConfig())
    tokenizer = ByteTokenizer()
    encoded = [tokenizer.encode(p) for p in prompts]
    started = [threading.Event() for _ in prompts]
    received: list[list[int]] = [[] for _ in prompts]
    results: list[GenerateResult | None] = [None] * len(prompts)
    said: list[str] = []
    config = ClusterConfig(workers=3, port=0, grace_s=1.0)
    restarts = RestartPolicy(initial_backoff_s=0.5)

    with LocalCluster(config, supervise=True, restart_policy=restarts, say=said.append) as cluster:
        client = Client(cluster.address, timeout_s=120)

        def consume(i: int) -> None:
            stream = client.stream(prompts[i], max_tokens=max_tokens)
            for chunk in stream:
                received[i] += chunk.token_ids
                started[i].set()
            results[i] = stream.result

        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(consume, i) for i in range(len(prompts))]
            for event in started:
                assert event.wait(60)
            # NOTE: looked up first, so that the kill follows the load it is chosen by at once
            # (on a busy machine a worker's last requests may end meanwhile).
            cores = {w.name: engine_core_pids(w.popen.pid) for w in cluster.workers}
            victim = busiest_worker(cluster)
            old_address = victim.address
            if victim_part == "serving process":
                victim.popen.kill()  # SIGKILL: no goodbye to the router or the index
            else:
                # The worker fails its streams over and exits; its supervisor restarts it.
                (core_pid,) = cores[victim.name]
                os.kill(core_pid, signal.SIGKILL)
            killed_s = time.monotonic()
            # Back, under a new address, while the streams it held finish elsewhere.
            # NOTE: the bound only ends a wait that would never end: a worker's start (imports,
            # the model) took 10-12 s here alone on a slow day, and more beside other tests.
            while not (victim.is_ready and victim.address != old_address):
                assert time.monotonic() - killed_s < RESTART_BOUND_S, said
                time.sleep(0.05)
            cluster.wait_for_registration(timeout_s=RESTART_BOUND_S - (time.monotonic() - killed_s))
            for future in futures:
                future.result(timeout=120)

        # ... and the router sends it new work.
        new_prompts = [f"A new document {i}: " + "fresh words. " * 20 for i in range(6)]
        with ThreadPoolExecutor(len(new_prompts)) as pool:
            fresh = list(pool.map(lambda p: client.generate(p, max_tokens=24), new_prompts))
        client.close()
        # Quiet now: every worker has all its blocks back, and the index agrees with each.
        assert {w.name: leaked_blocks(w.address) for w in cluster.workers} == {
            w.name: 0 for w in cluster.workers
        }
        seconds, check = wait_for_index(cluster.index_url, lambda: registered_workers(cluster))
        assert seconds is not None, check

    # Every stream whole, its tokens greedy decoding: those before the kill the first worker's,
    # the rest the next one's after the prompt and the tokens sent. Where a stream parts from
    # the local engine's, the two took a near tie each their own way.
    assert [r.token_ids if r is not None else None for r in results] == received
    assert {
        i: not_greedy(engine, ids, out)
        for i, (ids, out) in enumerate(zip(encoded, received, strict=True))
    } == {i: [] for i in range(len(prompts))}
    moved = [r for r in results if r is not None and r.route.reason.startswith("failover")]
    assert moved, "no request was running on the killed worker"
    assert all(r.stats.worker_id != victim.name for r in moved)
    assert all(r.stats.num_output_tokens == max_tokens for r in results if r is not None)
    assert victim.name in {r.stats.worker_id for r in fresh}
    exit_code = -9 if victim_part == "serving process" else 1  # 1: it stopped, saying why
    assert f"{victim.name} exited with code {exit_code}; restarting it in 0.5 s" in said
    assert f"{victim.name} is back at {victim.address}" in said


def test_a_local_redis_that_dies_is_restarted_and_the_workers_resync(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said: list[str] = []
    config = ClusterConfig(workers=2, port=0, redis="local", grace_s=1.0)
    with LocalCluster(config, supervise=True, say=said.append) as cluster:
        with Client(cluster.address, timeout_s=60) as client:
            for _, prompt in QUESTIONS[:3]:
                client.generate(prompt, max_tokens=2)
            assert cluster.redis is not None
            os.kill(cluster.redis.pid, signal.SIGKILL)
            # Empty again: the workers register and resync their blocks from snapshots.
            cluster.wait_for_registration(timeout_s=30)
            deadline = time.monotonic() + 30
            while True:
                capsys.readouterr()
                assert main(["index", "audit", "--index", cluster.index_url]) == 0
                audit = json.loads(capsys.readouterr().out)
                if sum(w["num_in_index"] for w in audit["workers"]) > 0:
                    break
                assert time.monotonic() < deadline, audit
                time.sleep(0.2)
            assert audit["num_stale"] == 0 and audit["num_missing"] == 0
            # The second question of a document still goes where the document is cached.
            label, prompt = QUESTIONS[3]
            result = client.generate(prompt, max_tokens=2)
            assert result.stats.num_cached_tokens > 0.9 * result.stats.num_prompt_tokens, label
        assert "redis-server exited; starting a new one on the same port" in said

        cluster.router.popen.kill()  # the one death that ends the cluster
        assert cluster.router_died.wait(5)
    assert said[-1].startswith("the router exited with code -9")


def test_kvswitch_up_serves_until_sigterm_then_stops_everything() -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "kvswitch.app.cli", "up", "--workers", "2", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert line.startswith("kvswitch cluster up: router at "), line
        router_address = line.split("router at ", 1)[1].split(",", 1)[0]
        worker_addresses = line.rsplit("workers ", 1)[1].strip().split(", ")
        # Up means up: at once, new documents spread over both workers.
        prompts = [f"Document {i}: " + "words to prefill. " * 30 for i in range(4)]
        client = Client(router_address, timeout_s=60, max_retries=0)
        with client, ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=16), prompts))
        assert {r.stats.worker_id for r in results} == {"worker-0", "worker-1"}
        up.send_signal(signal.SIGTERM)
        # Its children stop on the SIGTERM it passes on, well before it would kill them (15 s).
        _, err = up.communicate(timeout=10)
        assert up.returncode == 0
    finally:
        if up.poll() is None:
            up.kill()
    # A clean stop is quiet: the workers leave the index while the router that holds it serves.
    assert "level=WARNING" not in err and "level=ERROR" not in err, err
    assert err.rstrip().endswith("stopped"), err
    for address in (router_address, *worker_addresses):
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()


def test_up_starts_prefill_and_decode_workers_that_split_long_prompts() -> None:
    config = ClusterConfig(
        prefill_workers=1, decode_workers=1, port=0, grace_s=1.0, kv_cache_shm=True
    )
    assert config.worker_roles() == [("prefill-0", "prefill"), ("decode-0", "decode")]
    prompt = "A long document, line after line of it, for the prefill worker. " * 8
    with running(config) as cluster, Client(cluster.address, timeout_s=60) as client:
        long = client.generate(prompt, max_tokens=4)
        short = client.generate("A short question?", max_tokens=4)
    assert (long.stats.prefill_worker_id, long.stats.decode_worker_id) == ("prefill-0", "decode-0")
    assert long.stats.num_transferred_blocks == len(prompt) // 16
    assert short.stats.prefill_worker_id == short.stats.decode_worker_id == "decode-0"


def test_up_counts_its_workers_by_role() -> None:
    assert [r for _, r in ClusterConfig().worker_roles()] == ["both", "both"]
    mixed = ClusterConfig(workers=1, prefill_workers=2, decode_workers=1).worker_roles()
    assert mixed == [
        ("worker-0", "both"),
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
    ]
    with pytest.raises(ValueError, match="prefill workers need a worker to decode"):
        ClusterConfig(prefill_workers=2)
    with pytest.raises(ValueError, match="workers must be in"):
        ClusterConfig(workers=0)
    with pytest.raises(ValueError, match="a cluster has 1 to 64 workers in all, not 65"):
        ClusterConfig(workers=60, decode_workers=5)
    with pytest.raises(ValueError, match="decode_workers must be >= 0"):
        ClusterConfig(decode_workers=-1)


def test_up_serves_the_http_api_from_its_own_router_only(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterConfig(http_port=8000), log_dir=tmp_path)
    argv = cluster._router_args("grpc://127.0.0.1:1")
    assert argv[argv.index("--http-port") + 1] == "8000"
    assert "--http-port" not in cluster._router_args("redis://r", port=0, http=False)
    assert "--http-port" not in LocalCluster(ClusterConfig(), log_dir=tmp_path)._router_args("x")
    with pytest.raises(ValueError, match="http_port must be -1 or in"):
        ClusterConfig(http_port=70000)


def test_up_gives_each_cpu_worker_its_share_of_the_cores(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterConfig(workers=2, port=0), log_dir=tmp_path)
    argv = cluster._worker_argv("worker-0", "both")
    threads = int(argv[argv.index("--cpu-threads") + 1])
    assert threads == max((os.cpu_count() or 1) // 2, 1)


def test_up_passes_its_kv_transport_to_the_router_and_refuses_an_unknown_one(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(ClusterConfig(kv_transport="nixl"), log_dir=tmp_path)
    args = cluster._router_args("grpc://127.0.0.1:1")
    assert args[args.index("--kv-transport") + 1] == "nixl"
    with pytest.raises(ValueError, match="kv_transport must be one of auto, nixl"):
        ClusterConfig(kv_transport="rdma")


def test_up_passes_cuda_graphs_to_gpu_workers_only(tmp_path: Path) -> None:
    gpu = LocalCluster(ClusterConfig(device="cuda", cuda_graphs=True), log_dir=tmp_path)
    assert "--cuda-graphs" in gpu._worker_argv("worker-0", "both")
    # Unsaid, the workers' own default (on for CUDA) holds; turned off, it is said.
    default = LocalCluster(ClusterConfig(device="cuda"), log_dir=tmp_path)._worker_argv("w", "both")
    assert "--cuda-graphs" not in default and "--no-cuda-graphs" not in default
    off = LocalCluster(ClusterConfig(device="cuda", cuda_graphs=False), log_dir=tmp_path)
    assert "--no-cuda-graphs" in off._worker_argv("worker-0", "both")
    with pytest.raises(ValueError, match="cuda_graphs is for GPU workers"):
        ClusterConfig(cuda_graphs=True)


def test_up_passes_its_adapters_to_every_worker(tmp_path: Path) -> None:
    config = ClusterConfig(lora=("sql=/a/sql", "chat=/a/chat"), max_loras=2)
    argv = LocalCluster(config, log_dir=tmp_path)._worker_argv("worker-1", "both")
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--lora"] == [
        "sql=/a/sql",
        "chat=/a/chat",
    ]
    assert argv[argv.index("--max-loras") + 1] == "2"
    plain = LocalCluster(ClusterConfig(), log_dir=tmp_path)._worker_argv("worker-0", "both")
    assert "--lora" not in plain and "--max-loras" not in plain and "--enable-lora" not in plain
    with pytest.raises(ValueError, match="NAME=PATH"):
        ClusterConfig(lora=("sql",))
    # Adapters loaded at run time: slots on every worker, the router's HTTP API loading them.
    updates = LocalCluster(
        ClusterConfig(enable_lora=True, lora_updates=True, http_port=0), log_dir=tmp_path
    )
    argv = updates._worker_argv("worker-0", "both")
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "4"
    assert "--lora-updates" in updates._router_args("memory://")
    assert "--lora-updates" not in updates._router_args("memory://", http=False)
    with pytest.raises(ValueError, match="give --http-port"):
        ClusterConfig(enable_lora=True, lora_updates=True)
    with pytest.raises(ValueError, match="give --enable-lora or a --lora"):
        ClusterConfig(lora_updates=True, http_port=0)


def free_port_run(length: int) -> int:
    """The first of ``length`` consecutive ports free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + length > 65536:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + length):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {length} consecutive free ports")


def test_up_serves_metrics_on_consecutive_ports_and_labels_worker_logs(tmp_path: Path) -> None:
    first = free_port_run(3)
    config = ClusterConfig(workers=2, port=0, grace_s=1.0, metrics_port=first)
    assert [config.metrics_port_of(n) for n in ("router", "worker-0", "worker-1")] == [
        first,
        first + 1,
        first + 2,
    ]
    with running(config, log_dir=tmp_path) as cluster, Client(cluster.address) as client:
        client.generate("metrics, please", max_tokens=2)
        pages = [
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            for port in (first, first + 1, first + 2)
        ]
    assert "kvswitch_router_requests_total" in pages[0]
    assert all("kvswitch_worker_requests_total" in page for page in pages[1:])
    # one worker served the request; the other's page is its own
    served = [
        p for p in pages[1:] if 'kvswitch_worker_requests_total{finish_reason="length"} 1.0' in p
    ]
    assert len(served) == 1
    for name in ("worker-0", "worker-1"):
        lines = (tmp_path / f"{name}.log").read_text().splitlines()
        logged = [line for line in lines if line.startswith("ts=")]
        assert logged and all(f" worker_id={name} " in line for line in logged)
    with pytest.raises(ValueError, match="metrics_port must be -1, 0 or a port with 2 more"):
        ClusterConfig(workers=2, metrics_port=65534)
