"""A fleet across hosts, on one machine: Redis, two routers and three workers, each in a network
namespace of its own with its own address (``tests/deploy/netns.py``), and a client in another.
Real processes, real traffic between the namespaces, none outside them.

- Routing by cache works across hosts: a document sent through one router, then questions about
  it through the other, land where the document is cached (the routers share the Redis index).
- A worker whose link is cut (link down at the switch: no RST, nothing) is left out within 2 s,
  and every request completes with the tokens one worker would give, those it was serving
  resumed elsewhere; its link restored, it serves again, no worker keeps a block of the streams
  it lost, and the index agrees with every worker (docs/RELIABILITY.md).

Skips, saying why, where network namespaces cannot be made (not root).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvswitch.serving import start_server_process
from kvswitch.worker.engine import LLMEngine
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.request import SamplingParams
from tests.deploy.netns import NetnsHosts, hosts_or_skip

CLIENT = Path(__file__).with_name("netns_client.py")
WORKERS = {"w1": 21, "w2": 22, "w3": 23}
ROUTERS = {"r1": 11, "r2": 12}
DETECTION_S = 2.0


@dataclass
class Fleet:
    hosts: NetnsHosts
    routers: list[str]  # addresses
    tmp: Path
    index: str  # the Redis index's URL

    def send(self, requests: list[dict]) -> dict:
        """Run the client on its host with these requests; its report."""
        return self.finish(self.start(requests))

    def start(self, requests: list[dict]) -> tuple[subprocess.Popen, Path]:
        spec, out = self.tmp / f"spec-{time.monotonic_ns()}.json", self.tmp / "out.json"
        spec.write_text(json.dumps({"routers": self.routers, "requests": requests}))
        out = spec.with_suffix(".out.json")
        process = self.hosts.popen(
            "client", sys.executable, str(CLIENT), str(spec), str(out), stderr=subprocess.PIPE
        )
        return process, out

    @staticmethod
    def finish(started: tuple[subprocess.Popen, Path]) -> dict:
        process, out = started
        _, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr.decode()[-2000:]
        return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    hosts = hosts_or_skip()
    processes: list[subprocess.Popen] = []
    try:
        redis_address = hosts.add("redis", 2)
        for name, octet in {**ROUTERS, **WORKERS, "client": 99}.items():
            hosts.add(name, octet)
        redis = hosts.popen(
            "redis", "redis-server", "--bind", redis_address, "--port", "6379",
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        processes.append(redis)
        deadline = time.monotonic() + 10
        ping = f"import redis; redis.Redis(host={redis_address!r}, socket_timeout=1).ping()"
        while hosts.run("client", sys.executable, "-c", ping).returncode != 0:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        index = f"redis://{redis_address}:6379"
        routers = []
        for name in ROUTERS:
            process, address = start_server_process(
                [
                    "router", "--host", hosts.hosts[name], "--port", "50051", "--index", index,
                    "--refresh-s", "0.1", "--load-poll-s", "0.1", "--wait-for-worker-s", "20",
                    # NOTE: on the hosts' addresses, beyond loopback, open: the client and the
                    # checks call the workers without credentials.
                    "--insecure",
                ],
                prefix=hosts.prefix_for(name),
            )  # fmt: skip
            processes.append(process)
            routers.append(address)
        for name in WORKERS:
            process, _ = start_server_process(
                [
                    "worker", "--host", hosts.hosts[name], "--port", "50061", "--worker-id", name,
                    "--index", index, "--kv-cache-bytes", str(512 * (32 << 10)), "--grace-s", "0",
                    # NOTE: three CPU workers on this machine's cores: each its share, or their
                    # thread pools spin against each other and every step slows many times over.
                    "--cpu-threads", "1",
                    "--insecure",
                ],
                prefix=hosts.prefix_for(name),
            )  # fmt: skip
            processes.append(process)
        fleet = Fleet(hosts, routers, tmp_path_factory.mktemp("netns"), index)
        wait_for_workers(fleet, set(WORKERS))
        yield fleet
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait(timeout=30)
        hosts.close()


def wait_for_workers(fleet: Fleet, wanted: set[str], timeout_s: float = 30) -> None:
    """Until requests through the routers have landed on every worker of ``wanted``."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    rng = np.random.default_rng(len(wanted))
    while not wanted <= seen:
        assert time.monotonic() < deadline, f"only {sorted(seen)} of {sorted(wanted)} serve"
        requests = [request(rng.integers(1, 256, 40).tolist(), 2, i % 2, 0.0) for i in range(6)]
        seen |= {r["worker_id"] for r in fleet.send(requests)["results"] if not r["error"]}


