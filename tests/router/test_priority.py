"""Priority classes end to end: a busy worker starts interactive requests before batch ones.

One worker running one sequence at a time, busy with a long request while four more wait there
in a known order (each one waiting in the engine before the next is sent): two batch, then two
interactive, over the SDK and the OpenAI API (which also takes vLLM's integer priority). The long
one is then cancelled; each of the four runs to its end before the next starts, so the order
they finish in is the order they started in: each answer's 16 steps (``ANSWER_TOKENS``) keep the
next one's end well behind its own, however long its way back to its client thread takes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import httpx2
import pytest

from kvswitch.client import Client
from tests.router.harness import (
    ROUTER_CONFIG,
    WORKER_CONFIG,
    BackgroundCluster,
    wait_until,
)

ANSWER_TOKENS = 16


@pytest.fixture(scope="module")
def cluster() -> BackgroundCluster:
    router_config = dataclasses.replace(ROUTER_CONFIG, http_port=0)
    worker_config = dataclasses.replace(WORKER_CONFIG, max_num_seqs=1)
    with BackgroundCluster(1, router_config, worker_config) as background:
        yield background


def test_interactive_requests_start_before_the_batch_ones_queued_earlier(
    cluster: BackgroundCluster,
) -> None:
    worker = cluster.workers[0]
    front = cluster.router.http_front
    assert front is not None
    finished: list[str] = []
    lock = threading.Lock()

    def done(name: str) -> None:
        with lock:
            finished.append(name)

    with (
        Client(cluster.address, max_retries=0) as client,
        httpx2.Client(base_url=front.url, timeout=120) as http,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        model = http.get("/models").json()["data"][0]["id"]

        def over_grpc(name: str, priority: str) -> None:
            prompt = [256, *f"{name}: what comes next?".encode()]
            client.generate(prompt_token_ids=prompt, max_tokens=ANSWER_TOKENS, priority=priority)
            done(name)

        def over_http(name: str, priority: object) -> None:
            prompt = [256, *f"{name}: what comes next?".encode()]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": ANSWER_TOKENS,
                "priority": priority,
            }
            response = http.post("/completions", json=body)
            assert response.status_code == 200, response.text
            done(name)

        sends = [
            (over_grpc, "batch-1", "batch"),
            (over_http, "batch-2", 5),  # vLLM's integer priority: above 0, later
            (over_grpc, "chat-1", "interactive"),
            (over_http, "chat-2", "interactive"),
        ]
        busy = client.stream(prompt_token_ids=[256, *b"a long one"], max_tokens=1500)
        next(iter(busy))  # it runs
        futures = []
        for i, (send, name, priority) in enumerate(sends):
            futures.append(pool.submit(send, name, priority))
            wait_until(
                lambda n=i + 1: worker.engine.load.num_waiting_requests == n,
                f"{name} waiting in the engine",
            )
        busy.close()
        for future in futures:
            future.result(timeout=120)
    assert finished == ["chat-1", "chat-2", "batch-1", "batch-2"]


def test_a_bad_priority_is_refused(cluster: BackgroundCluster) -> None:
    front = cluster.router.http_front
    assert front is not None
    with httpx2.Client(base_url=front.url, timeout=60) as http:
        model = http.get("/models").json()["data"][0]["id"]
        response = http.post(
            "/completions",
            json={"model": model, "prompt": [256, 1], "max_tokens": 1, "priority": "urgent"},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"
    with pytest.raises(ValueError, match="priority"):
        Client(cluster.address).generate("x", priority="urgent")
