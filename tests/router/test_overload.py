"""Overload: bounded queues on the workers and the router answer RESOURCE_EXHAUSTED, with a
retry hint, instead of queueing without bound; what they admit still completes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvswitch.client import Client, KvswitchError
from kvswitch.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.router.harness import ROUTER_CONFIG, WORKER_CONFIG, BackgroundCluster

MAX_NUM_SEQS = 2
MAX_WAITING = 1
CAPACITY = 2 * (MAX_NUM_SEQS + MAX_WAITING)  # requests the two workers admit at once
MAX_STREAMS_PER_CLIENT = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[BackgroundCluster]:
    router = dataclasses.replace(ROUTER_CONFIG, max_streams_per_client=MAX_STREAMS_PER_CLIENT)
    worker = dataclasses.replace(
        WORKER_CONFIG,
        max_num_seqs=MAX_NUM_SEQS,
        max_waiting_requests=MAX_WAITING,
        check_integrity=True,
    )
    with BackgroundCluster(2, router, worker) as cluster:
        yield cluster


def request(n: int, max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=[256, 65 + n % 26, 66]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


class Held:
    """Streams opened and left unread: each decodes 1,000 tokens unless cancelled, so it keeps
    its place while the test looks."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.calls: list = []

    def open(self, num_calls: int) -> None:
        self.calls += [self._stub.Generate(request(n, 1000), timeout=60) for n in range(num_calls)]

    def wait_for_refusals(self, num_refused: int, timeout_s: float = 20.0) -> list:
        """The calls that ended, once ``num_refused`` have and the rest still run."""
        deadline = time.monotonic() + timeout_s
        while len(ended := [c for c in self.calls if c.done()]) < num_refused:
            assert time.monotonic() < deadline, f"only {len(ended)} calls ended"
            time.sleep(0.02)
        time.sleep(0.2)  # (and no more end)
        return [c for c in self.calls if c.done()]

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self._channel.close()


def test_a_full_fleet_answers_resource_exhausted_with_a_retry_hint(
    cluster: BackgroundCluster,
) -> None:
    held = Held(cluster.address)
    try:
        held.open(CAPACITY + 2)
        refused = held.wait_for_refusals(2)
        assert len(refused) == 2
        assert sum(w.engine.num_requests for w in cluster.workers) == CAPACITY
        for error in refused:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "is at its queue limit" in error.details()
            assert ("retry-after-ms", "100") in error.trailing_metadata()
        # The SDK's retries are budgeted: a fleet that stays full is not hammered.
        with Client(cluster.address, max_retries=3, initial_backoff_s=0.0) as client:
            errors = []
            for n in range(20):
                with pytest.raises(KvswitchError) as error:
                    client.generate(prompt_token_ids=[256, 65 + n], max_tokens=1)
                errors.append(error.value)
            assert {e.code for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert client.retry_budget.tokens == 0
    finally:
        held.close()
    # Places free once the streams end; then everything is admitted again.
    with Client(cluster.address) as client:
        results = list(
            concurrent.futures.ThreadPoolExecutor(CAPACITY).map(
                lambda n: client.generate(prompt_token_ids=[256, 70 + n], max_tokens=4),
                range(CAPACITY),
            )
        )
    assert all(len(r.token_ids) == 4 for r in results)
    assert_idle_and_whole(cluster)


def test_one_client_may_hold_only_so_many_streams(cluster: BackgroundCluster) -> None:
    cluster.add_worker("roomy", max_num_seqs=2 * MAX_STREAMS_PER_CLIENT)
    held = Held(cluster.address)
    try:
        held.open(MAX_STREAMS_PER_CLIENT + 1)
        [refused] = held.wait_for_refusals(1)
        assert sum(w.engine.num_requests for w in cluster.workers) == MAX_STREAMS_PER_CLIENT
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"this client has {MAX_STREAMS_PER_CLIENT} streams open" in refused.details()
    finally:
        held.close()
        cluster.stop_worker(cluster.worker("roomy"))
    assert_idle_and_whole(cluster)


def assert_idle_and_whole(cluster: BackgroundCluster) -> None:
    done = threading.Event()
    for worker in cluster.workers:
        for _ in range(500):
            load = worker.engine.load
            if worker.engine.num_requests == 0 and load.num_free_blocks == load.num_total_blocks:
                break
            done.wait(0.02)
        else:
            raise AssertionError(f"{worker.worker_id} is not idle: {worker.engine.load}")
        assert worker.engine.counters.num_integrity_checks > 0