def request(prompt: list[int], max_tokens: int, router: int, at_s: float) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "router": router, "at_s": at_s}


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(EngineConfig())


def expected(engine: LLMEngine, requests: list[dict]) -> list[list[int]]:
    """What one worker gives each request (greedy; batched, as a worker batches them: the
    same tokens, in less than half the time of one request after another)."""
    [max_tokens] = {r["max_tokens"] for r in requests}
    return engine.generate([r["prompt"] for r in requests], SamplingParams(max_tokens=max_tokens))


def test_questions_through_one_router_find_the_document_another_router_placed(
    fleet: Fleet, reference: LLMEngine
) -> None:
    rng = np.random.default_rng(1)
    document = rng.integers(1, 256, 640).tolist()  # 40 blocks
    (placed,) = fleet.send([request([*document, 7], 4, 0, 0.0)])["results"]
    assert not placed["error"]
    time.sleep(0.3)  # the worker publishes its blocks to the index every 20 ms
    questions = [
        request([*document, *rng.integers(1, 256, 24).tolist()], 4, 1, 0.2 * i) for i in range(4)
    ]
    results = fleet.send(questions)["results"]
    assert [r["error"] for r in results] == [""] * 4
    assert {r["worker_id"] for r in results} == {placed["worker_id"]}
    assert all(r["num_cached_tokens"] >= 39 * 16 for r in results)
    assert [r["token_ids"] for r in results] == expected(reference, questions)


def test_a_cut_link_is_left_out_within_2_s_and_no_request_is_lost(
    fleet: Fleet, reference: LLMEngine
) -> None:
    rng = np.random.default_rng(2)
    # Answers long enough that w2 is serving some when its link goes (a client waits for one),
    # few enough that the machine keeps up (each token passes a worker, a router, the client);
    # sent over 9 s, so that some leave well after the cut however long w2 took to get busy.
    requests = [request(rng.integers(1, 256, 200).tolist(), 400, i % 2, 0.4 * i) for i in range(24)]
    started = fleet.start(requests)
    time.sleep(1.0)
    w2 = f"{fleet.hosts.hosts['w2']}:50061"
    busy = fleet.hosts.run("client", sys.executable, str(CLIENT), "--wait-busy", w2)
    assert busy.returncode == 0, busy.stderr
    fleet.hosts.cut("w2")
    # NOTE: timed once the link is down: the command itself can take a while on a busy machine.
    cut_s = time.monotonic()
    try:
        report = Fleet.finish(started)
    finally:
        fleet.hosts.restore("w2")
    results = report["results"]
    assert [r["error"] for r in results] == [""] * len(requests)  # none lost
    assert [r["token_ids"] for r in results] == expected(reference, requests)
    # NOTE: w2 ran a request at the cut (--wait-busy said so); whether one of its requests had
    # also ended before the cut is up to the machine's speed, so it is not asked.
    after = [r for r in results if r["sent_s"] > cut_s + DETECTION_S]
    assert after and "w2" not in {r["worker_id"] for r in after}
    # What it was serving at the cut was resumed on another worker, within about 2 s.
    resumed = [r for r in results if r["reason"].startswith("failover")]
    assert resumed and "w2" not in {r["worker_id"] for r in resumed}
    # NOTE: a resumed stream ends once another worker has generated the rest of its 400 tokens,
    # which takes what the machine takes (up to 9.7 s after the cut on a busy 2-core one, more
    # with other tests running beside this one); a stream nobody moved off w2 would wait out its
    # 60 s deadline (and fail, which the first check above would catch too).
    late = [(r["sent_s"] - cut_s, r["done_s"] - cut_s) for r in resumed]
    assert all(done_s < 55 for _, done_s in late), late

    # Its link back, it serves again; quiet, no worker keeps a block of the streams it lost, and
    # the index agrees with every worker (w2 registered again once its link was back).
    wait_for_workers(fleet, {"w2"})
    workers = [f"{name}={fleet.hosts.hosts[name]}:50061" for name in WORKERS]
    quiet = fleet.hosts.run(
        "client", sys.executable, str(CLIENT), "--check-quiet", fleet.index, *workers
    )
    assert quiet.returncode == 0, quiet.stderr
    report = json.loads(quiet.stdout)
    assert report["leaked_blocks"] == dict.fromkeys(WORKERS, 0), report
    assert report["index_clean"], report
